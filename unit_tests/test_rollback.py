"""Transactional ``allocate_slots`` on REAL vLLM managers (fixes/rollback.py).

Faults come from the project's own injector (``KVGUARD_FAULTS``, patches/faults.py) or,
for phases other than ``BlockPool.get_new_blocks``, from pytest-mock on one manager
instance. Every test compares the full state picture (kv_fixtures.state) before the
failing call and after it: identical, except that the prefix cache may have forgotten
hashes. Each also shows what vLLM does without the fix, so it fails if the fix is gone.
"""
from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import vllm.v1.core.kv_cache_manager  # noqa: E402,F401  (loaded: patches apply at once)

from vllm_kvguard.testing.kv_fixtures import (attention_spec, free_ids, groups, hybrid_manager,  # noqa: E402
                         make_manager, make_request, mamba_spec, prefill, settle, state,
                         state_diff, used_blocks)

from vllm_kvguard import activation, report  # noqa: E402
from vllm_kvguard.fixes.transaction import rollback  # noqa: E402
from vllm_kvguard.flags import FaultSpec  # noqa: E402
from vllm_kvguard.hostcall import InjectedFault  # noqa: E402
from vllm_kvguard.manager import register, unregister  # noqa: E402
from vllm_kvguard.patches import allocator  # noqa: E402
from vllm_kvguard.patches import faults as fault_patch  # noqa: E402

BS = 16
NEVER = FaultSpec(every=1, after=10**12)


def activate(fix: bool = True):
    """The allocator fix (or none) plus the fault injector, disarmed."""
    activation.deactivate()
    activation.activate({"KVGUARD": "1", "KVGUARD_PATCHES": "allocator" if fix else "none",
                         "KVGUARD_FAULTS": "every=1,after=1000000000000"})
    fault_patch.injector().reset(NEVER)


def arm(nth: int) -> None:
    """Fail the ``nth`` ``BlockPool.get_new_blocks`` call from now on, once."""
    fault_patch.injector().reset(FaultSpec(every=nth, limit=1))


def fired() -> int:
    return fault_patch.injector().schedule.fired


def prompt(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 1000 + 3 for i in range(n)]


def admit(manager, req, *, lookahead: int = 0, external: int = 0):
    """What the scheduler's waiting loop does for a new request (local prefix hit)."""
    blocks, hit, _ = manager.get_computed_blocks(req)
    new = req.num_tokens - hit - external
    out = manager.allocate_slots(req, new, num_new_computed_tokens=hit,
                                 new_computed_blocks=blocks, num_lookahead_tokens=lookahead,
                                 num_external_computed_tokens=external)
    if out is not None:
        req.num_computed_tokens = req.num_tokens
    return out


def decode(manager, req, *, lookahead: int = 0):
    req.append_output_token_ids(5)
    out = manager.allocate_slots(req, 1, num_lookahead_tokens=lookahead)
    if out is not None:
        req.num_computed_tokens += 1
    return out


def cached_prefix_manager(enable_caching=True, nsb=0, num_blocks=48):
    """A manager whose pool holds a finished request's cached prefix (eviction candidates)
    and one running request."""
    m = hybrid_manager(num_blocks, enable_caching=enable_caching, nsb=nsb)
    done = make_request("done", prompt(1, 70))
    assert prefill(m, done) is not None
    m.free(done)
    running = make_request("running", prompt(2, 47))
    assert prefill(m, running, lookahead=2) is not None
    m.new_step_starts()           # a new scheduler step: today's cached blocks are hittable
    return m, running


def hitting_request(rid="new"):
    """Shares the finished request's first 64 tokens (4 blocks, a Mamba state at 64)."""
    return make_request(rid, prompt(1, 64) + prompt(3, 30))


# ------------------------------------------------------------------------- get_new_blocks
@pytest.mark.parametrize("enable_caching", [True, False])
@pytest.mark.parametrize("nth", [1, 2])
def test_new_request_fault_in_any_pop_is_rolled_back(enable_caching, nth):
    activate()
    m, _ = cached_prefix_manager(enable_caching)
    req = hitting_request()
    before = state(m)
    arm(nth)
    assert admit(m, req) is None
    assert fired() == 1
    assert state_diff(before, state(m)) == []
    assert report.snapshot()["rollback"] == {"InjectedFault": 1}
    # the request is scheduled later, when the scheduler retries
    assert admit(m, req) is not None


