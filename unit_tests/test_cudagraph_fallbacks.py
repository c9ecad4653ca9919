"""Runtime fallback accounting on real dispatcher objects configured as on a GPU.

V1: a real ``CudagraphDispatcher`` whose keys vLLM built for the worked example, called
through the real ``GPUModelRunner._determine_batch_execution_and_padding`` (the runner
object is created without ``__init__``, which needs a GPU; it carries only what that method
reads). V2: a real ``CudaGraphManager`` candidate table (``graph_owners.v2_probe``) marked as
captured. The only mocks replace DP collectives.
"""
from __future__ import annotations

import logging
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("vllm")

from vllm_kvguard import report  # noqa: E402
from vllm_kvguard.fixes.cudagraph import fallbacks, graph_owners  # noqa: E402
from vllm_kvguard.patches import cudagraph  # noqa: E402
from vllm_kvguard.tools.plan import cudagraph as planning  # noqa: E402

from vllm_kvguard.testing.cg_fixtures import NGRAM3, RUNNERS, requires_v1, real_v2_manager, vllm_logging_configured, plan  # noqa: E402,F401  (fixture: autouse)



@pytest.fixture(autouse=True)
def fixes_registered():
    """The hookimpls the patch registers on apply (counting, warning, metrics)."""
    built = cudagraph.install_fixes()
    yield built
    cudagraph.remove_fixes()


def hooks():
    """The fallback hookimpls the patch registered."""
    return cudagraph.fixes()["fallbacks"]


def acct():
    """The runtime accounting those hookimpls drive."""
    return hooks().accounting


@pytest.fixture(scope="module")
def fdo():
    return plan()


@pytest.fixture(scope="module")
def fap():
    return plan(mode="FULL_AND_PIECEWISE")


def counts() -> dict:
    return report.snapshot().get(fallbacks.CATEGORY, {})


def warnings(log) -> list[str]:
    return [m for m in log.lines(logging.WARNING) if "meant to graph" in m]


def v1_runner(vc, dp_size=1):
    return planning.plan_v1_runner(vc, dp_size)


def step(runner, per_request: list[int], **kw):
    """One V1 step's dispatch, through vLLM's own runner method."""
    sched = np.array(per_request, dtype=np.int32)
    runner.input_batch.num_reqs = len(per_request)       # as the runner's own batch says
    mode, desc, *_ = runner._determine_batch_execution_and_padding(
        num_tokens=int(sched.sum()), num_reqs=len(per_request), num_scheduled_tokens_np=sched,
        max_num_scheduled_tokens=int(sched.max()), use_cascade_attn=False, **kw)
    return mode.name


def armed_v1(vc, **kw):
    runner = v1_runner(vc, **kw)
    owner = graph_owners.V1Owner(runner.cudagraph_dispatcher, vc)
    assert acct().arm(runner, owner)
    return runner


# ----------------------------------------------------------------------------- V1
@requires_v1
def test_v1_uniform_decode_over_max_is_counted_and_warned_once(fdo, kvguard_log):
    runner = armed_v1(fdo)
    assert step(runner, [4] * 100) == "FULL"                # 400 tokens: graphed
    assert counts() == {}
    assert step(runner, [4] * 130) == "NONE"                # 520 > 512: eager
    assert step(runner, [4] * 256) == "NONE"
    assert counts() == {"over_max_capture_size": 2}
    lines = warnings(kvguard_log)
    assert len(lines) == 1
    assert "ran eager (over_max_capture_size" in lines[0]
    assert "max_cudagraph_capture_size" in lines[0]


@requires_v1
def test_v1_ragged_drafts_under_full_decode_only(fdo, kvguard_log):
    runner = armed_v1(fdo)
    for _ in range(3):
        assert step(runner, [4] * 10 + [1] * 6) == "NONE"   # ngram missed for 6 requests
    assert counts() == {"non_uniform_drafts": 3}
    lines = warnings(kvguard_log)
    assert len(lines) == 1 and "16 requests with 1..4 tokens" in lines[0]
    assert "FULL_AND_PIECEWISE" in lines[0]


@requires_v1
def test_v1_prefills_and_forced_eager_are_not_fallbacks(fdo, kvguard_log):
    runner = armed_v1(fdo)
    assert step(runner, [4] * 10 + [40]) == "NONE"          # a prefill chunk: eager by design
    assert step(runner, [300]) == "NONE"
    assert step(runner, [4] * 10, force_eager=True) == "NONE"   # profile / dummy runs
    assert counts() == {} and warnings(kvguard_log) == []


