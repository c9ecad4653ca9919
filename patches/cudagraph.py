"""Host surface: CUDA-graph capture sizing, dispatch and the padding target.

Releases: 0.27.1 to 0.34.x. Model Runner V1 (its runner, ``CudagraphDispatcher`` and the
``cudagraph_capturing_enabled`` capture lock) is gone from 0.34.0: every V1 target, change
and private name is declared ``versions="<0.34"``, so there it is neither wrapped nor
claimed, and the V2 capture lock is absent (vLLM 0.34 has no lock to switch). From 0.34
capture completion writes decode request sizes (``decode_cudagraph_capture_request_sizes``).

Targets (V2 ones are optional: skipped with a log line where absent)
    ``vllm.v1.worker.gpu_model_runner.GPUModelRunner.initialize_kv_cache`` (V1, and the CPU
    runner through ``super()``) and ``vllm.v1.worker.gpu.model_runner.GPUModelRunner.
    initialize_kv_cache`` (V2)
        -> ``kvguard_cudagraph_before_kv_init`` (opt-in capture completion, before attention
        builders and graph keys are sized) and ``kvguard_cudagraph_after_kv_init`` (one
        coverage table per KV init, worker padding ids)
    ``...GPUModelRunner.capture_model`` (V1, V2)
        -> ``kvguard_cudagraph_before_capture`` / ``kvguard_cudagraph_captured``: arm runtime
        accounting on the runner's graph owner; V2: capture disabled after a non-profile
        capture, as V1 does
    ``vllm.v1.worker.gpu.dp_utils.sync_cudagraph_and_dp_padding`` (V2; called by
    ``dispatch_cg_and_sync_dp`` only when ``dp_size > 1``, so a single-rank step pays nothing)
        -> a rank forced eager by the DP agreement is counted (``dp_sync_forced``)
    ``vllm.v1.core.block_pool.BlockPool.__init__``
        -> ``kvguard_block_pool_ready``: block 0 is the reserved null block, never free
        (a read-only check: outside the proven range it runs under the drift guard alone)
Self-test (outside the proven range)
    :func:`vllm_kvguard.verify.due` as the runner's ``initialize_kv_cache`` (or
    ``capture_model``) starts, before any fix: :mod:`vllm_kvguard.verify.cudagraph` on the
    runner's own config and graph owner class, in the model runner's process
    ``vllm.v1.worker.gpu_worker.Worker.sleep`` / ``.wake_up``
        -> ``kvguard_cudagraph_reinit``: suspend / resume (or release) the armed accounting
Fixes
    The hookimpls are :mod:`vllm_kvguard.fixes.cudagraph.hooks` (built by :func:`install_fixes`
    with this patch's declarations and flags); they call the analysis in
    :mod:`~vllm_kvguard.fixes.cudagraph.coverage` / :mod:`~vllm_kvguard.fixes.cudagraph.planner` and the runtime
    accounting in :mod:`~vllm_kvguard.fixes.cudagraph.fallbacks` / :mod:`~vllm_kvguard.fixes.cudagraph.fallbacks_v2`.
Run-time changes (``PATCH.changes``; the fixes install them only through these)
    :data:`DISPATCH` (V1 per-instance ``dispatch`` closure), :data:`DESCRIPTOR` (the V2
    miss-path descriptor stand-in), :data:`GATES` (V2 candidate-list gates),
    :data:`CAPTURE_LOCK` (V2 capture lock), and for the offline planner
    (:mod:`vllm_kvguard.tools.plan.cudagraph`) :data:`PLATFORM` / :data:`PLATFORM_BINDINGS` (a CPU
    platform where vLLM detects none) and :data:`PLAN_RUNNER` (its stand-in V1 runner).
    Nothing is wrapped at class level on the dispatch path.
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

from vllm_kvguard import verify
from vllm_kvguard.flags import Flags
from vllm_kvguard.hostcall import HostCall, hooked
from vllm_kvguard.log import once
from vllm_kvguard.manager import hook, register, unregister
from vllm_kvguard.registry import ContainerItem, InstanceAttr, ModuleGlobal, Patch, Private, Target

NAME = "cudagraph"
V1_RUNNER = "vllm.v1.worker.gpu_model_runner"
V2_RUNNER = "vllm.v1.worker.gpu.model_runner"
V1_DISPATCHER = "vllm.v1.cudagraph_dispatcher"
V2_GRAPHS = "vllm.v1.worker.gpu.cudagraph_utils"

#: Methods replaced per instance (not wrapped at class level); the drift test checks them.
DISPATCH_METHODS = ((V1_DISPATCHER, "CudagraphDispatcher.dispatch"),
                    (V2_GRAPHS, "CudaGraphManager.dispatch"))

# ----------------------------------------------------------------------------- changes
#: vLLM releases with Model Runner V1 (removed in 0.34.0 with its dispatcher).
V1_RELEASES = "<0.34"
#: vLLM releases whose capture sizing is split into prefill tokens and decode requests.
SPLIT_SIZING = ">=0.34"

DISPATCH = InstanceAttr(
    V1_DISPATCHER, "CudagraphDispatcher", "dispatch", versions=V1_RELEASES,
    why="V1 fallback accounting: a closure with the host's signature on an armed dispatcher "
        "calls the bound original and takes a slow path only when the intended graph missed")
DESCRIPTOR = ModuleGlobal(
    V2_GRAPHS, "BatchExecutionDescriptor",
    why="V2 fallback accounting: a transparent stand-in for the class, built only on "
        "dispatch's miss path, reads the missed batch from dispatch's frame")
GATES = ContainerItem(
    V2_GRAPHS, "CudaGraphManager", "_candidates",
    why="V2 fallback accounting: a gate between the FULL decode and PIECEWISE descriptors "
        "of a candidate list sees a FULL -> PIECEWISE fall-through and never matches")
#: KVGUARD_CUDAGRAPH_COMPLETE's writes, before graph keys are built: up to 0.33 the shared
#: token sizes; from 0.34 the decode request sizes (the token fields are deprecated there
#: and only record what vLLM's own sizing resolves from the request sizes).
CAPTURE_SIZES = tuple(
    InstanceAttr("vllm.config.compilation", "CompilationConfig", name, overwrite=True,
                 versions=versions,
                 why="KVGUARD_CUDAGRAPH_COMPLETE: the capture sizes extended to every "
                     "reachable uniform decode shape, before graph keys are built")
    for name, versions in (("cudagraph_capture_sizes", ""), ("max_cudagraph_capture_size", ""),
                           ("decode_cudagraph_capture_request_sizes", SPLIT_SIZING),
                           ("max_decode_cudagraph_capture_requests", SPLIT_SIZING)))
#: vLLM 0.34.0 has no capture lock: ``vllm.compilation.monitor`` lost
#: ``cudagraph_capturing_enabled`` with Model Runner V1 and ``CUDAGraphWrapper`` captures a
#: new shape without any check, so there is nothing to switch off (declared absent there).
CAPTURE_LOCK = ModuleGlobal(
    "vllm.compilation.monitor", "cudagraph_capturing_enabled", versions=V1_RELEASES,
    why="V2 capture lock: off after a non-profile capture_model (as V1 does), on around the "
        "next capture")
PLATFORM = ModuleGlobal(
    "vllm.platforms", "_current_platform",
    why="offline planner: vLLM's CPU platform while building a config where vLLM detects "
        "no platform (a CUDA wheel without a GPU)")
#: Modules that bind ``current_platform`` by name when the planner builds a config.
PLATFORM_IMPORTERS = (
    "vllm.platforms", "vllm.config.compilation", "vllm.config.lora", "vllm.config.model",
    "vllm.config.parallel", "vllm.engine.arg_utils", "vllm.utils.system_utils",
    "vllm.utils.mem_utils", "vllm.triton_utils.importing",
    "vllm.model_executor.layers.quantization",
    "vllm.model_executor.layers.quantization.utils.quant_utils")
PLATFORM_BINDINGS = tuple(
    ModuleGlobal(m, "current_platform", required=False,
                 why="offline planner: this module's binding of the stand-in platform")
    for m in PLATFORM_IMPORTERS)
#: ``vllm.config.vllm`` keeps the undetected platform (the CPU platform's own config checks
#: there refuse a machine without triton-cpu), told only what every real platform says:
#: the hybrid KV cache manager is supported (else a Mamba hybrid's specs cannot be grouped).
CONFIG_PLATFORM = ModuleGlobal(
    "vllm.config.vllm", "current_platform", required=False,
    why="offline planner: the config's platform answers, as CUDA and CPU do, that the "
        "hybrid KV cache manager is supported")
#: What ``_determine_batch_execution_and_padding`` reads from the planner's stand-in runner.
PLAN_RUNNER_ATTRS = ("vllm_config", "parallel_config", "compilation_config", "model_config",
                     "uniform_decode_query_len", "input_batch", "cudagraph_dispatcher")
PLAN_RUNNER = tuple(
    InstanceAttr(V1_RUNNER, "GPUModelRunner", name, versions=V1_RELEASES,
                 why="offline planner: the stand-in V1 runner (built without __init__, which "
                     "needs a GPU) that runs vLLM's own per-step dispatch")
    for name in PLAN_RUNNER_ATTRS)

# ----------------------------------------------------------------------------- private names
USES = (
    Private(V1_RUNNER, "GPUModelRunner", ("_determine_batch_execution_and_padding",),
            versions=V1_RELEASES),
    # frame locals the V1 slow path reads from that method (found by code object)
    Private(V1_RUNNER, "GPUModelRunner._determine_batch_execution_and_padding",
            ("num_reqs", "max_num_scheduled_tokens", "num_tokens", "force_eager"),
            versions=V1_RELEASES),
    Private(V1_DISPATCHER, "CudagraphDispatcher", ("_get_lora_cases",), versions="<0.33"),
    Private(V2_GRAPHS, "CudaGraphManager",
            ("_candidates", "_capture_descs", "_graphs_captured", "_init_candidates")),
    Private(V2_GRAPHS, "CudaGraphManager",
            ("_build_lora_dispatch_map", "_lora_dispatch_map", "_max_lora_case"),
            versions="<0.33"),
    # 0.34: uniform decode graphs indexed by request count, per (q, LoRA case, ubatches)
    Private(V2_GRAPHS, "CudaGraphManager", ("_decode_descs",), versions=SPLIT_SIZING),
    Private("vllm.config.vllm", "VllmConfig", ("_split_cudagraph_capture_sizes",),
            versions=SPLIT_SIZING),
    Private(V2_GRAPHS, "CudaGraphManager", ("_max_full_descs_to_capture",
                                            "_capture_mem_samples"), versions=">=0.29"),
    # the gates rely on how _is_compatible compares a descriptor's fields (0.29+)
    Private(V2_GRAPHS, "_is_compatible", ("max_query_len", "num_reqs", "uniform_token_count"),
            versions=">=0.29"),
    # frame locals the V2 miss path reads from dispatch
    Private(V2_GRAPHS, "CudaGraphManager.dispatch",
            ("self", "num_reqs", "num_tokens", "uniform_token_count", "num_active_loras")),
    Private(V2_GRAPHS, "CudaGraphManager.dispatch", ("max_query_len",), versions=">=0.29"),
    Private(V2_GRAPHS, "CudaGraphManager.dispatch", ("num_ubatches",), versions=">=0.32"),
    # vLLM's own capture sizing, re-run by the planner on a copy of the config
    Private("vllm.config", "VllmConfig", ("_set_cudagraph_sizes",)),
    Private("vllm.config", "CompilationConfig", ("_attention_ops",)),
    Private("vllm.platforms", "", ("_current_platform",)),
    # the planner's block size, as vLLM's platform picks it on a CUDA GPU
    Private("vllm.platforms.interface", "Platform", ("_preferred_block_size_for_backends",),
            versions=">=0.32"),
    # the planner's KV specs from vLLM's own model classes (tools/plan/layer_specs.py): the
    # model class imported before the CUDA platform stands in, the backend choice cache
    Private("vllm.model_executor.models.registry", "_ModelRegistry", ("_try_load_model_cls",),
            versions=">=0.32"),
    Private("vllm.v1.attention.selector", "", ("_cached_get_attn_backend",
                                               "_cached_get_mamba_attn_backend"),
            versions=">=0.32"),
)


@hooked(NAME)
def initialize_kv_cache(call: HostCall):
    runner = call.instance
    if not verify.due(NAME, runner=runner):
        return call()                   # its self-test failed here: reverted, vLLM as is
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
    if not verify.due(NAME, runner=call.instance):
        return call()
    profile_only = bool(call.kwargs.get("profile_only", False))
    hook().kvguard_cudagraph_before_capture(runner=call.instance, profile_only=profile_only)
    result = call()
    hook().kvguard_cudagraph_captured(runner=call.instance, profile_only=profile_only)
    return result


def sync_cudagraph_and_dp_padding(wrapped, instance, args, kwargs):
    """V2 DP agreement (dp_size > 1 only); ``after_dp_sync`` fails open itself."""
    result = wrapped(*args, **kwargs)
    fallback_hooks = _fixes.get("fallbacks")
    if fallback_hooks is not None and fallback_hooks.accounting.armed:
        fallback_hooks.accounting.after_dp_sync(args, kwargs, result)
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


# ----------------------------------------------------------------------------- fixes
#: The fix objects registered by :func:`install_fixes` ("coverage", "fallbacks").
_fixes: dict = {}
FIX_NAMES = {"coverage": "kvguard.coverage", "fallbacks": "kvguard.fallbacks"}


def build_fixes(flags: Flags | None = None) -> dict:
    """The cudagraph fix objects, built with this patch's declarations and ``flags``."""
    from vllm_kvguard.fixes.cudagraph.hooks import CoverageHooks, FallbackHooks
    from vllm_kvguard.fixes.cudagraph.fallbacks import Accounting

    flags = flags or Flags()
    return {"coverage": CoverageHooks(CAPTURE_LOCK, CAPTURE_SIZES,
                                      complete=flags.cudagraph_complete,
                                      complete_force=flags.cudagraph_complete_force),
            "fallbacks": FallbackHooks(Accounting(DISPATCH, DESCRIPTOR, GATES))}


