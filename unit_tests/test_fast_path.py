"""The allocator's hot path: which managers get their transaction installed
(patches/allocator.py), when it steps aside, and its edges (keyword calls,
BaseExceptions, a failing record, references it holds). REAL vLLM managers."""
from __future__ import annotations

import gc
import sys

import pytest

pytest.importorskip("vllm")

import vllm.v1.core.kv_cache_manager  # noqa: E402,F401  (loaded: patches apply at once)
from vllm_kvguard.testing.kv_fixtures import (free_ids, hybrid_manager, make_request, prefill,  # noqa: E402
                         state, state_diff)

from vllm_kvguard import activation, hostcall, report  # noqa: E402
from vllm_kvguard.flags import FaultSpec  # noqa: E402
from vllm_kvguard.hookspecs import hookimpl  # noqa: E402
from vllm_kvguard.hostcall import InjectedFault  # noqa: E402
from vllm_kvguard.manager import get_plugin_manager, register, unregister  # noqa: E402
from vllm_kvguard.patches import allocator  # noqa: E402
from vllm_kvguard.patches import faults as fault_patch  # noqa: E402
from vllm_kvguard.versions import in_range, vllm_version  # noqa: E402

pytestmark = pytest.mark.requires_patch("allocator")


def activate() -> None:
    activation.activate({"KVGUARD": "1", "KVGUARD_PATCHES": "allocator",
                         "KVGUARD_FAULTS": "every=1,after=1000000000000"})
    fault_patch.injector().reset(FaultSpec(every=1, after=10**12))


def arm(spec: FaultSpec) -> None:
    fault_patch.injector().reset(spec)


def prompt(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 1000 + 3 for i in range(n)]


def running_manager():
    m = hybrid_manager(48)
    req = make_request("running", prompt(2, 40))
    assert prefill(m, req, lookahead=2) is not None
    return m, req


def fast(m):
    return allocator.FAST_PATH.get(m)


class Observer:
    def __init__(self):
        self.seen = []

    @hookimpl
    def kvguard_allocate_slots(self, manager, request, call):
        self.seen.append(request.request_id)


# ------------------------------------------------------------------------- which one
def test_the_manager_gets_its_transaction_at_its_first_call():
    activate()
    m, _ = running_manager()
    assert fast(m) is not None and fast(m).__name__ == "allocate_slots"
    assert m.allocate_slots is fast(m)                       # an instance attribute
    assert ("instance attribute", allocator.FAST_PATH.name, m) in [
        (kind, name, obj) for kind, name, obj in allocator.PATCH.inventory()]


# ------------------------------------------------------------------------- vLLM's own
def test_the_journal_logs_pops_in_order_and_keeps_vllms_collector_less_path(mocker):
    """The pop log is the free queue's own order, and no collector is installed: vLLM
    0.34's ``get_new_blocks`` then skips ``_maybe_evict_cached_block`` for blocks that
    were never cached (its fast path); older releases call it for every block."""
    activate()
    m, _ = running_manager()
    pool = m.block_pool
    journal = allocator._State.fix.plan_for(m).journal
    head = free_ids(m)[:3]
    journal.log.clear()
    assert [b.block_id for b in pool.get_new_blocks(3)] == head
    assert [b.block_id for b in journal.log] == head
    pool.free_blocks(journal.log[::-1])
    evict = mocker.spy(pool, "_maybe_evict_cached_block")
    head = pool.free_block_queue.get_all_free_blocks()[:4]
    n = next((i for i, b in enumerate(head) if b.block_hash is not None), len(head))
    assert n, "the queue's head must hold never-cached blocks"
    got = pool.get_new_blocks(n)
    fast_path = in_range(vllm_version(), ">=0.34")
    assert evict.call_count == (0 if fast_path else n), evict.call_count
    pool.free_blocks(got)


# ------------------------------------------------------------------------- stepping aside
def test_a_registration_change_removes_the_fast_path_at_once():
    activate()
    m, req = running_manager()
    observer = Observer()
    register(observer, "test.observer")
    try:
        assert fast(m) is None                                         # removed at once
        req.append_output_token_ids(5)
        assert m.allocate_slots(req, 1) is not None
        assert observer.seen == ["running"]                            # pluggy path ran it
        assert fast(m) is None
    finally:
        unregister("test.observer")
    req.num_computed_tokens += 1
    req.append_output_token_ids(5)
    assert m.allocate_slots(req, 1) is not None                        # rebuilt
    assert fast(m) is not None and observer.seen == ["running"]