@requires_v1
def test_v1_full_and_piecewise_counts_ragged_as_piecewise(fap, kvguard_log):
    runner = armed_v1(fap)
    assert step(runner, [4] * 10 + [40]) == "PIECEWISE"     # mixed batch: PIECEWISE intended
    assert counts() == {}
    assert step(runner, [4] * 10 + [2] * 6) == "PIECEWISE"  # decode-only, ragged
    assert counts() == {"non_uniform_drafts": 1}
    assert "ran PIECEWISE" in warnings(kvguard_log)[0]


@requires_v1
def test_v1_dp_sync_forced(fdo, mocker):
    import torch
    from vllm.v1.worker import gpu_model_runner

    runner = armed_v1(fdo, dp_size=2)
    # The other rank voted eager (a DP collective: replaced here).
    mocker.patch.object(gpu_model_runner, "coordinate_batch_across_dp",
                        return_value=(False, torch.tensor([40, 40]), 0))
    assert step(runner, [4] * 10) == "NONE"
    assert counts() == {"dp_sync_forced": 1}


@requires_v1
def test_v1_lora_case_without_graph(kvguard_log):
    vc = plan(enable_lora=True, max_loras=2, max_lora_rank=8)
    runner = armed_v1(vc)
    keys = runner.cudagraph_dispatcher.cudagraph_keys
    full = keys[type(runner.cudagraph_dispatcher.cudagraph_mode).FULL]
    full -= {k for k in full if k.has_lora and k.num_tokens == 40}   # a missing LoRA graph
    runner.input_batch.lora_id_to_lora_request = {1: object(), 2: object()}
    assert step(runner, [4] * 10) == "NONE"
    runner.input_batch.lora_id_to_lora_request = {}
    assert step(runner, [4] * 10) == "FULL"
    assert counts() == {"lora": 1}


@requires_v1
def test_eager_owner_is_not_armed(fdo):
    vc = plan()
    none = type(vc.compilation_config.cudagraph_mode).NONE
    owner = graph_owners.v1_probe(vc, none, 4)          # what the CPU backend builds
    assert not acct().arm(None, owner)
    assert "dispatch" not in vars(owner.obj)
    assert owner.obj.dispatch(520, uniform_decode=True)[0] == none
    assert counts() == {}


@requires_v1
def test_closure_has_the_host_signature_and_result(fdo):
    runner = armed_v1(fdo)
    disp = runner.cudagraph_dispatcher
    assert "dispatch" in vars(disp)
    for args in ((400, True), (520, True), (7, False)):
        assert disp.dispatch(*args) == type(disp).dispatch(disp, *args)


@requires_v1
def test_internal_error_fails_open(fdo, mocker, kvguard_log):
    runner = armed_v1(fdo)
    mocker.patch.object(fallbacks, "uniform_reason", side_effect=RuntimeError("boom"))
    assert step(runner, [4] * 130) == "NONE"                # vLLM's answer, unchanged
    assert "dispatch" not in vars(runner.cudagraph_dispatcher)
    assert any("internal error" in m for m in kvguard_log.lines(logging.ERROR))
    assert step(runner, [4] * 130) == "NONE"


@requires_v1
def test_unknown_signature_is_not_armed(fdo, kvguard_log):
    from vllm.v1.cudagraph_dispatcher import CudagraphDispatcher

    class Changed(CudagraphDispatcher):
        def dispatch(self, num_tokens, *, batch=None):     # a future signature
            return super().dispatch(num_tokens)

    d = planning.plan_owner(fdo).obj
    d.__class__ = Changed
    assert not acct().arm(None, graph_owners.V1Owner(d, fdo))
    assert any("signature" in m for m in kvguard_log.lines(logging.WARNING))


# ----------------------------------------------------------------------------- V2
def armed_v2(vc):
    owner = planning.plan_owner(vc, "v2")
    owner.obj._graphs_captured = True
    assert acct().arm(None, owner)
    return owner.obj


@pytest.fixture(scope="module")
def fdo_v2():
    return plan("v2")


def v2(manager, num_reqs, num_tokens, uniform, max_query_len):
    if graph_owners.takes_max_query_len(type(manager)):
        return manager.dispatch(num_reqs, num_tokens, uniform, 0,
                                max_query_len=max_query_len).cg_mode.name
    return manager.dispatch(num_reqs, num_tokens, uniform, num_active_loras=0).cg_mode.name


