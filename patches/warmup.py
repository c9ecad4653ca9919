"""Host surface: model-runner warmup, profiling, and the scheduler's KV sizing report.

Targets (each declares its own range below; all optional except the scheduler's)
    ``vllm.v1.worker.gpu.warmup._warmup_kernels`` (0.32+) and ``.warmup_kernels`` (0.27.1,
    where the plan lives in ``warmup_kernels`` itself; also re-bound in
    ``vllm.v1.worker.gpu_worker``)
        -> hook ``kvguard_warmup`` -> :mod:`vllm_kvguard.fixes.estimation.warmup_guard`
        The V2 warmup reserves what the allocator reserves (0.27.1 ignores lookahead and
        Mamba speculative blocks outside align mode: vllm#51438), never hands out a block
        id >= the pool's block count (all versions: the one-request floor), and a failing
        step is rolled back so startup continues (skip-on-failure). vllm#51438 (re-land of
        vllm#50531) fixed the count in 0.32; the bounds and the cleanup are unfixed upstream.
        Remove when: vLLM's warmup checks ``next_block_id <= num_blocks`` and cleans up in
        ``try/finally`` (and 0.27.1 leaves the supported range).
    ``vllm.v1.worker.gpu.warmup._reserved_block_count`` (0.32+)
        -> hook ``kvguard_reserved_blocks`` -> :mod:`vllm_kvguard.fixes.estimation.estimate`: vLLM's own
        warmup count follows the same model (used by ``run_mixed_prefill_decode_warmup``),
        in each pin's arguments (0.34: DCP and the per-request row cap). On 0.34 the guard
        bounds block ids by ``num_committable_kv_blocks`` (the extensible KV cache).
        Remove when: the warmup guard above is removed.
    ``vllm.v1.worker.gpu_model_runner.GPUModelRunner._dummy_sampler_run`` (MRV1, <0.34:
    Model Runner V1 is gone from 0.34)
        -> hook ``kvguard_dummy_sampler_run`` -> :mod:`vllm_kvguard.fixes.estimation.warmup_guard`:
        the rejection sampler is profiled with k drafts per request, not 1 (vllm#37521).
        MRV2's ``profile_run`` -> ``_dummy_sampler_run`` runs no rejection sampler at all
        (0.34 too); that is not backported (it needs a GPU to build and prove).
        Remove when: vLLM profiles ``num_speculative_tokens`` drafts (vllm#37521 merged).
    ``vllm.v1.core.sched.scheduler.Scheduler.__init__`` (all)
        -> hook ``kvguard_startup_report`` -> :mod:`vllm_kvguard.fixes.estimation.capacity`: one
        spec-aware table per KV-cache group (blocks per request with and without
        speculation, true maximum concurrency beside vLLM's figure, Mamba FULL-decode
        feasibility). Upstream: none filed (vLLM's own check and its "Maximum concurrency"
        line ignore speculative blocks and the null block).
        Remove when: vLLM's "Maximum concurrency" line and its Mamba FULL-decode check
        count speculative blocks, the null block and attention groups.
        The same hook -> :mod:`vllm_kvguard.fixes.estimation.certificate`: the prompt and
        total limits of vLLM's own admission path, stated and published for the door
        (:mod:`vllm_kvguard.patches.admission`); the liveness guard uses the same. Outside
        the proven range the admission patch's self-test runs here first
        (:func:`vllm_kvguard.verify.due`, on a copy of this engine's config); no startup
        report for a self-test's own private scheduler.
Why
    Estimates that forget speculative decoding pass the check and then overflow the
    pool (TensorRT-LLM "count spec extra tokens in warmup block estimates"; vllm#51438).
"""
from __future__ import annotations

import importlib
import logging

from vllm_kvguard import verify
from vllm_kvguard.log import once
from vllm_kvguard.manager import hook
from vllm_kvguard.hostcall import HostCall, hooked
from vllm_kvguard.registry import Patch, Private, Target

NAME = "warmup"
WARMUP_MODULE = "vllm.v1.worker.gpu.warmup"
COMMITTABLE_MODULE = "vllm.v1.worker.extensible_kv_cache"   # 0.34+: warmup's block bound


def _handled(hook_caller, call: HostCall, **kwargs):
    """Call a firstresult hook that may run ``call``, skip it (non-None result), or
    decline (None, host call not run: run it here)."""
    result = hook_caller(call=call, **kwargs)
    if result is None and not call.started:
        return call()
    return call.result if call.done else None


@hooked(NAME)
def inner_warmup_kernels(call: HostCall):
    """``_warmup_kernels`` (0.32+): the plan and the steps."""
    return _handled(hook().kvguard_warmup, call, model_runner=call.arg(0, "model_runner"))


@hooked(NAME)
def warmup_kernels(call: HostCall):
    """``warmup_kernels``: guarded here only where no ``_warmup_kernels`` exists (0.27.1)."""
    if hasattr(importlib.import_module(WARMUP_MODULE), "_warmup_kernels"):
        return call()
    return _handled(hook().kvguard_warmup, call, model_runner=call.arg(0, "model_runner"))