@pytest.mark.parametrize("nth", [1, 2])
def test_without_the_fix_the_same_fault_escapes_and_leaves_half_state(nth):
    activate(fix=False)
    m, _ = cached_prefix_manager()
    req = hitting_request()
    before = state(m)
    arm(nth)
    with pytest.raises(InjectedFault):
        admit(m, req)
    assert state_diff(before, state(m)) != []


@pytest.mark.parametrize("nsb", [0, 2])
@pytest.mark.parametrize("lookahead", [0, 4])
def test_running_request_fault_is_rolled_back(nsb, lookahead):
    """Decode steps of a running request; a fault in the first allocation that pops."""
    activate()
    m, run = cached_prefix_manager(nsb=nsb)
    for _ in range(40):
        m.new_step_starts()
        settle(m, run)
        before = state(m)
        arm(1)
        out = decode(m, run, lookahead=lookahead)
        if fired():
            assert out is None
            assert state_diff(before, state(m)) == []
            run.num_computed_tokens = run.num_tokens - 1      # the token is retried
            assert report.snapshot()["rollback"]
            return
        assert out is not None
    pytest.fail("no allocation popped a block in 40 decode steps")


# ------------------------------------------------------------------------- other phases
PHASES = ["add_local_computed_blocks", "allocate_external_computed_blocks",
          "allocate_new_blocks", "cache_blocks"]


@pytest.mark.parametrize("phase", PHASES)
@pytest.mark.parametrize("group", [0, 1])
def test_fault_after_any_phase_of_any_group(mocker, phase, group):
    """The phase ran completely in ``group`` (its mutations happened), then raised."""
    activate()
    m, _ = cached_prefix_manager()
    req = hitting_request()
    mgr = groups(m)[group]
    original = getattr(mgr, phase)

    def run_then_raise(*args, **kwargs):
        original(*args, **kwargs)
        raise AssertionError(f"injected after {phase}")

    injected = mocker.patch.object(mgr, phase, side_effect=run_then_raise)
    before = state(m)
    external = 16 if phase == "allocate_external_computed_blocks" else 0
    assert admit(m, req, lookahead=2, external=external) is None
    assert injected.called
    assert state_diff(before, state(m)) == []
    assert report.snapshot()["rollback"] == {"AssertionError": 1}


def test_rollback_prefix_hits_stay_correct(mocker):
    """cache_blocks registers hashes before the forward pass runs; after a rollback no
    later request may hit those blocks (their content was never computed), while the
    prefix computed earlier still hits."""
    activate()
    m = hybrid_manager(64)
    first = make_request("first", prompt(4, 64))
    assert admit(m, first) is not None                    # computed: 4 full blocks
    m.free(first)
    second = make_request("second", prompt(4, 64) + prompt(5, 64))
    attn = groups(m)[0]
    original = attn.cache_blocks

    def cache_then_fail(*args, **kwargs):
        original(*args, **kwargs)
        raise RuntimeError("injected after cache_blocks")

    mocker.patch.object(attn, "cache_blocks", side_effect=cache_then_fail)
    assert admit(m, second) is None                       # rolled back
    mocker.stopall()
    third = make_request("third", prompt(4, 64) + prompt(5, 64) + prompt(6, 20))
    blocks, hit, _ = m.get_computed_blocks(third)
    assert hit == 64, "only the prefix that was really computed may hit"
    first_again = make_request("again", prompt(4, 64) + [1])
    _, hit_again, _ = m.get_computed_blocks(first_again)
    assert hit_again == 64


def test_error_before_any_change_is_reraised():
    """vLLM's own argument check raises before mutating: not a rollback, vLLM's error."""
    activate()
    m = hybrid_manager(16)
    req = make_request("r", prompt(1, 20))
    with pytest.raises(ValueError, match="num_new_tokens"):
        m.allocate_slots(req, 0)
    assert "rollback" not in report.snapshot()


def test_a_failed_undo_is_no_room_with_no_stray_block(mocker, kvguard_log):
    """The undo itself fails: vLLM's error is not re-raised (EngineCore would die); the
    call is "no room now", the request is doomed, and every block the call popped is
    either in one of its tables or back in the pool."""
    activate()
    m = hybrid_manager(32)
    req = make_request("r", prompt(1, 40))
    arm(2)
    mocker.patch.object(rollback, "rollback", side_effect=rollback.RollbackFailed("x"))
    assert admit(m, req) is None
    snap = report.snapshot()
    assert snap["rollback_failed"] == {"InjectedFault": 1}
    assert snap["contained"] == {"allocate_slots": 1}
    held = {id(b) for mgr in m.coordinator.single_type_managers
            for b in mgr.req_to_blocks.get("r", ()) if not b.is_null}
    assert used_blocks(m) == len(held)
    line, = [ln for ln in kvguard_log.lines() if "undoing it raised" in ln]
    assert "request r failed" in line and "only this request is ended" in line


