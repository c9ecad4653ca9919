"""Host surface: CUDA-graph capture sizing, dispatch and the padding target.

Targets (V2 ones are optional: skipped with a log line where absent)
    ``vllm.v1.worker.gpu_model_runner.GPUModelRunner.initialize_kv_cache`` (V1, and the CPU
    runner through ``super()``) and ``vllm.v1.worker.gpu.model_runner.GPUModelRunner.
    initialize_kv_cache`` (V2)
        -> ``kvguard_cudagraph_before_kv_init`` (opt-in capture completion, before attention
        builders and graph keys are sized) and ``kvguard_cudagraph_after_kv_init`` (one
        coverage table per KV init, worker padding ids) -> :mod:`vllm_kvguard.fixes.coverage`
    ``...GPUModelRunner.capture_model`` (V1, V2)
        -> ``kvguard_cudagraph_before_capture`` / ``kvguard_cudagraph_captured``: arm runtime
        accounting on the runner's graph owner (:mod:`vllm_kvguard.fixes.fallbacks`); V2:
        capture disabled after a non-profile capture, as V1 does
    ``vllm.v1.worker.gpu.dp_utils.sync_cudagraph_and_dp_padding`` (V2; called by
    ``dispatch_cg_and_sync_dp`` only when ``dp_size > 1``, so a single-rank step pays nothing)
        -> a rank forced eager by the DP agreement is counted (``dp_sync_forced``)
    ``vllm.v1.core.block_pool.BlockPool.__init__``
        -> ``kvguard_block_pool_ready``: block 0 is the reserved null block, never free
    ``vllm.v1.worker.gpu_worker.Worker.sleep`` / ``.wake_up``
        -> ``kvguard_cudagraph_reinit``: suspend / resume (or release) the armed accounting
Per instance, never at class level on the dispatch path (see :data:`DISPATCH_METHODS`)
    V1 ``CudagraphDispatcher.dispatch`` gets a counting closure; V2 ``CudaGraphManager.
    dispatch`` is left as is: its misses and FULL->PIECEWISE fall-throughs are seen without
    a wrapper (:mod:`vllm_kvguard.fixes.fallbacks`). Armed after capture, only when the
    configuration intends graphs.
Why
    Batches no captured graph covers run eager with no log and no counter: with 3 draft
    tokens and max_num_seqs=256 the default capture ceiling (512 tokens) leaves every decode
    step of 129-256 requests eager; ragged drafts make a batch non-uniform (PIECEWISE, or
    eager under FULL_DECODE_ONLY); V2 never disables capture after capture_model.
Upstream
    vllm#27325, vllm#50488, vllm#54933, vllm#57355 (decode shapes left uncaptured),
    vllm#37576, vllm#51509, vllm#52728 (users asking for fallback visibility / metrics).
Remove when
    vLLM captures every reachable uniform decode shape by default (vllm#50488 in every
    supported release, vllm#54933 fixed), warns on and exports eager/PIECEWISE fallbacks by
    reason (vllm#37576/#51509 merged), and model runner V2 disables capture after
    ``capture_model``.
"""
from __future__ import annotations

import logging

from vllm_kvguard.fixes import fallbacks
from vllm_kvguard.log import once
from vllm_kvguard.manager import hook
from vllm_kvguard.hostcall import HostCall, hooked
from vllm_kvguard.registry import Patch, Target

NAME = "cudagraph"
V1_RUNNER = "vllm.v1.worker.gpu_model_runner"
V2_RUNNER = "vllm.v1.worker.gpu.model_runner"

#: Methods replaced per instance (not wrapped at class level); the drift test checks them.
DISPATCH_METHODS = (("vllm.v1.cudagraph_dispatcher", "CudagraphDispatcher.dispatch"),
                    ("vllm.v1.worker.gpu.cudagraph_utils", "CudaGraphManager.dispatch"))


