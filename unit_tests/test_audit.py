"""Audit mode (fixes/audit.py) on REAL vLLM managers and a real Scheduler.

Each corruption below is what a real defect leaves behind (a half-done allocation, a
request id dropped without freeing its blocks, a ref count off by one, a held block in
the free queue); the audit must name it and the request ids involved.
"""
from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import vllm.v1.core.kv_cache_manager  # noqa: E402,F401  (loaded: patches apply at once)

from vllm_kvguard.testing.kv_fixtures import (groups, hybrid_manager, make_request, make_scheduler,  # noqa: E402
                         prefill, scheduler_step)

from vllm_kvguard import activation, report  # noqa: E402
from vllm_kvguard.fixes.transaction.audit import audit_manager, audit_scheduler  # noqa: E402


def prompt(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 1000 + 3 for i in range(n)]


def kinds(result) -> set[str]:
    return {v.kind for v in result.violations}


def busy_manager():
    m = hybrid_manager(64, nsb=1)
    reqs = [make_request(f"r{i}", prompt(i % 2, 40 + 9 * i)) for i in range(4)]
    for r in reqs:
        m.new_step_starts()
        assert prefill(m, r, lookahead=2) is not None
    for _ in range(20):
        m.new_step_starts()
        for r in reqs:
            r.append_output_token_ids(9)
            assert m.allocate_slots(r, 1, num_lookahead_tokens=2) is not None
            r.num_computed_tokens += 1
    return m, reqs


def test_consistent_state_passes_and_adds_up():
    m, reqs = busy_manager()
    result = audit_manager(m, known_requests={r.request_id for r in reqs})
    assert result.ok, result.summary()
    assert result.free + result.held + 1 == result.total == 64
    assert result.held == 64 - 1 - m.block_pool.get_num_free_blocks()
    for r in reqs:
        m.free(r)
    result = audit_manager(m, known_requests=set())
    assert result.ok and result.held == 0 and result.leaked == 0


def test_half_done_allocation_is_reported_with_the_request_id():
    m = hybrid_manager(5)                      # vLLM's own A.5 trigger, no fix
    req = make_request("victim", range(3, 43))
    with pytest.raises(ValueError):
        m.allocate_slots(req, 8, num_external_computed_tokens=32)
    result = audit_manager(m, known_requests={"victim"}, idle_requests={"victim"})
    assert "waiting_request_holds_blocks" in kinds(result)
    assert all(v.request_ids == ("victim",) for v in result.violations)


def test_dropped_request_id_leaks_its_blocks():
    m, reqs = busy_manager()
    lost = reqs[1].request_id                  # shares its prefix blocks with r3
    blocks = [b for g in groups(m) for b in g.req_to_blocks[lost] if not b.is_null]
    own = {b.block_id for b in blocks if b.ref_cnt == 1}
    shared = {b.block_id for b in blocks if b.ref_cnt > 1}
    assert own and shared
    for g in groups(m):                        # forget the request without freeing
        g.req_to_blocks.pop(lost)
        g.num_cached_block.pop(lost, None)
    result = audit_manager(m, known_requests={r.request_id for r in reqs} - {lost})
    assert kinds(result) == {"leaked", "ref_mismatch"}
    assert {v.block_id for v in result.violations if v.kind == "leaked"} == own
    assert {v.block_id for v in result.violations if v.kind == "ref_mismatch"} == shared
    assert result.leaked == len(own)


def test_orphaned_request_and_ref_count_and_free_queue_corruption():
    m, reqs = busy_manager()
    attn = groups(m)[0]
    block = attn.req_to_blocks["r0"][0]
    block.ref_cnt += 1
    result = audit_manager(m, known_requests={"r0", "r1", "r2"})       # r3 unknown
    assert {"ref_mismatch", "orphaned_request"} <= kinds(result)
    mismatch = next(v for v in result.violations if v.kind == "ref_mismatch")
    assert mismatch.block_id == block.block_id and "r0" in mismatch.request_ids
    block.ref_cnt -= 1
    other = attn.req_to_blocks["r2"][-1]
    m.block_pool.free_block_queue.append(other)     # a held block in the free queue
    assert "free_and_held" in kinds(audit_manager(m))


