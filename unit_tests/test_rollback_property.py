"""Property test: random scheduler-like traffic with faults on the REAL KVCacheManager.

Hybrid groups (full attention + Mamba; align mode with prefix caching, ``none`` without),
prefix caching on and off, 0-4 lookahead tokens, Mamba speculative blocks, tiny pools.
Operations: admit (prefix hits from a few shared prompt families, sometimes external
tokens), decode step of every running request, preempt, finish, readmit a preempted one.
Faults, armed on three quarters of the allocating operations until one fires: the n-th
``BlockPool.get_new_blocks`` of the operation (the project's injector, patches/faults.py),
or any allocation phase of one group (the phase runs, then raises; unittest.mock on that
manager instance).

After every operation the audit holds (fixes/audit.py: no leaked block, ref counts equal
holders, no waiting request holding blocks ...); every call a fault hit returned None and
left the state exactly as before (the prefix cache may only forget hashes); at the end,
with every request freed, the free count equals the start. The same property without the
fix fails (``test_property_fails_without_the_fix``).
"""
from __future__ import annotations

from unittest import mock

import pytest

pytest.importorskip("vllm")

import vllm.v1.core.kv_cache_manager  # noqa: E402,F401  (loaded: patches apply at once)

from hypothesis import HealthCheck, Phase, event, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from vllm_kvguard.testing.kv_fixtures import (groups, hybrid_manager, make_request, settle,  # noqa: E402
                         state, state_diff)

from vllm_kvguard import activation, hostcall, log, report  # noqa: E402
from vllm_kvguard.fixes.transaction.audit import audit_manager  # noqa: E402
from vllm_kvguard.flags import FaultSpec  # noqa: E402
from vllm_kvguard.hostcall import InjectedFault  # noqa: E402
from vllm_kvguard.patches import faults as fault_patch  # noqa: E402

EXAMPLES = int(__import__("os").environ.get("KVGUARD_TEST_EXAMPLES", "500"))
PHASES = ("add_local_computed_blocks", "allocate_external_computed_blocks",
          "allocate_new_blocks", "cache_blocks")
NEVER = FaultSpec(every=1, after=10**12)
FAMILIES = [[(f * 7919 + i * 31) % 997 + 3 for i in range(120)] for f in range(3)]


class PhaseFault(RuntimeError):
    """Raised after an allocation phase of one group ran (injected)."""


# ------------------------------------------------------------------------- scenarios
fault_st = st.one_of(
    st.none(),
    st.tuples(st.just("pool"), st.integers(1, 2)),
    st.tuples(st.just("pool"), st.just(1)),
    st.tuples(st.sampled_from(PHASES), st.integers(0, 1)),
)
op_st = st.one_of(
    st.tuples(st.just("admit"), st.integers(0, 2), st.integers(1, 72), st.integers(0, 2),
              fault_st),
    st.tuples(st.just("step"), fault_st),
    st.tuples(st.just("step"), fault_st),
    st.tuples(st.just("preempt"), st.integers(0, 7)),
    st.tuples(st.just("finish"), st.integers(0, 7)),
    st.tuples(st.just("readmit"), st.integers(0, 7), fault_st),
)