def test_a_request_whose_undo_fails_is_ended_alone(mocker):
    """On a real Scheduler: the request whose allocation cannot be undone finishes with an
    error after that step, the others are served to their length, nothing leaks."""
    from vllm_kvguard.fixes.transaction import audit
    from vllm_kvguard.testing.kv_fixtures import make_scheduler, scheduler_step

    activate()
    sched = make_scheduler(num_gpu_blocks=64)
    for i, rid in enumerate(("r0", "bad", "r2")):
        sched.add_request(make_request(rid, prompt(i, 40), max_tokens=4))
    arm(2)                                  # the second pool call: "bad"'s admission
    mocker.patch.object(rollback, "rollback", side_effect=rollback.RollbackFailed("x"))
    reasons = {}
    for _ in range(12):
        _out, engine_outputs = scheduler_step(sched)
        for eco in engine_outputs.values():
            reasons.update({o.request_id: str(o.finish_reason) for o in eco.outputs
                            if o.finish_reason is not None})
    assert fired() == 1
    assert "ERROR" in reasons["bad"].upper(), reasons
    assert "LENGTH" in reasons["r0"].upper() and "LENGTH" in reasons["r2"].upper(), reasons
    assert not sched.requests and used_blocks(sched.kv_cache_manager) == 0
    assert audit.audit_kv_cache_manager(sched.kv_cache_manager, sched) == []


def test_rolled_back_hook_names_the_group(kvguard_log):
    seen = []

    class Listener:
        from vllm_kvguard.hookspecs import hookimpl

        @hookimpl
        def kvguard_allocation_rolled_back(self, manager, request, group, error):
            seen.append((request.request_id, group, type(error).__name__))

    activate()
    register(Listener(), "test.listener")
    try:
        m = hybrid_manager(32)
        arm(2)                                          # 2nd pop: the Mamba group
        assert admit(m, make_request("r", prompt(1, 40))) is None
    finally:
        unregister("test.listener")
    assert seen == [("r", 1, "InjectedFault")]
    lines = [line for line in kvguard_log.lines() if "rolled back" in line]
    assert len(lines) == 1 and "request r" in lines[0] and "group 1" in lines[0]


# ------------------------------------------------------------------------- the machinery
def test_fast_path_and_pool_seams_are_removed_on_deactivate():
    activate()
    m, run = cached_prefix_manager()
    pool = m.block_pool
    assert "allocate_slots" in vars(m)                   # per-instance fast path
    assert {"touch", "_insert_block_hash"} <= set(vars(pool))
    assert "popleft_n" in vars(pool.free_block_queue)    # the journal's pop log
    assert pool.metrics_collector is None                # vLLM's own value, untouched
    activation.deactivate()
    assert "allocate_slots" not in vars(m)
    assert not {"touch", "_insert_block_hash"} & set(vars(pool))
    assert "popleft_n" not in vars(pool.free_block_queue)
    assert decode(m, run) is not None                    # vLLM runs as before


def test_vllms_own_metrics_collector_keeps_its_reports():
    """With vLLM's KV-cache metrics on, the journal leaves vLLM's collector in place: every
    block handed out still reaches it, a failure is still rolled back, and nothing of
    the journal is left on the pool after deactivation."""
    from vllm.v1.core.kv_cache_metrics import KVCacheMetricsCollector

    activate()
    own = KVCacheMetricsCollector(sample_rate=1.0)
    m = make_manager([attention_spec(BS), mamba_spec(BS, "align")], num_blocks=48,
                     metrics_collector=own)
    pool = m.block_pool
    assert admit(m, make_request("r", prompt(1, 40))) is not None
    assert pool.metrics_collector is own
    held = {b.block_id for g in groups(m) for b in g.req_to_blocks["r"] if not b.is_null}
    assert held and held <= set(own.block_metrics)       # every block handed out reported
    before = state(m)
    arm(2)                                               # the Mamba group's pop
    assert admit(m, make_request("r2", prompt(2, 40))) is None
    assert state_diff(before, state(m)) == []
    activation.deactivate()
    assert pool.metrics_collector is own and "popleft_n" not in vars(pool.free_block_queue)


