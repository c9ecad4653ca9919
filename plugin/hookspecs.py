"""Extension points the patches call (pluggy, pytest style).

Each wrapper in ``vllm_kvguard.patches`` calls exactly one of these hooks; the project's
own fixes are hookimpls in ``vllm_kvguard.fixes``. Third parties register more hookimpls
through the entry-point group ``vllm_kvguard.hooks`` (see README, "Extending").

Conventions: ``call`` is the host call (:class:`vllm_kvguard.registry.HostCall`); a
``firstresult`` hook whose implementations all return None lets the wrapper run
``call()`` itself, so vLLM's behaviour is unchanged when nobody implements it.
"""
import pluggy

PROJECT = "vllm_kvguard"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


# --------------------------------------------------------------------------- allocator
@hookspec(firstresult=True)
def kvguard_allocate_slots(manager, request, call):
    """Run ``KVCacheManager.allocate_slots`` (``call()``) and return its result.

    The rollback fix snapshots what the call may touch, runs it, and on a mid-way
    exception restores every group and returns None ("no room now").
    """


@hookspec
def kvguard_allocation_rolled_back(manager, request, group, error):
    """An allocation was rolled back; ``group`` is the failing KV-cache group or None."""


@hookspec(firstresult=True)
def kvguard_inject_fault(pool, num_blocks):
    """Return an exception to raise from ``BlockPool.get_new_blocks`` (test-only), or None."""


@hookspec
def kvguard_after_schedule(scheduler, output):
    """After every ``Scheduler.schedule()``: audit invariants, liveness guard."""


# --------------------------------------------------------------------------- estimation
@hookspec(firstresult=True)
def kvguard_reserved_blocks(spec, num_tokens, num_lookahead_tokens, max_model_len,
                            max_encoder_len, dcp):
    """Blocks the allocator reserves for one request of ``num_tokens`` in one KV group."""


@hookspec(firstresult=True)
def kvguard_warmup(model_runner, call):
    """Run the model-runner-V2 warmup (``call()``) best-effort, in-bounds, cleaned up."""


@hookspec
def kvguard_startup_report(vllm_config, kv_cache_config):
    """Return report lines (list of str) to log once the KV cache is sized."""


# --------------------------------------------------------------------------- cudagraph
@hookspec
def kvguard_cudagraph_dispatched(runner, dispatcher, call, result):
    """A CUDA-graph dispatch returned ``result``; count and explain eager fallbacks."""


@hookspec
def kvguard_cudagraph_fallback(runner, reason, num_tokens, detail):
    """A batch the configuration meant to graph ran eager or PIECEWISE, for ``reason``."""
