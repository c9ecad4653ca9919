"""The allocator's hot path (patches/allocator.py, fixes/rollback.py, plugin/_txn.c): which
transaction a KVCacheManager gets, when it steps aside, and what the C accelerator does
at its edges (keyword calls, BaseExceptions, a failing record, references it holds).

REAL vLLM managers and schedulers; the Python and the C transaction are both checked."""
from __future__ import annotations

import gc
import sys

import pytest

pytest.importorskip("vllm")

import wrapt  # noqa: E402

from vllm_kvguard import activation, registry, report  # noqa: E402
from vllm_kvguard.fixes import faults, rollback  # noqa: E402
from vllm_kvguard.flags import FaultSpec  # noqa: E402
from vllm_kvguard.hookspecs import hookimpl  # noqa: E402
from vllm_kvguard.manager import register, unregister  # noqa: E402
from vllm_kvguard.patches import allocator  # noqa: E402
from vllm_kvguard.registry import InjectedFault  # noqa: E402
from vllm_kvguard.testing.kv_fixtures import (hybrid_manager, make_request,  # noqa: E402
                                              make_scheduler, prefill, scheduler_step, state,
                                              state_diff)

pytestmark = pytest.mark.requires_patch("allocator")
PATHS = ["accelerated", "pure-python"]


def activate(path: str) -> None:
    if path == "accelerated" and rollback._txn is None:
        pytest.skip("the C accelerator vllm_kvguard._txn is not built")
    activation.activate({"KVGUARD": "1", "KVGUARD_PATCHES": "allocator",
                         "KVGUARD_FAULTS": "every=1,after=1000000000000",
                         "KVGUARD_PURE_PYTHON": "1" if path == "pure-python" else "0"})
    faults.reset(FaultSpec(every=1, after=10**12))


def prompt(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 1000 + 3 for i in range(n)]


def running_manager():
    m = hybrid_manager(48)
    req = make_request("running", prompt(2, 40))
    assert prefill(m, req, lookahead=2) is not None
    return m, req


def fast(m):
    return rollback.own_attr(m, "allocate_slots")


class Observer:
    def __init__(self):
        self.seen = []

    @hookimpl
    def kvguard_allocate_slots(self, manager, request, call):
        self.seen.append(request.request_id)


# ------------------------------------------------------------------------- which one
@pytest.mark.parametrize("path", PATHS)
def test_the_manager_gets_the_chosen_transaction(path):
    activate(path)
    m, _ = running_manager()
    assert rollback.is_fast_path(fast(m))
    accelerated = rollback._txn is not None and type(fast(m)) is rollback._txn.Transaction
    assert accelerated == (path == "accelerated")


def test_without_the_built_accelerator_the_python_transaction_runs(mocker):
    mocker.patch.object(rollback, "_txn", None)
    activation.activate({"KVGUARD": "1", "KVGUARD_PATCHES": "allocator"})
    m, _ = running_manager()
    assert rollback.is_fast_path(fast(m)) and hasattr(fast(m), "__code__")


# ------------------------------------------------------------------------- stepping aside
@pytest.mark.parametrize("path", PATHS)
def test_a_registration_change_removes_the_fast_path_at_once(path):
    activate(path)
    m, req = running_manager()
    observer = Observer()
    register(observer, "test.observer")
    try:
        assert rollback.own_attr(m, "allocate_slots") is None          # removed at once
        req.append_output_token_ids(5)
        assert m.allocate_slots(req, 1) is not None
        assert observer.seen == ["running"]                            # pluggy path ran it
        assert not rollback.is_fast_path(fast(m))
    finally:
        unregister("test.observer")
    req.num_computed_tokens += 1
    req.append_output_token_ids(5)
    assert m.allocate_slots(req, 1) is not None                        # rebuilt
    assert rollback.is_fast_path(fast(m)) and observer.seen == ["running"]


@pytest.mark.parametrize("path", PATHS)
def test_a_hookimpl_registered_on_pluggy_directly_runs_from_the_next_step(path):
    from vllm_kvguard.manager import get_plugin_manager

    activate(path)
    m, req = running_manager()
    observer = Observer()
    get_plugin_manager().register(observer, name="test.direct")
    try:
        assert rollback.is_fast_path(fast(m))          # not told: still in place
        allocator._revalidate()                        # what each scheduler step does
        assert rollback.own_attr(m, "allocate_slots") is None
        req.append_output_token_ids(5)
        assert m.allocate_slots(req, 1) is not None and observer.seen == ["running"]
    finally:
        get_plugin_manager().unregister(name="test.direct")


@pytest.mark.parametrize("path", PATHS)
def test_a_later_class_wrapper_runs_from_the_next_scheduler_step(path):
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    activate(path)
    sched = make_scheduler(num_gpu_blocks=33)
    sched.add_request(make_request("q", prompt(1, 20)))
    scheduler_step(sched)
    manager = sched.kv_cache_manager
    assert rollback.is_fast_path(fast(manager))
    calls = []

    def spy(wrapped, instance, args, kwargs):
        calls.append(instance)
        return wrapped(*args, **kwargs)

    ours = vars(KVCacheManager)["allocate_slots"]
    KVCacheManager.allocate_slots = wrapt.FunctionWrapper(ours, spy)
    try:
        scheduler_step(sched)                      # revalidates first, then schedules
        assert calls == [manager]
        assert not rollback.is_fast_path(fast(manager))
    finally:
        KVCacheManager.allocate_slots = ours


