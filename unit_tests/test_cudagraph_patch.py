"""The cudagraph patch: targets on this vLLM, wiring of its wrappers, V2 capture lock.

Host calls that need a GPU (``initialize_kv_cache``, ``capture_model``, ``wake_up``) are
stand-ins passed to the real wrappers; everything else is vLLM's own.
"""
from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from vllm_kvguard import activation  # noqa: E402
from vllm_kvguard.fixes.cudagraph import coverage  # noqa: E402
from vllm_kvguard.patches import cudagraph, distributed  # noqa: E402
from vllm_kvguard.tools.plan.cudagraph import has_v1_runner, plan_config, plan_owner  # noqa: E402
from vllm_kvguard.versions import vllm_version  # noqa: E402
from vllm_kvguard.registry import resolve  # noqa: E402
from vllm_kvguard.testing.cg_fixtures import (NGRAM3, requires_v1,  # noqa: E402,F401
                                              vllm_logging_configured)  # fixture: autouse


def activate(**env):
    return activation.activate({"KVGUARD": "1", "KVGUARD_PATCHES": "cudagraph", **env})


def test_required_targets_and_dispatch_methods_exist():
    assert cudagraph.PATCH.missing_targets() == []
    for module, qualname in cudagraph.DISPATCH_METHODS:
        if module.startswith("vllm.v1.worker.gpu."):
            continue                              # V2: optional, like its targets
        if module == cudagraph.V1_DISPATCHER and not has_v1_runner():
            continue                              # V1: declared gone from 0.34.0
        assert resolve(module, qualname) is not None, qualname


def test_patch_declares_range_upstream_and_removal():
    p = cudagraph.PATCH
    assert p.vllm_versions and p.remove_when
    for issue in ("27325", "50488", "54933", "57355", "37576", "51509", "52728"):
        assert any(issue in u for u in p.upstream)


def test_apply_and_revert():
    res = activate()
    assert res["cudagraph"].startswith("applied")
    wrapped = activation.wrapped_targets()
    runner_module = cudagraph.V1_RUNNER if has_v1_runner() else cudagraph.V2_RUNNER
    assert f"{runner_module}.GPUModelRunner.initialize_kv_cache" in wrapped
    gone = cudagraph.PATCH.absent_by_declaration()
    assert not set(gone) & set(wrapped)           # nothing claimed for a missing target
    assert bool(gone) == (not has_v1_runner())
    assert "vllm.v1.core.block_pool.BlockPool.__init__" in wrapped
    activation.deactivate()
    assert activation.wrapped_targets() == []


def test_single_rank_dispatch_path_carries_no_wrapper():
    """The DP agreement is wrapped (dp_size > 1 only); the per-step dispatch_cg_and_sync_dp
    and V2 dispatch are not."""
    from vllm.v1.worker.gpu import cudagraph_utils, dp_utils, model_runner

    activate()
    assert type(dp_utils.sync_cudagraph_and_dp_padding).__name__ == "KvguardWrapper"
    assert type(model_runner.dispatch_cg_and_sync_dp).__name__ == "function"
    assert type(vars(cudagraph_utils.CudaGraphManager)["dispatch"]).__name__ == "function"


def v1_runner(vc):
    """The installed vLLM's model runner built without ``__init__`` (a GPU): V1 where it
    exists (its name kept for the tests that are V1's), else V2 with what the hooks read."""
    if not has_v1_runner():
        from vllm.v1.worker.gpu.model_runner import GPUModelRunner

        runner = GPUModelRunner.__new__(GPUModelRunner)
        runner.__dict__.update(vllm_config=vc, cudagraph_manager=None, decode_query_len=4,
                               lora_capture_cases=[0], adaptive_verification=None)
        return runner
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    runner = GPUModelRunner.__new__(GPUModelRunner)
    runner.__dict__.update(vllm_config=vc, cudagraph_dispatcher=None)
    return runner


def test_kv_init_wrapper_completes_before_and_audits_after(kvguard_log):
    activate(KVGUARD_CUDAGRAPH_COMPLETE="1")
    vc = plan_config(cudagraph_mode="FULL_DECODE_ONLY", max_num_seqs=256,
                     max_num_batched_tokens=8192, speculative_config=NGRAM3)
    runner = v1_runner(vc)
    seen = {}

    def host_initialize_kv_cache(kv_cache_config, is_profiling=False):
        # What vLLM does inside: attention builders and graph keys read the sizes now.
        seen["max"] = vc.compilation_config.max_cudagraph_capture_size
        owner = plan_owner(vc)
        setattr(runner, "cudagraph_dispatcher" if owner.kind == "V1" else "cudagraph_manager",
                owner.obj)

    cudagraph.initialize_kv_cache(host_initialize_kv_cache, runner, (None,), {})
    assert seen["max"] == 1024                      # completed before the host call
    table = [m for m in kvguard_log.lines() if "CUDA-graph coverage" in m]
    assert len(table) == 1 and "256/256" in table[0]


def test_kv_init_profiling_pass_is_left_alone(kvguard_log):
    activate(KVGUARD_CUDAGRAPH_COMPLETE="1")
    vc = plan_config(cudagraph_mode="FULL_DECODE_ONLY", max_num_seqs=256,
                     max_num_batched_tokens=8192, speculative_config=NGRAM3)
    runner = v1_runner(vc)
    cudagraph.initialize_kv_cache(lambda kv, is_profiling=False: None, runner, (None,),
                                  {"is_profiling": True})
    assert vc.compilation_config.max_cudagraph_capture_size == 512
    assert not any("CUDA-graph coverage" in m for m in kvguard_log.lines())