@hooked(NAME)
def initialize_kv_cache(call: HostCall):
    runner = call.instance
    kv_cache_config = call.arg(0, "kv_cache_config")
    is_profiling = bool(call.arg(1, "is_profiling", False))
    hook().kvguard_cudagraph_before_kv_init(runner=runner, kv_cache_config=kv_cache_config,
                                            is_profiling=is_profiling)
    result = call()
    hook().kvguard_cudagraph_after_kv_init(runner=runner, kv_cache_config=kv_cache_config,
                                           is_profiling=is_profiling)
    return result


@hooked(NAME)
def capture_model(call: HostCall):
    profile_only = bool(call.kwargs.get("profile_only", False))
    hook().kvguard_cudagraph_before_capture(runner=call.instance, profile_only=profile_only)
    result = call()
    hook().kvguard_cudagraph_captured(runner=call.instance, profile_only=profile_only)
    return result


def sync_cudagraph_and_dp_padding(wrapped, instance, args, kwargs):
    """V2 DP agreement (dp_size > 1 only); ``after_dp_sync`` fails open itself."""
    result = wrapped(*args, **kwargs)
    if fallbacks.ARMED:
        fallbacks.after_dp_sync(args, kwargs, result)
    return result


@hooked(NAME)
def block_pool_init(call: HostCall):
    result = call()
    hook().kvguard_block_pool_ready(pool=call.instance)
    return result


@hooked(NAME)
def worker_sleep(call: HostCall):
    hook().kvguard_cudagraph_reinit(worker=call.instance, phase="suspend", error=None)
    return call()


@hooked(NAME)
def worker_wake_up(call: HostCall):
    try:
        result = call()
    except Exception as exc:
        try:
            hook().kvguard_cudagraph_reinit(worker=call.instance, phase="resume", error=exc)
        except Exception as ours:              # never mask vLLM's own error
            once(logging.ERROR, ("internal", NAME, "wake_up"),
                 "vllm-kvguard: internal error after a failed wake_up (%s: %s)",
                 type(ours).__name__, ours)
        raise
    hook().kvguard_cudagraph_reinit(worker=call.instance, phase="resume", error=None)
    return result


def _setup(flags):
    from vllm_kvguard.fixes import coverage
    from vllm_kvguard.manager import register

    register(coverage, "kvguard.coverage")
    register(fallbacks, "kvguard.fallbacks")


def _teardown():
    fallbacks.disarm_all()


PATCH = Patch(
    name=NAME,
    summary="CUDA-graph coverage audit, opt-in capture completion, padding-target checks, "
            "counted and warned eager/PIECEWISE fallbacks, V2 capture lock",
    targets=[
        Target(V1_RUNNER, "GPUModelRunner.initialize_kv_cache", initialize_kv_cache),
        Target(V1_RUNNER, "GPUModelRunner.capture_model", capture_model),
        Target(V2_RUNNER, "GPUModelRunner.initialize_kv_cache", initialize_kv_cache,
               required=False),
        Target(V2_RUNNER, "GPUModelRunner.capture_model", capture_model, required=False),
        Target("vllm.v1.worker.gpu.dp_utils", "sync_cudagraph_and_dp_padding",
               sync_cudagraph_and_dp_padding, required=False),
        Target("vllm.v1.core.block_pool", "BlockPool.__init__", block_pool_init),
        Target("vllm.v1.worker.gpu_worker", "Worker.sleep", worker_sleep, required=False),
        Target("vllm.v1.worker.gpu_worker", "Worker.wake_up", worker_wake_up, required=False),
    ],
    vllm_versions=">=0.27.1,<0.34",
    upstream=("vllm#27325", "vllm#50488", "vllm#54933", "vllm#57355", "vllm#37576",
              "vllm#51509", "vllm#52728"),
    remove_when="vLLM captures every reachable uniform decode shape by default, warns on and "
                "exports eager/PIECEWISE fallbacks by reason, and model runner V2 disables "
                "capture after capture_model",
    setup=_setup,
    teardown=_teardown,
)