def install_fixes(flags: Flags | None = None) -> dict:
    """Build the fixes and register them (replacing any registered before); the patch's
    setup. Returns them by name."""
    remove_fixes()
    built = build_fixes(flags)
    for key, fix in built.items():
        register(fix, FIX_NAMES[key])
    _fixes.update(built)
    return built


def remove_fixes() -> None:
    """Disarm the accounting and unregister the fixes (the patch's teardown)."""
    fallback_hooks = _fixes.pop("fallbacks", None)
    if fallback_hooks is not None:
        fallback_hooks.accounting.disarm_all()
    _fixes.clear()
    for name in FIX_NAMES.values():
        unregister(name)


def fixes() -> dict:
    """The registered fix objects by name (empty before setup)."""
    return dict(_fixes)


PATCH = Patch(
    name=NAME,
    summary="CUDA-graph coverage audit, opt-in capture completion, padding-target checks, "
            "counted and warned eager/PIECEWISE fallbacks, V2 capture lock",
    targets=[
        Target(V1_RUNNER, "GPUModelRunner.initialize_kv_cache", initialize_kv_cache,
               versions=V1_RELEASES),
        Target(V1_RUNNER, "GPUModelRunner.capture_model", capture_model, versions=V1_RELEASES),
        Target(V2_RUNNER, "GPUModelRunner.initialize_kv_cache", initialize_kv_cache,
               required=False),
        Target(V2_RUNNER, "GPUModelRunner.capture_model", capture_model, required=False),
        Target("vllm.v1.worker.gpu.dp_utils", "sync_cudagraph_and_dp_padding",
               sync_cudagraph_and_dp_padding, required=False),
        Target("vllm.v1.core.block_pool", "BlockPool.__init__", block_pool_init),
        Target("vllm.v1.worker.gpu_worker", "Worker.sleep", worker_sleep, required=False),
        Target("vllm.v1.worker.gpu_worker", "Worker.wake_up", worker_wake_up, required=False),
    ],
    vllm_versions=">=0.27.1,<0.35",
    upstream=("vllm#27325", "vllm#50488", "vllm#54933", "vllm#57355", "vllm#37576",
              "vllm#51509", "vllm#52728"),
    remove_when="vLLM captures every reachable uniform decode shape by default, warns on and "
                "exports eager/PIECEWISE fallbacks by reason, and model runner V2 disables "
                "capture after capture_model",
    changes=(DISPATCH, DESCRIPTOR, GATES, CAPTURE_LOCK, *CAPTURE_SIZES, PLATFORM,
             *PLATFORM_BINDINGS, CONFIG_PLATFORM,
             *PLAN_RUNNER),
    uses=USES,
    setup=install_fixes,
    teardown=remove_fixes,
)