@st.composite
def scenarios(draw):
    caching = draw(st.booleans())
    lookahead = draw(st.integers(0, 4))
    bs = draw(st.sampled_from([4, 16]))
    first = [("admit", f, draw(st.integers(8, 60)), 0, None) for f in range(draw(
        st.integers(1, 2)))]                     # something to run and to hit on
    return dict(caching=caching, lookahead=lookahead,
                nsb=draw(st.sampled_from(sorted({0, min(lookahead, 2)}))), bs=bs,
                num_blocks=draw(st.integers(12, 40)) * (16 // bs),
                ops=first + draw(st.lists(op_st, min_size=3, max_size=16)))


# ------------------------------------------------------------------------- the harness
class Harness:
    """Drives one manager like the scheduler does and checks every call (also the fast
    path's bound test's traffic: ``manager`` given, no faults, no injector needed)."""

    def __init__(self, sc, fixed: bool, manager=None):
        self.sc, self.fixed = sc, fixed
        self.m = manager or hybrid_manager(sc["num_blocks"], enable_caching=sc["caching"],
                                           nsb=sc["nsb"], block_size=sc["bs"],
                                           max_model_len=512)
        self.start_free = self.m.block_pool.get_num_free_blocks()
        self.running: list = []
        self.waiting: list = []
        self.n = 0
        self.rolled_back = 0
        self.fault = None

    # one allocate_slots call, with the operation's fault (until it fires) armed around it
    def allocate(self, req, num_new, **kw):
        fault, armed = self.fault, None
        if fault is not None:
            kind, arg = fault
            if kind == "pool":
                fault_patch.injector().reset(FaultSpec(every=arg, limit=1))
            else:
                mgr = groups(self.m)[arg]
                original = getattr(mgr, kind)

                def run_then_raise(*a, _orig=original, **k):
                    _orig(*a, **k)
                    raise PhaseFault(f"after {kind} in group {arg}")

                armed = mock.patch.object(mgr, kind, side_effect=run_then_raise)
                armed_mock = armed.start()
        if fault is not None:
            if req.num_computed_tokens:
                settle(self.m, req)        # what the call keeps, as vLLM's "no room" does
            before = state(self.m)
        hit = False
        try:
            out = self.m.allocate_slots(req, num_new, num_lookahead_tokens=self.sc["lookahead"],
                                        **kw)
            if fault is not None:
                hit = bool(fault_patch.injector().schedule.fired) if armed is None else armed_mock.called
        except (InjectedFault, PhaseFault, ValueError, AssertionError) as exc:
            if self.fixed:
                raise AssertionError(f"the fix let {type(exc).__name__}: {exc} escape") from exc
            out = None                    # what an engine with fault tolerance would do
        finally:
            if armed is not None:
                armed.stop()
            if fault is not None:
                fault_patch.injector().reset(NEVER)
        if hit:
            self.fault = None             # one fault per operation
            assert out is None, "a failed allocation must return None"
            diff = state_diff(before, state(self.m))
            assert diff == [], diff
            self.rolled_back += 1
        return out

    def admit(self, req, external=0):
        """The waiting loop: local hit (+ external tokens), the prompt up to its last block
        boundary, then (next step, as a running request) the rest. Mamba align caches a
        reusable state only at such a boundary."""
        self.m.new_step_starts()
        blocks, hit, _ = self.m.get_computed_blocks(req)
        external = min(external, max(req.num_tokens - 1 - hit, 0))
        start, total = hit + external, req.num_tokens
        cut = (total - 1) // self.sc["bs"] * self.sc["bs"]
        end = cut if start < cut else total
        out = self.allocate(req, end - start, num_new_computed_tokens=hit,
                            new_computed_blocks=blocks, num_external_computed_tokens=external)
        if out is None:
            self.waiting.append(req)
            return
        req.num_computed_tokens = end
        self.running.append(req)
        if end < total:
            self.m.new_step_starts()
            if self.allocate(req, total - end) is None:
                self.preempt(req)
                return
            req.num_computed_tokens = total

    def step(self):
        self.m.new_step_starts()
        for req in list(self.running):
            req.append_output_token_ids(FAMILIES[0][len(req.output_token_ids) % 100])
            if self.allocate(req, 1) is None:
                self.preempt(req)                # the scheduler preempts on "no room"
            else:
                req.num_computed_tokens += 1

    def preempt(self, req):
        self.running.remove(req)
        self.m.free(req)
        req.num_computed_tokens = 0
        self.waiting.append(req)

    def run_op(self, op):
        kind = op[0]
        self.fault = op[-1] if kind in ("admit", "step", "readmit") else None
        if kind == "admit":
            _, family, length, ext_blocks, _ = op
            self.n += 1
            prompt = FAMILIES[family][:length] + [1000 + self.n]
            req = make_request(f"r{self.n}", prompt, block_size=self.sc["bs"])
            self.admit(req, external=ext_blocks * self.sc["bs"])
        elif kind == "step":
            self.step()
        elif kind in ("preempt", "finish") and self.running:
            req = self.running[op[1] % len(self.running)]
            self.preempt(req)
            if kind == "finish":
                self.waiting.remove(req)
        elif kind == "readmit" and self.waiting:
            req = self.waiting.pop(op[1] % len(self.waiting))
            self.admit(req)

    def check(self):
        live = {r.request_id for r in self.running + self.waiting}
        result = audit_manager(self.m, known_requests=live,
                               idle_requests={r.request_id for r in self.waiting})
        assert result.ok, result.summary()

    def finish_all(self):
        for req in list(self.running):
            self.preempt(req)
        self.waiting.clear()
        result = audit_manager(self.m, known_requests=set())
        assert result.ok and result.leaked == 0, result.summary()
        assert self.m.block_pool.get_num_free_blocks() == self.start_free


def run_scenario(sc, fixed: bool) -> int:
    activation.deactivate()
    log.reset_once()
    hostcall.reset_tripped()
    activation.activate({"KVGUARD": "1", "KVGUARD_PATCHES": "allocator" if fixed else "none",
                         "KVGUARD_FAULTS": "every=1,after=1000000000000"})
    fault_patch.injector().reset(NEVER)
    h = Harness(sc, fixed)
    for op in sc["ops"]:
        h.run_op(op)
        h.check()
    h.finish_all()
    return h.rolled_back


PROPERTY = settings(max_examples=EXAMPLES, deadline=None, database=None,
                    suppress_health_check=list(HealthCheck))


@PROPERTY
@given(sc=scenarios())
def test_allocation_is_transactional_under_random_faults(sc):
    rolled_back = run_scenario(sc, fixed=True)
    event(f"rollbacks: {min(rolled_back, 3)}{'+' if rolled_back > 3 else ''}")
    event(f"prefix caching {'on' if sc['caching'] else 'off'}, lookahead {sc['lookahead']}")


def test_the_property_exercises_rollbacks():
    """Guard against a vacuous property: a fixed scenario whose faults do fire."""
    sc = dict(caching=True, lookahead=2, nsb=2, bs=4, num_blocks=30, ops=[
        ("admit", 0, 40, 0, None), ("admit", 0, 50, 1, ("pool", 2)),
        ("step", ("cache_blocks", 0)), ("step", ("allocate_new_blocks", 1)),
        ("admit", 1, 30, 0, ("add_local_computed_blocks", 1)), ("step", ("pool", 1)),
        ("readmit", 0, ("pool", 1)), ("step", None), ("finish", 0)])
    assert run_scenario(sc, fixed=True) >= 2
    assert report.snapshot()["rollback"]


def test_property_fails_without_the_fix():
    """The same property with KVGUARD_PATCHES=none: faults leave half-done allocations the
    audit catches (or break the run), and hypothesis finds such a scenario."""

    @settings(max_examples=200, deadline=None, database=None, derandomize=True,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(scenarios())
    def unfixed(sc):
        run_scenario(sc, fixed=False)

    with pytest.raises(AssertionError, match="waiting_request_holds_blocks|leaked|ref_mismatch"):
        unfixed()