@hooked(NAME)
def reserved_block_count(call: HostCall):
    """vLLM's own warmup count (0.32+) answered by the same block model, in the pin's own
    arguments (0.34: ``vllm_config`` for the row cap, ``dcp_world_size``)."""
    from vllm_kvguard.fixes.estimation.estimate import warmup_block_count

    if "max_model_len" not in call.kwargs:
        return call()
    kwargs = {k: call.kwargs[k] for k in _COUNT_ARGS if k in call.kwargs}
    n = warmup_block_count(call.arg(0, "num_tokens"), call.arg(1, "kvcache_spec"),
                           max_encoder_len=call.kwargs.get("max_encoder_len", 0),
                           num_lookahead_tokens=call.kwargs.get("num_lookahead_tokens", 0),
                           **kwargs)
    return n if n is not None else call()


_COUNT_ARGS = ("max_model_len", "vllm_config", "dcp_world_size")


@hooked(NAME)
def dummy_sampler_run(call: HostCall):
    runner = call.instance if call.instance is not None else call.arg(0, "self")
    return _handled(hook().kvguard_dummy_sampler_run, call, runner=runner)


@hooked(NAME)
def scheduler_init(call: HostCall):
    call()
    if verify.testing():                # a self-test's private scheduler: not the engine's
        return
    sched = call.instance
    # outside the proven range: the admission patch proves itself here, on this engine's
    # config, before the certificate publishes its limits (a failure: none published)
    verify.due("admission", vllm_config=sched.vllm_config)
    lines = []
    for part in hook().kvguard_startup_report(vllm_config=sched.vllm_config,
                                              kv_cache_config=sched.kv_cache_config,
                                              scheduler=sched):
        lines.extend(part or ())
    if lines:
        once(logging.INFO, ("startup-report",), "%s", "\n".join(lines))


def _setup(flags):
    from vllm_kvguard.fixes.estimation import capacity, certificate, estimate, warmup_guard
    from vllm_kvguard.manager import register

    register(estimate, "kvguard.estimate")
    register(warmup_guard, "kvguard.warmup_guard")
    register(capacity, "kvguard.capacity")
    register(certificate, "kvguard.certificate")


def _teardown():
    from vllm_kvguard.fixes.estimation import admission
    from vllm_kvguard.manager import unregister

    for name in ("kvguard.estimate", "kvguard.warmup_guard", "kvguard.capacity",
                 "kvguard.certificate"):
        unregister(name)
    admission.clear_published()


PATCH = Patch(
    name=NAME,
    summary="spec-aware block estimation: in-bounds, best-effort V2 warmup; k-draft "
            "sampler profiling; spec-aware startup capacity report",
    targets=[
        Target(WARMUP_MODULE, "_warmup_kernels", inner_warmup_kernels, required=False),
        Target(WARMUP_MODULE, "warmup_kernels", warmup_kernels,
               also_at=("vllm.v1.worker.gpu_worker",), required=False),
        Target(WARMUP_MODULE, "_reserved_block_count", reserved_block_count, required=False),
        Target("vllm.v1.worker.gpu_model_runner", "GPUModelRunner._dummy_sampler_run",
               dummy_sampler_run, required=False, versions="<0.34"),
        Target("vllm.v1.core.sched.scheduler", "Scheduler.__init__", scheduler_init),
    ],
    uses=(Private(WARMUP_MODULE, "", ("_warmup_kernels",), ">=0.32"),
          Private(WARMUP_MODULE, "_reserved_block_count", ("vllm_config", "dcp_world_size"),
                  ">=0.34"),
          Private(COMMITTABLE_MODULE, "", ("num_committable_kv_blocks",), ">=0.34"),
          Private("vllm.v1.worker.gpu.model_runner", "GPUModelRunner",
                  ("extensible_kv_cache", "speculator"), ">=0.34"),
          # the certificate calls vLLM's admission count on the scheduler's own managers
          Private("vllm.v1.core.kv_cache_manager", "KVCacheManager", ("coordinator",)),
          Private("vllm.v1.core.kv_cache_coordinator", "KVCacheCoordinator",
                  ("single_type_managers", "get_num_blocks_to_allocate")),
          Private("vllm.v1.core.single_type_kv_cache_manager", "SingleTypeKVCacheManager",
                  ("req_to_blocks", "get_num_blocks_to_allocate")),
          Private("vllm.v1.core.sched.scheduler", "Scheduler",
                  ("kv_cache_manager", "max_num_scheduled_tokens")),
          Private("vllm.v1.core.sched.scheduler", "Scheduler",
                  ("scheduler_reserve_full_isl", "need_mamba_block_aligned_split",
                   "_mamba_block_aligned_split"), ">=0.32")),
    vllm_versions=">=0.27.1,<0.35",
    upstream=("vllm#51438", "vllm#50531", "vllm#37521"),
    remove_when="vLLM's V2 warmup bounds its block ids and cleans up on failure, "
                "MRV1 profiles k drafts (vllm#37521), and the startup concurrency / Mamba "
                "FULL-decode checks count speculative blocks",
    setup=_setup,
    teardown=_teardown,
)