@pytest.mark.parametrize("path", PATHS)
def test_a_tripped_patch_leaves_vllm_alone(path):
    activate(path)
    m, req = running_manager()
    assert rollback.is_fast_path(fast(m))
    registry._tripped.add("allocator")
    faults.reset(FaultSpec(every=1, limit=1))
    for _ in range(40):                             # until a decode step pops a block
        req.append_output_token_ids(5)
        try:
            out = m.allocate_slots(req, 1, num_lookahead_tokens=2)
        except InjectedFault:
            break                                   # vLLM's behaviour: the error escapes
        req.num_computed_tokens += 1
        assert out is not None
    else:
        pytest.fail("no decode step popped a block")
    assert "rollback" not in report.snapshot()


# ------------------------------------------------------------------------- edges
@pytest.mark.parametrize("path", PATHS)
def test_request_passed_by_keyword_is_protected(path):
    activate(path)
    m, _ = running_manager()
    req = make_request("kw", prompt(5, 40))
    before = state(m)
    faults.reset(FaultSpec(every=1, limit=1))
    assert m.allocate_slots(request=req, num_new_tokens=40) is None    # rolled back
    assert state_diff(before, state(m)) == []
    assert report.snapshot()["rollback"] == {"InjectedFault": 1}


@pytest.mark.parametrize("path", PATHS)
def test_a_base_exception_passes_through_and_closes_the_log(path, mocker):
    activate(path)
    m, req = running_manager()
    coordinator = m.coordinator
    mocker.patch.object(coordinator, "allocate_new_blocks", side_effect=KeyboardInterrupt)
    req.append_output_token_ids(5)
    with pytest.raises(KeyboardInterrupt):
        m.allocate_slots(req, 1)
    assert rollback._log is None and "rollback" not in report.snapshot()


@pytest.mark.parametrize("path", PATHS)
def test_a_failing_record_turns_rollback_off_and_runs_vllm(path, kvguard_log):
    activate(path)
    m, req = running_manager()

    class NoId:                       # a request-like object without request_id
        def __getattr__(self, name):
            if name == "request_id":
                raise AttributeError(name)
            return getattr(req, name)

    req.append_output_token_ids(5)
    with pytest.raises(AttributeError):
        m.allocate_slots(NoId(), 1)   # vLLM's own call raises on it too, after ours fails
    assert rollback._disabled and report.snapshot()["internal_error"] == {"rollback": 1}
    assert any("no longer rolled back" in line for line in kvguard_log.lines())
    assert m.allocate_slots(req, 1) is not None      # vLLM keeps serving, unprotected


@pytest.mark.parametrize("path", PATHS)
def test_the_transaction_keeps_no_references(path):
    """Repeated calls that leave vLLM's state as it was (a decode that needs no block; a
    decode that needs one and is rolled back) must not leave references behind (after a
    collection: a failed call's traceback is a reference cycle)."""
    activate(path)
    m, req = running_manager()
    txn = fast(m)
    rid = req.request_id

    def counts():
        gc.collect()
        return sys.getrefcount(req), sys.getrefcount(rid), sys.getrefcount(m)

    req.append_output_token_ids(5)
    assert txn(req, 1, num_lookahead_tokens=2) is not None      # warm: no block needed
    before = counts()
    for _ in range(200):
        assert txn(req, 1, num_lookahead_tokens=2) is not None
    assert counts() == before
    while req.num_computed_tokens % 16 != 15:                   # next token: a new block
        req.num_computed_tokens += 1
        req.append_output_token_ids(5)
    faults.reset(FaultSpec(every=1))
    assert txn(req, 2) is None                                  # warm: logs once
    before, state_before = counts(), state(m)
    for _ in range(100):
        assert txn(req, 2) is None
    after = counts()
    assert after[0] == before[0] and after[2] == before[2]      # request, manager: exact
    assert after[1] - before[1] < 20       # the id string (vLLM keys on it): none per call
    assert state_diff(state_before, state(m)) == []
    assert report.snapshot()["rollback"] == {"InjectedFault": 101}
    assert rollback._log is None


@pytest.mark.skipif(rollback._txn is None, reason="the C accelerator is not built")
@pytest.mark.parametrize("ops,why", [
    (((0, {}, 1),), "RTB op"), (((1, [], None),), "GET op"), (((2, {}, None),), "IN op"),
    (((3, object(), 5),), "LENATTR op"), (((0, {}, 0), (4, 1, 2)), "WINDOW op"),
    (((9, None, None),), "unknown record op"), (((1, {}),), "3-tuple")])
def test_the_c_transaction_refuses_a_malformed_recipe(ops, why):
    with pytest.raises((TypeError, ValueError), match=why):
        rollback._txn.Transaction(fn=print, fallback=print, recover=print, disable=print,
                                  plan=None, manager=None, globals={}, disabled=[],
                                  tripped=set(), ops=ops)