def test_a_hookimpl_registered_on_pluggy_directly_takes_effect_at_once():
    activate()
    m, req = running_manager()
    observer = Observer()
    get_plugin_manager().register(observer, name="test.direct")
    try:
        assert fast(m) is None                          # the manager's seam saw it
        req.append_output_token_ids(5)
        assert m.allocate_slots(req, 1) is not None and observer.seen == ["running"]
    finally:
        get_plugin_manager().unregister(name="test.direct")


def test_a_tripped_patch_leaves_vllm_alone():
    activate()
    m, req = running_manager()
    assert fast(m) is not None
    hostcall.trip("allocator", RuntimeError("test"))
    assert fast(m) is None
    arm(FaultSpec(every=1, limit=1))
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
def test_request_passed_by_keyword_is_protected():
    activate()
    m, _ = running_manager()
    req = make_request("kw", prompt(5, 40))
    before = state(m)
    arm(FaultSpec(every=1, limit=1))
    assert m.allocate_slots(request=req, num_new_tokens=40) is None    # rolled back
    assert state_diff(before, state(m)) == []
    assert report.snapshot()["rollback"] == {"InjectedFault": 1}


def test_a_base_exception_passes_through_untouched(mocker):
    activate()
    m, req = running_manager()
    coordinator = m.coordinator
    mocker.patch.object(coordinator, "allocate_new_blocks", side_effect=KeyboardInterrupt)
    req.append_output_token_ids(5)
    with pytest.raises(KeyboardInterrupt):
        m.allocate_slots(req, 1)
    assert "rollback" not in report.snapshot()
    mocker.stopall()
    assert m.allocate_slots(req, 1) is not None           # the next call runs as usual


def test_a_failing_record_turns_rollback_off_and_runs_vllm(kvguard_log):
    activate()
    m, req = running_manager()

    class NoId:                       # a request-like object without request_id
        def __getattr__(self, name):
            if name == "request_id":
                raise AttributeError(name)
            return getattr(req, name)

    req.append_output_token_ids(5)
    with pytest.raises(AttributeError):
        m.allocate_slots(NoId(), 1)   # vLLM's own call raises on it too, after ours fails
    assert allocator._State.fix.disabled and report.snapshot()["internal_error"] == {"rollback": 1}
    assert any("no longer rolled back" in line for line in kvguard_log.lines())
    assert m.allocate_slots(req, 1) is not None      # vLLM keeps serving, unprotected


def test_the_transaction_keeps_no_references():
    """Repeated calls that leave vLLM's state as it was (a decode that needs no block; a
    decode that needs one and is rolled back) must not leave references behind (after a
    collection: a failed call's traceback is a reference cycle)."""
    activate()
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
    arm(FaultSpec(every=1))
    assert txn(req, 2) is None                                  # warm: logs once
    before, state_before = counts(), state(m)
    for _ in range(100):
        assert txn(req, 2) is None
    after = counts()
    assert after[0] == before[0] and after[2] == before[2]      # request, manager: exact
    assert after[1] - before[1] < 20       # the id string (vLLM keys on it): none per call
    assert state_diff(state_before, state(m)) == []
    assert report.snapshot()["rollback"] == {"InjectedFault": 101}
    assert len(allocator._State.fix.plan_for(m).journal.log) < 8   # the last call's only


# ------------------------------------------------------------------------- with room: no record
def activate_alone() -> None:
    """The allocator fix without the fault injector: calls with room run unrecorded."""
    activation.deactivate()
    activation.activate({"KVGUARD": "1", "KVGUARD_PATCHES": "allocator"})


def test_the_fault_injector_turns_the_fast_path_off():
    activate()
    assert not allocator._State.fix.fast            # KVGUARD_FAULTS: every call records
    activate_alone()
    m, req = running_manager()
    plan = allocator._State.fix.plan_for(m)
    assert allocator._State.fix.fast and plan.fast is not None
    assert plan.bound(3) < m.block_pool.get_num_free_blocks()     # this call has room