def test_unknown_manager_type_is_left_alone(kvguard_log):
    activate()
    m = hybrid_manager(32)
    arm(2)
    groups(m)[1].__class__ = type("PrivateManager", (type(groups(m)[1]),), {})
    with pytest.raises(InjectedFault):
        admit(m, make_request("r", prompt(1, 40)))
    assert any("not available for manager(s) PrivateManager" in line
               for line in kvguard_log.lines())


def test_the_transaction_takes_and_passes_on_vllm_s_own_parameters():
    """The transaction declares vLLM's allocate_slots parameters (no *args/**kwargs to build
    per call) and passes each one on as given, by position or keyword, defaults included."""
    import inspect

    activate()
    m = hybrid_manager(32)
    fix = allocator._State.fix
    seen = []
    txn = fix.transaction(m, lambda *args, **kwargs: seen.append((args, kwargs)))
    vllm_params = list(inspect.signature(type(m).allocate_slots).parameters)[1:]
    assert list(inspect.signature(txn).parameters) == vllm_params
    req = make_request("r", prompt(1, 40))
    values = {name: object() for name in vllm_params[1:]}
    txn(req, **values)
    assert seen[-1] == ((req, *values.values()), {})
    txn(req, 40)
    defaults = [p.default for p in inspect.signature(type(m).allocate_slots).parameters.values()]
    assert seen[-1] == ((req, 40, *defaults[3:]), {})


def test_reordered_parameters_are_passed_on_by_their_own_order():
    """A vLLM whose allocate_slots orders its parameters differently gets a transaction
    with that order, and a half-done allocation through it is still rolled back."""
    from vllm_kvguard.fixes.transaction.plan import unsupported_reason

    activate()
    m = hybrid_manager(32)
    base = type(m)
    calls = []

    def allocate_slots(self, request, num_new_tokens, num_lookahead_tokens=0,
                       num_new_computed_tokens=0, new_computed_blocks=None, **kwargs):
        calls.append((num_new_tokens, num_lookahead_tokens, num_new_computed_tokens))
        return base.allocate_slots(self, request, num_new_tokens, num_new_computed_tokens,
                                   new_computed_blocks, num_lookahead_tokens, **kwargs)

    m.__class__ = type("Reordered", (base,), {"allocate_slots": allocate_slots})
    assert unsupported_reason(m) is None
    txn = allocator._State.fix.transaction(m, allocate_slots.__get__(m))
    req = make_request("r", prompt(1, 40))
    free = m.block_pool.get_num_free_blocks()
    arm(2)                                               # the Mamba group's pop, last
    assert txn(req, 40, 2, 0, None) is None
    assert fired() == 1 and calls == [(40, 2, 0)]
    assert m.block_pool.get_num_free_blocks() == free
    assert all(req.request_id not in g.req_to_blocks or not g.req_to_blocks[req.request_id]
               for g in groups(m))


def test_a_parameter_named_like_the_transaction_s_own_names_is_refused():
    """A vLLM parameter called like one of the transaction's names (here ``log``) would
    shadow it: no transaction is compiled for that signature."""
    with pytest.raises(ValueError, match="log would shadow"):
        rollback._compiled(("v0 = ()",), ("request", "log=None"), ("request", "log"))
    rollback._compiled(("v0 = ()",), ("request", "log_stats=None"), ("request", "log_stats"))


def test_an_allocate_slots_without_a_request_parameter_is_left_alone():
    from vllm_kvguard.fixes.transaction.plan import unsupported_reason

    m = hybrid_manager(32)
    base = type(m)

    def allocate_slots(self, req, num_new_tokens, *args, **kwargs):
        return base.allocate_slots(self, req, num_new_tokens, *args, **kwargs)

    m.__class__ = type("Renamed", (base,), {"allocate_slots": allocate_slots})
    assert unsupported_reason(m) == "an allocate_slots without a 'request' parameter"


def test_free_queue_order_is_restored_exactly():
    """Touched eviction candidates go back behind their old neighbours, popped blocks to
    the head in pop order (not just the same set)."""
    activate()
    m, _ = cached_prefix_manager()
    req = hitting_request()
    assert m.get_computed_blocks(req)[1] == 64           # 4+4 cached blocks get touched
    order = free_ids(m)
    arm(2)                                               # the Mamba group's pop, last
    assert admit(m, req) is None
    assert free_ids(m) == order


