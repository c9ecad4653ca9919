"""Extension points the patches call (pluggy, pytest style).

Each wrapper in ``vllm_kvguard.patches`` calls exactly one of these hooks; the project's
own fixes are hookimpls in ``vllm_kvguard.fixes``. Third parties register more hookimpls
through the entry-point group ``vllm_kvguard.hooks`` (see README, "Extending").

Conventions: ``call`` is the host call (:class:`vllm_kvguard.hostcall.HostCall`); a
``firstresult`` hook whose implementations all return None without running ``call()``
lets the wrapper run it, so vLLM's behaviour is unchanged when nobody implements it.
"""
import pluggy

PROJECT = "vllm_kvguard"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


# --------------------------------------------------------------------------- allocator
@hookspec(firstresult=True)
def kvguard_allocate_slots(manager, request, call):
    """Run ``KVCacheManager.allocate_slots`` (``call()``) and return its result.

    The rollback fix runs the call as a transaction and on a mid-way exception restores
    every group and the pool and returns None ("no room now"). The first implementation
    that returns a result or runs ``call()`` decides. While the rollback fix is the only
    implementation, managers call its transaction directly (without this hook); any other
    registration sends every call through the hook again (patches/allocator.py).
    """


@hookspec
def kvguard_allocation_rolled_back(manager, request, group, error):
    """An allocation was rolled back; ``group`` is the failing KV-cache group or None."""


@hookspec(firstresult=True)
def kvguard_inject_fault(pool, num_blocks):
    """Return an exception to raise from ``BlockPool.get_new_blocks`` (test-only), or None."""


@hookspec(firstresult=True)
def kvguard_inject_connector_fault(connector, phase, request):
    """Return an exception to raise from the scheduler-side KV connector's call for
    ``phase`` (``"lookup"``: ``get_num_new_matched_tokens``, ``"update"``:
    ``update_state_after_alloc``) on ``request`` (test-only), or None."""


@hookspec
def kvguard_inject_freeze(scheduler):
    """``Scheduler.update_from_output`` is about to run (one step completing): block here,
    forever, to freeze EngineCore's step (test-only ``KVGUARD_FAULTS=phase=freeze``)."""


@hookspec(firstresult=True)
def kvguard_inject_load_failure(scheduler, scheduler_output, model_runner_output):
    """Return ``model_runner_output`` with KV loads of this step reported failed (their
    blocks in ``kv_connector_output.invalid_block_ids``, as a worker reports them) for
    ``Scheduler.update_from_output`` to see (test-only), or None to leave it."""


# --------------------------------------------------------------------------- containment
@hookspec(firstresult=True)
def kvguard_guard_connector_call(connector, method, fn):
    """The scheduler-side KV connector ``connector`` was built: return a callable to use
    instead of its bound method named ``method`` (``fn``), or None to leave it. Ours runs
    ``fn`` and contains an ``Exception`` to the request it was called for
    (:mod:`vllm_kvguard.fixes.containment.containment`)."""


@hookspec
def kvguard_connector_meta_built(scheduler, connector):
    """``Scheduler`` built ``connector``'s metadata for this step (the end of
    ``schedule()``): ours ends every request whose connector call failed in the step."""


@hookspec
def kvguard_after_schedule(scheduler, output):
    """After every ``Scheduler.schedule()`` returned ``output``: the audit (registered only
    with ``KVGUARD_AUDIT=1``), the liveness guard, and the rollback (it ends a request
    whose failed allocation could not be undone). Return value ignored. An
    implementation must not raise (ours log once and skip)."""


@hookspec
def kvguard_admit(request):
    """The front end's input processing built ``request`` (an ``EngineCoreRequest``) and
    is about to send it to EngineCore: raise a ``ValueError`` to refuse it (vLLM's own
    input-validation path: ``LLM.generate`` raises, ``vllm serve`` answers HTTP 400).
    Ours: the admission certificate (:mod:`vllm_kvguard.fixes.estimation.admission`)."""


# --------------------------------------------------------------------------- distributed
@hookspec
def kvguard_worker_env_vars(environ):
    """Names of variables in ``environ`` (the driver's) that vLLM must copy to its Ray
    workers besides its own prefixes (an iterable each; the union is used). Ours: every
    ``KVGUARD*`` variable (:mod:`vllm_kvguard.fixes.worker_env`)."""


# --------------------------------------------------------------------------- health
@hookspec
def kvguard_engine_core_started(engine_core):
    """An ``EngineCoreProc`` (one per data-parallel rank) enters its busy loop. Ours: its
    heartbeat is offered to the front end (:mod:`vllm_kvguard.fixes.health.heartbeat`)."""


@hookspec(firstresult=True)
def kvguard_check_health(engine):
    """vLLM's ``AsyncLLM.check_health`` found ``engine`` alive: return a short reason
    (str) to answer unhealthy (vLLM's ``EngineDeadError`` path: ``/health`` 503), or
    None. Ours: a stalled or wedged EngineCore (:mod:`vllm_kvguard.fixes.health.verdict`).
    An implementation must not raise (ours log once and answer None)."""


