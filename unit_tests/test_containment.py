"""Per-request fault containment (fixes/containment.py) on a REAL Scheduler and connector.

A KV connector loaded by vLLM's own factory fails for one request (pytest-mock, or the
plugin's KVGUARD_FAULTS injector): vLLM alone raises out of ``schedule()``; with the plugin
only that request ends, with an error, its blocks freed and the audit clean, while every
other request runs to its end. Errors tied to no request propagate unchanged.
"""
from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import vllm.distributed.kv_transfer.kv_connector.factory  # noqa: E402,F401
import vllm.v1.core.sched.scheduler  # noqa: E402,F401

from vllm_kvguard import activation, report  # noqa: E402
from vllm_kvguard.fixes.transaction import audit  # noqa: E402
from vllm_kvguard.testing.connector_fixtures import (DeferringConnector,  # noqa: E402
                                                     make_connector_scheduler)
from vllm_kvguard.testing.kv_fixtures import make_request, scheduler_step, used_blocks  # noqa: E402

pytestmark = pytest.mark.requires_patch("containment")
ON = {"KVGUARD": "1"}
OFF = {"KVGUARD": "1", "KVGUARD_PATCHES": "none"}
IDS = ("r0", "bad", "r2")


def prompt(seed: int, n: int = 40) -> list[int]:
    return [(seed * 7919 + i * 31) % 1000 + 3 for i in range(n)]


def fail_for_bad(method):
    """A side effect raising for request "bad" only, else the connector's own method."""
    def side_effect(self, request, *args, **kwargs):
        if request.request_id == "bad":
            raise KeyError(f"connector lost its state for {request.request_id}")
        return method(self, request, *args, **kwargs)
    return side_effect


def run(env, *, steps: int = 12, **connector_kw):
    activation.activate(env)
    sched = make_connector_scheduler(defers=0, **connector_kw)
    for i, rid in enumerate(IDS):
        sched.add_request(make_request(rid, prompt(i), max_tokens=4))
    reasons = {}
    for _ in range(steps):
        _out, engine_outputs = scheduler_step(sched)
        for eco in engine_outputs.values():
            reasons.update({o.request_id: str(o.finish_reason) for o in eco.outputs
                            if o.finish_reason is not None})
    return sched, reasons


def assert_only_bad_failed(sched, reasons):
    assert "ERROR" in reasons["bad"].upper()
    assert all("LENGTH" in reasons[r].upper() for r in IDS if r != "bad"), reasons
    assert not sched.requests and used_blocks(sched.kv_cache_manager) == 0
    assert audit.audit_kv_cache_manager(sched.kv_cache_manager, sched) == []


@pytest.mark.parametrize("method", ["get_num_new_matched_tokens", "update_state_after_alloc"])
def test_vllm_alone_dies_of_one_requests_connector_error(mocker, method):
    mocker.patch.object(DeferringConnector, method, autospec=True,
                        side_effect=fail_for_bad(getattr(DeferringConnector, method)))
    with pytest.raises(KeyError, match="lost its state for bad"):
        run(OFF)


@pytest.mark.parametrize("method", ["get_num_new_matched_tokens", "update_state_after_alloc"])
def test_a_connector_error_ends_only_its_request(mocker, kvguard_log, method):
    mocker.patch.object(DeferringConnector, method, autospec=True,
                        side_effect=fail_for_bad(getattr(DeferringConnector, method)))
    sched, reasons = run(ON)
    assert_only_bad_failed(sched, reasons)
    assert report.snapshot()["contained"] == {method: 1}
    line, = [ln for ln in kvguard_log.lines() if "KV connector" in ln]
    assert f"{method}(request bad) raised KeyError" in line and "lost its state" in line


def test_blocks_a_failed_update_left_without_their_external_kv_leave_the_prefix_cache(mocker):
    # the connector claims 16 external tokens, then fails to note their load: bad's blocks
    # hold no valid KV for them, so no later request may hit them in the prefix cache
    mocker.patch.object(DeferringConnector, "update_state_after_alloc", autospec=True,
                        side_effect=fail_for_bad(DeferringConnector.update_state_after_alloc))
    sched, reasons = run(ON, matched_tokens=16)
    assert_only_bad_failed(sched, reasons)
    manager = sched.kv_cache_manager
    _blocks, bad_hit = manager.get_computed_blocks(make_request("again", prompt(1)))[:2]
    _blocks, good_hit = manager.get_computed_blocks(make_request("again0", prompt(0)))[:2]
    assert bad_hit == 0 and good_hit > 0


def test_a_failing_request_finished_frees_the_blocks_and_the_request_ends(mocker):
    mocker.patch.object(DeferringConnector, "request_finished", autospec=True,
                        side_effect=fail_for_bad(DeferringConnector.request_finished))
    sched, reasons = run(ON)
    assert all("LENGTH" in reasons[r].upper() for r in IDS), reasons   # it was done anyway
    assert not sched.requests and used_blocks(sched.kv_cache_manager) == 0
    assert report.snapshot()["contained"] == {"request_finished": 1}