def test_another_hookimpl_gets_the_hook_path_and_still_rolls_back():
    seen = []

    class Observer:
        from vllm_kvguard.hookspecs import hookimpl

        @hookimpl
        def kvguard_allocate_slots(self, manager, request, call):
            seen.append(request.request_id)          # observes, lets the next impl run

    activate()
    register(Observer(), "test.observer")
    try:
        m = hybrid_manager(32)
        req = make_request("r", prompt(1, 40))
        arm(2)
        assert admit(m, req) is None                  # rolled back through pluggy
        assert allocator.FAST_PATH.get(m) is None
    finally:
        unregister("test.observer")
    assert seen == ["r"]
    assert report.snapshot()["rollback"] == {"InjectedFault": 1}


@pytest.mark.parametrize("alone", [False, True], ids=["allocator", "KVGUARD=1-alone"])
@pytest.mark.parametrize("n_mamba", [1, 23])
def test_many_groups_fault_in_the_last_group_is_rolled_back(mocker, n_mamba, alone):
    """A hybrid with few attention layers splits into many KV-cache groups: 1 full
    attention + 23 Mamba groups (and the plain two-group case). The transaction has no
    group limit; ``alone``: with ``KVGUARD=1`` alone. The pool is left one block below the
    fast path's bound: the call records (there is no fault injector here)."""
    specs = [attention_spec()] + [mamba_spec(mode="align") for _ in range(n_mamba)]
    failing = ValueError("Cannot get 1 free blocks from the pool")
    activate(fix=False)
    plain = make_manager(specs, num_blocks=256, enable_caching=True)
    mocker.patch.object(groups(plain)[-1], "allocate_new_blocks", side_effect=failing)
    with pytest.raises(ValueError):               # vLLM alone: raises half-allocated
        admit(plain, make_request("r", prompt(1, 40)))
    assert any(g.req_to_blocks.get("r") for g in groups(plain)[:-1])
    activation.deactivate()
    activation.activate({"KVGUARD": "1"} if alone else {"KVGUARD": "1",
                                                       "KVGUARD_PATCHES": "allocator"})
    m = make_manager(specs, num_blocks=256, enable_caching=True)
    assert len(groups(m)) == 1 + n_mamba
    pool, bound = m.block_pool, allocator.fast_bound(m, 40)
    pool.get_new_blocks(pool.get_num_free_blocks() - bound + 1)    # below it: the call records
    mocker.patch.object(groups(m)[-1], "allocate_new_blocks", side_effect=failing)
    before = state(m)
    assert admit(m, make_request("r", prompt(1, 40))) is None   # "no room now"
    assert state_diff(before, state(m)) == []
    assert report.snapshot()["rollback"] == {"ValueError": 1}


@pytest.mark.parametrize("n_mamba", [1, 23])
def test_written_out_record_reads_what_the_undo_takes(mocker, n_mamba):
    """The record the transaction writes out per manager (Plan.reads) holds, in the undo's
    form (Plan.nest), what a loop over the groups reads: every group's cached count; per
    align group its list, length, last state index, membership; the rare dicts' values
    (the or-chain of a few dicts and the any() of many)."""
    specs = [attention_spec()] + [mamba_spec(mode="align") for _ in range(n_mamba)]
    activate()
    m = make_manager(specs, num_blocks=256, enable_caching=True)
    fix = allocator._State.fix
    plan = fix.plan_for(m)
    for i, d in enumerate(plan.cached):
        d["r"] = i + 3
    a = plan.align[-1]
    a.rtb["r"] = [m.block_pool.null_block] * 2
    a.last_state["r"] = 7
    a.members.add("r")
    plan.rare[-1]["r"] = ("rare", n_mamba)
    seen = []

    def failing(*_args, **_kwargs):
        raise ValueError("Cannot get 1 free blocks from the pool")

    mocker.patch.object(fix, "recover", lambda plan, rec, *_rest: seen.append(plan.nest(rec)))
    txn = fix.transaction(m, failing)
    txn(make_request("r", prompt(1, 40)), 40)
    cached, aligned, rare = seen[0]
    assert list(cached) == [d.get("r") for d in plan.cached]
    assert [tuple(x) for x in aligned] == [
        (x.rtb.get("r"), len(x.rtb.get("r") or ()),
         x.last_state.get("r"), "r" in x.members) for x in plan.align]
    assert aligned[-1][0] is a.rtb["r"] and aligned[-1][1] == 2
    assert list(rare) == [d.get("r") for d in plan.rare]
    plan.rare[-1].clear()
    seen.clear()
    txn(make_request("r", prompt(1, 40)), 40)
    assert seen[0][2] is None                 # all rare dicts empty: nothing read