# --------------------------------------------------------------------------- estimation
@hookspec(firstresult=True)
def kvguard_reserved_blocks(spec, num_tokens, num_lookahead_tokens, max_model_len,
                            num_encoder_tokens, dcp, num_computed_tokens, num_settled_tokens,
                            checkpointing):
    """Blocks the allocator reserves for one request in the KV group of ``spec``.

    Return a :class:`vllm_kvguard.fixes.estimation.estimate.Reserved` ``(table, physical)``: block-table
    entries (nulls included) and distinct pool blocks held, after ``allocate_slots`` for a
    request whose high-water mark is ``num_tokens`` (``num_computed_tokens`` computed
    before the step, ``num_settled_tokens`` of them settled, None: all; ``checkpointing``:
    the manager's Mamba prefill-checkpoint numbers or None), or None for a spec you don't
    model. Ours is ``trylast``, so a
    third-party impl can answer for custom specs first.
    """


@hookspec(firstresult=True)
def kvguard_warmup(model_runner, call):
    """Run the model-runner-V2 kernel warmup (``call()``) in-bounds and best-effort.

    ``call`` is vLLM's ``_warmup_kernels`` (0.32+) or ``warmup_kernels`` (0.27.1) call; an
    impl may replace ``call.args`` before running it. Returning a non-None value without
    running ``call()`` skips the warmup; the wrapper returns ``call``'s result if it ran.
    """


@hookspec(firstresult=True)
def kvguard_dummy_sampler_run(runner, call):
    """Run model-runner-V1 ``_dummy_sampler_run`` (``call()``) and return its result.

    The profiling fix makes the rejection sampler see k drafts per request (vllm#37521).
    """


@hookspec
def kvguard_startup_report(vllm_config, kv_cache_config, scheduler):
    """Return report lines (list of str) to log once per process, after a ``Scheduler``
    is built (``scheduler``: that scheduler; None where the report is asked without one)."""


# --------------------------------------------------------------------------- cudagraph
# Startup hooks run once per KV-cache (re)initialisation of a model runner (V1
# ``gpu_model_runner.GPUModelRunner`` and its CPU subclass, V2 ``gpu.model_runner``). The
# runtime dispatch path calls no hook unless a batch the configuration meant to graph
# falls back (``kvguard_cudagraph_fallback``). The project's impls are the objects in
# :mod:`vllm_kvguard.fixes.cudagraph.hooks`, built and registered by the cudagraph patch.
@hookspec
def kvguard_cudagraph_before_kv_init(runner, kv_cache_config, is_profiling):
    """``runner.initialize_kv_cache(kv_cache_config)`` is about to run: the capture
    sizes can still change (attention builders and graph keys are built inside it).
    Ours: capture completion when ``KVGUARD_CUDAGRAPH_COMPLETE`` is on and this is not a
    profiling pass (:func:`vllm_kvguard.fixes.cudagraph.planner.complete`)."""


@hookspec
def kvguard_cudagraph_after_kv_init(runner, kv_cache_config, is_profiling):
    """``runner.initialize_kv_cache`` returned: the graph keys exist (not captured yet).
    Ours: the worker's padding-id check, and outside profiling one coverage table
    (:func:`vllm_kvguard.fixes.cudagraph.coverage.audit`), logged on the first rank."""


@hookspec
def kvguard_cudagraph_before_capture(runner, profile_only):
    """``runner.capture_model`` is about to run. Ours: on a V2 runner, capture is allowed
    again for it (the capture lock is lifted)."""


@hookspec
def kvguard_cudagraph_captured(runner, profile_only):
    """``runner.capture_model`` returned. Ours, unless ``profile_only``: arm the runtime
    fallback accounting on the runner's graph owner, and on a V2 runner disable further
    capture (as V1 does)."""


@hookspec
def kvguard_cudagraph_reinit(worker, phase, error):
    """KV re-initialisation around the plugin's state: ``phase`` is ``"suspend"``
    (before ``Worker.sleep``) or ``"resume"`` (after ``Worker.wake_up``, also when it
    raised); ``error`` is the exception the host call raised, or None. Ours: suspend the
    armed accounting; on resume re-install it (or release it with one warning) and, if
    ``wake_up`` succeeded, re-check the padding ids."""


@hookspec
def kvguard_block_pool_ready(pool):
    """A scheduler ``BlockPool`` was built: check the null block padding relies on."""


@hookspec
def kvguard_cudagraph_fallback(owner, reason, mode, num_tokens, detail):
    """A batch the configuration meant to graph ran ``mode`` (``"NONE"``, eager, or
    ``"PIECEWISE"``) on ``owner`` (a V1 ``CudagraphDispatcher`` / V2 ``CudaGraphManager``),
    for ``reason`` (one of :data:`vllm_kvguard.fixes.cudagraph.fallbacks.REASONS`); ``num_tokens`` is
    the batch's token count and ``detail`` a short text. Called on the fallback path only
    (never for a graphed batch). Ours counts it and warns once per reason."""