def test_num_cached_block_beyond_the_list_is_reported():
    m, _ = busy_manager()
    g = groups(m)[0]
    g.num_cached_block["r2"] = len(g.req_to_blocks["r2"]) + 3
    result = audit_manager(m)
    assert kinds(result) == {"num_cached_block"}
    assert result.violations[0].request_ids == ("r2",)


# ------------------------------------------------------------------------- audit mode
@pytest.fixture(scope="module")
def scheduler_factory():
    return lambda: make_scheduler(num_gpu_blocks=33)


@pytest.mark.parametrize("audit", [True, False])
def test_audit_mode_runs_after_every_schedule(scheduler_factory, kvguard_log, audit):
    activation.activate({"KVGUARD": "1", "KVGUARD_PATCHES": "allocator",
                         "KVGUARD_AUDIT": "1" if audit else "0"})
    sched = scheduler_factory()
    for i in range(3):
        sched.add_request(make_request(f"q{i}", prompt(i, 30 + i)))
    for _ in range(3):
        scheduler_step(sched)
    assert audit_scheduler(sched).ok
    counters = report.snapshot()
    assert counters.get("audit", {}).get("steps", 0) == (3 if audit else 0)
    assert "audit_violation" not in counters

    rid = next(iter(sched.running)).request_id          # corrupt: drop a ref
    sched.kv_cache_manager.coordinator.single_type_managers[0].req_to_blocks[rid][0].ref_cnt += 1
    scheduler_step(sched)
    counters = report.snapshot()
    if audit:
        assert counters["audit_violation"]["ref_mismatch"] >= 1
        assert any("ref_mismatch" in line and rid in line for line in kvguard_log.lines())
    else:
        assert "audit_violation" not in counters


def test_clean_scheduler_run_has_held_blocks_and_a_planted_leak_is_found(scheduler_factory,
                                                                          kvguard_log):
    """A real Scheduler stepped with audit mode on: the held blocks are attributed to
    their requests (vLLM 0.34 keeps a block's pool as a weakref) and nothing is reported;
    then a request forgotten without freeing leaks exactly its blocks, and the audit says
    so after the next step."""
    activation.activate({"KVGUARD": "1", "KVGUARD_PATCHES": "allocator", "KVGUARD_AUDIT": "1"})
    sched = scheduler_factory()
    for i in range(3):
        sched.add_request(make_request(f"q{i}", prompt(i + 5, 40 + i)))
    for _ in range(4):
        scheduler_step(sched)
    clean = audit_scheduler(sched)
    assert clean.ok and clean.held > 0 and clean.leaked == 0, clean.summary()
    assert clean.free + clean.held + 1 == clean.total
    assert "audit_violation" not in report.snapshot()

    rid = sorted(r.request_id for r in sched.running)[0]
    stm = sched.kv_cache_manager.coordinator.single_type_managers[0]
    own = {b.block_id for b in stm.req_to_blocks[rid] if not b.is_null and b.ref_cnt == 1}
    assert own
    del stm.req_to_blocks[rid]                          # forgotten, never freed
    stm.num_cached_block.pop(rid, None)
    leak = audit_scheduler(sched)
    assert {v.block_id for v in leak.violations if v.kind == "leaked"} == own
    assert leak.leaked == len(own)
    from vllm.v1.request import RequestStatus

    sched.finish_requests(rid, RequestStatus.FINISHED_ABORTED)   # frees nothing now
    scheduler_step(sched)                               # the hook audits after schedule
    assert report.snapshot()["audit_violation"]["leaked"] >= 1
    assert any("leaked" in line for line in kvguard_log.lines())