def v2_runner():
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    runner = GPUModelRunner.__new__(GPUModelRunner)
    runner.__dict__.update(cudagraph_manager=None)
    return runner


def test_v2_capture_without_a_lock_on_this_vllm():
    """vLLM 0.34 has no capture lock: the patch declares it absent and touches nothing."""
    from vllm.compilation import monitor

    if cudagraph.CAPTURE_LOCK.exists_in(vllm_version()):
        pytest.skip("this vLLM has the capture lock (tested below)")
    activate()
    assert cudagraph.capture_model(lambda *, profile_only=False: 7, v2_runner(), (), {}) == 7
    assert not hasattr(monitor, "cudagraph_capturing_enabled")


def test_v2_capture_is_locked_after_a_real_capture():
    from vllm.compilation import monitor

    if not cudagraph.CAPTURE_LOCK.exists_in(vllm_version()):
        pytest.skip("vLLM 0.34 has no capture lock (declared absent)")

    activate()
    runner = v2_runner()
    monitor.set_cudagraph_capturing_enabled(False)
    allowed = []

    def host_capture_model(*, profile_only=False):
        allowed.append(monitor.cudagraph_capturing_enabled)
        return 0

    try:
        cudagraph.capture_model(host_capture_model, runner, (), {"profile_only": True})
        assert allowed == [True] and monitor.cudagraph_capturing_enabled   # profiling: open
        cudagraph.capture_model(host_capture_model, runner, (), {})
        assert allowed == [True, True] and not monitor.cudagraph_capturing_enabled
        with pytest.raises(RuntimeError, match="CUDA graph capturing detected"):
            monitor.validate_cudagraph_capturing_enabled()
        cudagraph.capture_model(host_capture_model, runner, (), {})          # recapture works
        assert allowed[-1] is True
    finally:
        monitor.set_cudagraph_capturing_enabled(True)


@requires_v1
def test_v1_capture_lock_is_vllms_own():
    from vllm.compilation import monitor

    activate()
    runner = v1_runner(None)
    cudagraph.capture_model(lambda: 0, runner, (), {})
    assert monitor.cudagraph_capturing_enabled      # untouched: V1 sets it itself


def test_block_pool_is_checked_when_built(mocker):
    from vllm.v1.core.block_pool import BlockPool

    activate()
    spy = mocker.spy(coverage, "check_block_pool")
    pool = BlockPool(num_gpu_blocks=4, enable_caching=False, hash_block_size=16)
    assert spy.call_count == 1 and spy.spy_return == []
    assert pool.null_block.block_id == 0


@pytest.fixture
def reinit_calls():
    """A third-party hookimpl recording ``kvguard_cudagraph_reinit`` calls in order."""
    from vllm_kvguard.hookspecs import hookimpl
    from vllm_kvguard.manager import register, unregister

    calls = []

    class Recorder:
        @hookimpl
        def kvguard_cudagraph_reinit(self, worker, phase, error):
            calls.append((phase, error))

    register(Recorder(), "test.reinit_recorder")
    yield calls
    unregister("test.reinit_recorder")


def test_sleep_suspends_before_the_host_call(reinit_calls):
    activate()
    cudagraph.worker_sleep(lambda level=1: reinit_calls.append(("sleep", None)),
                           SimpleNamespace(model_runner=None), (), {})
    assert reinit_calls == [("suspend", None), ("sleep", None)]


def test_failed_wake_up_keeps_vllms_error(reinit_calls):
    activate()

    def host_wake_up(tags=None):
        raise MemoryError("cumem")

    with pytest.raises(MemoryError, match="cumem"):
        cudagraph.worker_wake_up(host_wake_up, SimpleNamespace(model_runner=None), (), {})
    assert [phase for phase, _ in reinit_calls] == ["resume"]
    assert isinstance(reinit_calls[0][1], MemoryError)


def test_internal_error_in_a_hook_fails_open(mocker, kvguard_log):
    activate()
    mocker.patch.object(coverage, "check_worker_padding", side_effect=RuntimeError("ours"))
    runner = v1_runner(None)
    assert cudagraph.initialize_kv_cache(lambda kv, is_profiling=False: "vllm", runner,
                                         (None,), {}) == "vllm"
    assert any("internal error in patch 'cudagraph'" in m
               for m in kvguard_log.lines(logging.ERROR))


def test_missing_optional_target_is_skipped_with_a_note(monkeypatch):
    from vllm.v1.worker.gpu import dp_utils

    monkeypatch.delattr(dp_utils, "sync_cudagraph_and_dp_padding")
    res = activate()["cudagraph"]
    assert res.startswith("applied") and "sync_cudagraph_and_dp_padding absent" in res


@requires_v1
def test_missing_required_target_skips_the_patch(monkeypatch, kvguard_log):
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    monkeypatch.delattr(GPUModelRunner, "capture_model")
    res = activate()["cudagraph"]
    assert res.startswith("skipped") and "GPUModelRunner.capture_model" in res
    assert set(activation.wrapped_targets()) <= distributed.TARGETS   # always on
    assert any("patch 'cudagraph' skipped" in m for m in kvguard_log.lines(logging.WARNING))