def test_errors_tied_to_no_request_propagate_unchanged(mocker):
    error = RuntimeError("a bug in the connector's step-level metadata")
    mocker.patch.object(DeferringConnector, "build_connector_meta", side_effect=error)
    with pytest.raises(RuntimeError) as raised:
        run(ON)
    assert raised.value is error
    assert "contained" not in report.snapshot()


def test_a_base_exception_is_never_contained(mocker):
    class Stop(BaseException):
        pass

    stop = Stop()
    mocker.patch.object(DeferringConnector, "get_num_new_matched_tokens", side_effect=stop)
    with pytest.raises(Stop) as raised:
        run(ON)
    assert raised.value is stop


@pytest.mark.parametrize("phase", ["lookup", "update"])
def test_injected_connector_faults_kill_vllm_alone_and_are_contained_with_the_plugin(phase):
    from vllm_kvguard.hostcall import InjectedConnectorFault

    faults = f"phase={phase},every=2,limit=1"
    with pytest.raises(InjectedConnectorFault, match="injected: KV connector"):
        run({**OFF, "KVGUARD_FAULTS": faults})
    activation.deactivate()
    report.reset_counters()
    sched, reasons = run({**ON, "KVGUARD_FAULTS": faults})
    failed = [r for r, why in reasons.items() if "ERROR" in why.upper()]
    assert failed == ["bad"]        # the 2nd call of the phase: the 2nd request, "bad"
    assert not sched.requests and used_blocks(sched.kv_cache_manager) == 0
    assert report.snapshot()["fault"] == {"injected": 1}


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_failed_kv_load_is_vllms_own_policy_recompute_or_fail_that_request(policy):
    # the injected worker report: the 2nd request loading external KV lost its last block
    sched, reasons = run({**ON, "KVGUARD_FAULTS": "phase=load,every=2"}, matched_tokens=16,
                         kv_load_failure_policy=policy)
    assert report.snapshot()["fault"] == {"injected": 1}
    assert not sched.requests and used_blocks(sched.kv_cache_manager) == 0
    if policy == "recompute":
        assert all("LENGTH" in reasons[r].upper() for r in IDS), reasons
    else:
        assert_only_bad_failed(sched, reasons)


def test_a_failed_request_scheduled_again_before_its_end_is_not_asked_again(mocker):
    # async scheduling: the next schedule() runs before the first step's output ends it
    method = DeferringConnector.get_num_new_matched_tokens
    spy = mocker.patch.object(DeferringConnector, "get_num_new_matched_tokens", autospec=True,
                              side_effect=fail_for_bad(method))
    activation.activate(ON)
    sched = make_connector_scheduler(defers=0)
    sched.add_request(make_request("bad", prompt(1), max_tokens=4))
    sched.schedule()
    sched.schedule()
    assert spy.call_count == 1
    assert report.snapshot()["contained"] == {"get_num_new_matched_tokens": 1}


# ------------------------------------------------- 0.34+: may_load_async (inflight KV loads)
needs_may_load_async = pytest.mark.skipif(
    not hasattr(DeferringConnector, "may_load_async"),
    reason="no KVConnectorBase_V1.may_load_async in this vLLM (< 0.34)")


def run_inflight(env, mocker):
    spy = mocker.patch.object(DeferringConnector, "may_load_async", autospec=True,
                              side_effect=fail_for_bad(DeferringConnector.may_load_async))
    return spy, run(env, max_num_inflight_kv_loads=2)


@needs_may_load_async
def test_vllm_alone_dies_of_one_requests_may_load_async_error(mocker):
    with pytest.raises(KeyError, match="lost its state for bad"):
        run_inflight(OFF, mocker)


@needs_may_load_async
def test_a_may_load_async_error_ends_only_its_request(mocker, kvguard_log):
    """``--max-num-inflight-kv-loads``: the scheduler asks the connector whether each
    request entering the waiting queues may load asynchronously; a raise for "bad" ends
    "bad" alone with an error, the others run to their length, nothing is left held."""
    spy, (sched, reasons) = run_inflight(ON, mocker)
    asked = [c.args[1].request_id for c in spy.call_args_list]
    assert set(asked) == set(IDS)
    assert_only_bad_failed(sched, reasons)
    assert report.snapshot()["contained"] == {"may_load_async": 1}
    line, = [ln for ln in kvguard_log.lines() if "KV connector" in ln]
    assert "may_load_async(request bad) raised KeyError" in line


def test_may_load_async_is_declared_only_where_vllm_has_it():
    from vllm_kvguard.patches import containment
    from vllm_kvguard.versions import vllm_version

    change = containment.GUARDS["may_load_async"]
    assert change.exists_in(vllm_version()) == hasattr(DeferringConnector, "may_load_async")
    assert containment.PATCH.drift(vllm_version()) == []