def test_a_fault_on_the_fast_path_ends_only_its_request(mocker):
    """A phase raising on a call with room (nothing recorded): the call is "no room now",
    the request finishes with an error after that step, the others are served to their
    length, nothing leaks, the audit is clean; counted, never a rollback."""
    from vllm_kvguard.fixes.transaction import audit
    from vllm_kvguard.testing.kv_fixtures import make_scheduler, scheduler_step, used_blocks

    activate_alone()
    sched = make_scheduler(num_gpu_blocks=64)
    reqs = {rid: make_request(rid, prompt(i, 40), max_tokens=4)
            for i, rid in enumerate(("r0", "bad", "r2"))}
    for req in reqs.values():
        sched.add_request(req)
    coord = sched.kv_cache_manager.coordinator
    original = coord.allocate_new_blocks
    free_at_fault = []

    def raise_for_bad(request_id, *args, **kwargs):
        free = sched.kv_cache_manager.block_pool.get_num_free_blocks()
        out = original(request_id, *args, **kwargs)     # the blocks are popped and held
        if request_id == "bad":
            free_at_fault.append(free)
            raise RuntimeError("injected after allocate_new_blocks")
        return out

    mocker.patch.object(coord, "allocate_new_blocks", side_effect=raise_for_bad)
    for _ in range(12):
        scheduler_step(sched)
    status = {rid: req.status.name for rid, req in reqs.items()}
    assert status["bad"] in ("FINISHED_ERROR", "FINISHED_ABORTED"), status  # per vLLM
    assert status["r0"] == status["r2"] == "FINISHED_LENGTH_CAPPED", status
    assert len(reqs["r0"].output_token_ids) == len(reqs["r2"].output_token_ids) == 4
    assert not sched.requests and used_blocks(sched.kv_cache_manager) == 0
    assert audit.audit_kv_cache_manager(sched.kv_cache_manager, sched) == []
    snap = report.snapshot()
    assert snap["fast_path_fault"] == {"RuntimeError": 1} and "rollback" not in snap
    assert snap["contained"] == {"allocate_slots": 1}
    # the call ran under the bound of any call (the first check of the fast path)
    assert free_at_fault[0] >= allocator._State.fix.plan_for(sched.kv_cache_manager).big


def test_out_of_blocks_on_the_fast_path_is_our_bug_and_logged_with_the_bound(kvguard_log):
    activate_alone()
    m, _ = running_manager()
    req = make_request("new", prompt(5, 40))
    pool = m.block_pool

    def short(n):
        raise ValueError(f"Cannot get {n} free blocks from the pool")

    pool.get_new_blocks = short                         # this pool only: a wrong bound
    try:
        assert m.allocate_slots(req, 40) is None        # contained, not raised
    finally:
        del pool.get_new_blocks
    bound = allocator._State.fix.plan_for(m).bound(40)
    line, = [ln for ln in kvguard_log.lines() if "BUG" in ln]
    assert f"bound of {bound} blocks" in line and "request new, 40 tokens" in line
    assert report.snapshot()["fast_path_fault"] == {"ValueError": 1}


def test_vllms_argument_check_still_raises_on_the_fast_path():
    activate_alone()
    m, req = running_manager()
    with pytest.raises(ValueError, match="num_new_tokens"):
        m.allocate_slots(make_request("zero", prompt(6, 20)), 0)
    assert "fast_path_fault" not in report.snapshot() and "contained" not in report.snapshot()


def test_calls_with_room_take_the_touch_and_hash_seams_off_a_recorded_call_puts_them_back(
        mocker):
    """A call with room leaves only the pop seam; the next call that records (a prefix
    hit into a nearly full pool) puts ``touch`` and ``_insert_block_hash`` back before vLLM
    runs, so its failure half-way (after the hit's blocks were touched) is undone exactly."""
    from vllm_kvguard.lookup import has_own
    from vllm_kvguard.testing.kv_fixtures import attention_spec, make_manager, prefill

    activate_alone()
    m = make_manager([attention_spec()], num_blocks=64, max_model_len=1024,
                     enable_caching=True)
    pool, queue = m.block_pool, m.block_pool.free_block_queue
    shared = prompt(3, 64)
    first = make_request("first", shared + prompt(4, 8))
    assert prefill(m, first) is not None                # room: unrecorded
    journal = allocator._State.fix.plan_for(m).journal
    assert not journal.hot and has_own(queue, "popleft_n")
    assert not has_own(pool, "touch") and not has_own(pool, "_insert_block_hash")
    m.free(first)                                       # its full blocks stay cached
    fillers = 0
    second = make_request("second", shared + prompt(5, 8))
    while pool.get_num_free_blocks() >= allocator.fast_bound(m, 64 + 16):  # hit + chunk
        filler = make_request(f"filler{fillers}", prompt(100 + fillers, 16))
        assert prefill(m, filler) is not None
        fillers += 1
    assert m.get_computed_blocks(second)[1] == 64, "the shared prefix must be a hit"
    before = state(m)
    boom = mocker.patch.object(m.coordinator, "allocate_new_blocks",
                               side_effect=RuntimeError("injected after the hit's touch"))
    assert prefill(m, second) is None and boom.called   # rolled back: "no room now"
    assert journal.hot and has_own(pool, "touch") and has_own(pool, "_insert_block_hash")
    assert state_diff(before, state(m)) == []
    assert report.snapshot()["rollback"] == {"RuntimeError": 1}