def test_v2_reasons(fdo_v2, kvguard_log):
    m = armed_v2(fdo_v2)
    assert v2(m, 100, 400, 4, 4) == "FULL"
    assert v2(m, 130, 520, 4, 4) == "NONE"                   # over the 512-token ceiling
    assert v2(m, 10, 10, 1, 1) == "NONE"                     # a zero-draft (skip_drafts) step
    assert v2(m, 2, 600, None, None) == "NONE"               # a prefill: not a fallback
    expected = {"over_max_capture_size": 1, "not_captured_for_draft_length": 1}
    if graph_owners.takes_max_query_len(type(m)):
        assert v2(m, 10, 25, None, 4) == "NONE"              # ragged decode
        expected["non_uniform_drafts"] = 1
    assert counts() == expected
    assert len(warnings(kvguard_log)) == len(expected)


def test_v2_graphs_released(fdo_v2):
    m = armed_v2(fdo_v2)
    if not hasattr(m, "release_graphs"):
        pytest.skip("this vLLM's CudaGraphManager never releases its graphs (0.32+ does)")
    m.release_graphs()
    assert v2(m, 10, 40, 4, 4) == "NONE"
    assert counts() == {"graphs_released": 1}


def test_v2_graphed_batches_go_through_untouched(fdo_v2):
    """No wrapper on V2 dispatch: a graphed batch returns vLLM's stored descriptor."""
    from vllm.v1.worker.gpu import cudagraph_utils

    real_cls = cudagraph_utils.BatchExecutionDescriptor
    m = armed_v2(fdo_v2)
    assert "dispatch" not in vars(m)
    kw = {"max_query_len": 4} if graph_owners.takes_max_query_len(type(m)) else {}
    desc = m.dispatch(100, 400, 4, 0, **kw)
    stored = m._candidates.get((400, 0), []) + getattr(m, "_decode_descs", {}).get((4, 0, 1), [])
    assert any(desc is d for d in stored)                # 0.34: the request-indexed table
    assert isinstance(desc, cudagraph_utils.BatchExecutionDescriptor)   # a transparent stand-in
    acct().disarm_all()
    assert cudagraph_utils.BatchExecutionDescriptor is real_cls


@pytest.fixture(scope="module")
def fap_v2():
    return plan("v2", mode="FULL_AND_PIECEWISE")


def test_v2_full_and_piecewise_counts_fall_through_to_piecewise(fap_v2, kvguard_log):
    owner = planning.plan_owner(fap_v2, "v2")
    m = owner.obj
    if not graph_owners.takes_max_query_len(type(m)):
        pytest.skip("0.27.1 does not tell ragged decodes from prefills")
    keys_before = {k: list(v) for k, v in m._candidates.items()}
    m._graphs_captured = True
    assert acct().arm(None, owner)
    assert {k: list(v) for k, v in m._candidates.items()} != keys_before    # gates in
    assert v2(m, 100, 400, 4, 4) == "FULL"
    assert v2(m, 3, 300, None, None) == "PIECEWISE"          # mixed: PIECEWISE intended
    assert counts() == {}
    assert v2(m, 10, 25, None, 4) == "PIECEWISE"             # ragged decode fell through
    assert v2(m, 10, 10, 1, 1) == "PIECEWISE"                # zero-draft step
    assert v2(m, 130, 520, 4, 4) == "NONE"                   # over the ceiling: a miss
    assert counts() == {"non_uniform_drafts": 1, "not_captured_for_draft_length": 1,
                        "over_max_capture_size": 1}
    assert any("ran PIECEWISE (non_uniform_drafts" in w for w in warnings(kvguard_log))
    acct().disarm_all()
    assert {k: list(v) for k, v in m._candidates.items()} == keys_before   # gates removed


def test_v2_dp_sync_forced(fdo_v2, mocker):
    """vLLM's dispatch_cg_and_sync_dp -> our wrapper -> the DP agreement (a collective,
    replaced here): the other rank voted eager."""
    import inspect

    from vllm.v1.worker.gpu import dp_utils

    from vllm_kvguard.patches import cudagraph
    from vllm_kvguard.registry import KvguardWrapper

    m = armed_v2(fdo_v2)
    real = dp_utils.sync_cudagraph_and_dp_padding

    def agreement(*args, **kwargs):
        desired = inspect.signature(real).bind(*args, **kwargs).arguments["desired_batch_desc"]
        return type(desired)(cg_mode=type(desired.cg_mode).NONE, num_tokens=desired.num_tokens,
                             num_reqs=desired.num_reqs), object()

    agreement.__signature__ = inspect.signature(real)
    mocker.patch.object(dp_utils, "sync_cudagraph_and_dp_padding",
                        KvguardWrapper(agreement, cudagraph.sync_cudagraph_and_dp_padding))
    kw = {"max_query_len": 4} if graph_owners.takes_max_query_len(type(m)) else {}
    desc, _ = dp_utils.dispatch_cg_and_sync_dp(m, 10, 40, 4, 2, 0, **kw)
    assert desc.cg_mode.name == "NONE"
    assert counts() == {"dp_sync_forced": 1}


# ----------------------------------------------------------------------------- suspend/resume
@requires_v1
def test_sleep_suspends_and_wake_resumes(fdo):
    runner = armed_v1(fdo)
    worker = SimpleNamespace(model_runner=runner)
    hooks().kvguard_cudagraph_reinit(worker=worker, phase="suspend", error=None)
    assert "dispatch" not in vars(runner.cudagraph_dispatcher)
    assert step(runner, [4] * 130) == "NONE"
    assert counts() == {}
    hooks().kvguard_cudagraph_reinit(worker=worker, phase="resume", error=None)
    assert step(runner, [4] * 130) == "NONE"
    assert counts() == {"over_max_capture_size": 1}


@requires_v1
def test_resume_releases_when_the_owner_was_rebuilt(fdo, kvguard_log):
    runner = armed_v1(fdo)
    old = runner.cudagraph_dispatcher
    worker = SimpleNamespace(model_runner=runner)
    hooks().kvguard_cudagraph_reinit(worker=worker, phase="suspend", error=None)
    runner.cudagraph_dispatcher = planning.plan_owner(fdo).obj     # re-initialised
    hooks().kvguard_cudagraph_reinit(worker=worker, phase="resume", error=None)
    assert "dispatch" not in vars(old) and acct().armed_owners() == []
    assert any("released" in m for m in kvguard_log.lines(logging.WARNING))
    hooks().kvguard_cudagraph_captured(runner=runner, profile_only=False)   # next capture
    assert acct().armed_owners() == [runner.cudagraph_dispatcher]


@requires_v1
def test_resume_after_a_failed_wake_up_releases(fdo):
    runner = armed_v1(fdo)
    worker = SimpleNamespace(model_runner=runner)
    hooks().kvguard_cudagraph_reinit(worker=worker, phase="suspend", error=None)
    hooks().kvguard_cudagraph_reinit(worker=worker, phase="resume", error=OSError("cumem"))
    assert acct().armed_owners() == [] and "dispatch" not in vars(runner.cudagraph_dispatcher)


@requires_v1
def test_profile_capture_does_not_arm(fdo):
    runner = v1_runner(fdo)
    hooks().kvguard_cudagraph_captured(runner=runner, profile_only=True)
    assert acct().armed_owners() == []
    hooks().kvguard_cudagraph_captured(runner=runner, profile_only=False)
    assert acct().armed_owners() == [runner.cudagraph_dispatcher]


def test_v2_armed_by_capture_suspended_by_sleep(fdo_v2):
    """Every pin's V2 path (the only one on 0.34): a non-profile capture arms the runner's
    real CudaGraphManager; sleep stops counting, wake-up with the graphs intact resumes."""
    owner = planning.plan_owner(fdo_v2, "v2")
    m = owner.obj
    m._graphs_captured = True
    class Runner:                        # what the hooks read from a model runner
        vllm_config, cudagraph_manager = fdo_v2, m

    runner = Runner()
    worker = SimpleNamespace(model_runner=runner)
    hooks().kvguard_cudagraph_captured(runner=runner, profile_only=True)
    assert acct().armed_owners() == []
    hooks().kvguard_cudagraph_captured(runner=runner, profile_only=False)
    assert acct().armed_owners() == [m]
    assert v2(m, 130, 520, 4, 4) == "NONE"
    hooks().kvguard_cudagraph_reinit(worker=worker, phase="suspend", error=None)
    assert v2(m, 130, 520, 4, 4) == "NONE"                   # asleep: not counted
    hooks().kvguard_cudagraph_reinit(worker=worker, phase="resume", error=None)
    assert v2(m, 130, 520, 4, 4) == "NONE"
    assert counts() == {"over_max_capture_size": 2}
