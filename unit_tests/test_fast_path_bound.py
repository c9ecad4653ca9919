"""The fast path's bound (fixes/transaction/plan.py ``fast_bound``) is never below what an
``allocate_slots`` call takes, on the REAL allocator, on every layout.

A call that runs without a record is safe only if the pool's free count covers all it can
take: the blocks ``get_new_blocks`` pops plus the prefix hits it touches off the free queue,
over every group. Each call below goes through the installed transaction; the pool journal
then holds that call's pops and touches, and their count must be <= ``Plan.bound`` of the
call's own arguments. Traffic: hypothesis on a manager of random groups (full, sliding
window, chunked local, MLA, Mamba none/align with speculative blocks, several groups,
prefix caching, lookahead, external tokens), and vLLM's real ``Scheduler`` stepped on
:mod:`vllm_kvguard.testing.sched_layouts` layouts (drafts, prefix caching, tiny pools).
"""
from __future__ import annotations

import inspect

import pytest

pytest.importorskip("vllm")

import vllm.v1.core.kv_cache_manager  # noqa: E402,F401  (loaded: patches apply at once)

from hypothesis import HealthCheck, event, given, reject, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from vllm_kvguard import activation, report  # noqa: E402
from vllm_kvguard.fixes.transaction.journal import TOUCH, popped  # noqa: E402
from vllm_kvguard.patches import allocator  # noqa: E402
from vllm_kvguard.testing import kv_fixtures as kf  # noqa: E402
from vllm_kvguard.testing import sched_layouts as sl  # noqa: E402

from test_rollback_property import Harness  # noqa: E402  (unit_tests/, beside this file)

EXAMPLES = int(__import__("os").environ.get("KVGUARD_TEST_EXAMPLES", "300"))
FAMILIES = [[(f * 7919 + i * 31) % 997 + 3 for i in range(160)] for f in range(2)]

pytestmark = pytest.mark.requires_patch("allocator")


def activate():
    """The allocator fix alone: no fault injector, so calls with room take the fast path."""
    activation.deactivate()
    activation.activate({"KVGUARD": "1", "KVGUARD_PATCHES": "allocator"})
    assert allocator._State.fix.fast


def takes(log) -> int:
    """Blocks one call took out of the free queue: popped, or touched at ref count 0."""
    touched = sum(1 for e in log if type(e) is tuple and e[0] == TOUCH
                  for b, (ref, _prev) in zip(e[1], e[2]) if ref == 0 and not b.is_null)
    return len(popped(log)) + touched


class Measured:
    """``manager``'s installed transaction, each call checked against its bound."""

    def __init__(self, manager):
        fix = allocator._State.fix
        self.plan = fix.plan_for(manager)
        assert self.plan is not None and self.plan.fast is not None
        vllm = type(manager).allocate_slots.__wrapped__
        self.sig = inspect.signature(vllm)
        self.txn = fix.transaction(manager, vllm.__get__(manager))
        self.manager, self.calls, self.fast, self.worst = manager, 0, 0, 0.0
        manager.allocate_slots = self          # what the scheduler calls from now on

    def __call__(self, *args, **kwargs):
        bound_args = self.sig.bind(self.manager, *args, **kwargs)
        bound_args.apply_defaults()
        tokens = sum(bound_args.arguments[t] for t in self.plan.fast[0])
        bound = self.plan.bound(tokens)
        free = self.manager.block_pool.get_num_free_blocks()
        out = self.txn(*args, **kwargs)
        took = takes(self.plan.journal.log)
        assert took <= bound, (f"call took {took} blocks, bound {bound} ({tokens} tokens, "
                               f"{bound_args.arguments})")
        big = self.plan.big                     # any call's bound: no call takes more
        assert big is None or took <= big, f"call took {took} blocks, any call's bound {big}"
        self.calls += 1
        self.fast += free >= bound
        self.worst = max(self.worst, took / bound)
        return out


# ------------------------------------------------------------------------- one manager
KINDS = ("full", "swa", "chunked", "mla", "mamba")


@st.composite
def layouts(draw):
    caching = draw(st.booleans())
    bs = draw(st.sampled_from([4, 16]))
    kinds = [draw(st.sampled_from(["full", "mla"]))] + draw(
        st.lists(st.sampled_from(KINDS), max_size=2))
    mode = "align" if caching else draw(st.sampled_from(["none", "align"]))
    return dict(caching=caching, bs=bs, kinds=kinds, mode=mode,
                window=bs * draw(st.integers(1, 4)), nsb=draw(st.integers(0, 2)),
                lookahead=draw(st.integers(0, 4)),
                num_blocks=draw(st.integers(10, 60)) * (16 // bs))


op_st = st.one_of(
    st.tuples(st.just("admit"), st.integers(0, 2), st.integers(1, 119), st.integers(0, 3),
              st.none()),
    st.tuples(st.just("step"), st.none()), st.tuples(st.just("step"), st.none()),
    st.tuples(st.just("preempt"), st.integers(0, 7)),
    st.tuples(st.just("finish"), st.integers(0, 7)),
    st.tuples(st.just("readmit"), st.integers(0, 7), st.none()),
)


def build_manager(lay):
    specs = []
    for kind in lay["kinds"]:
        if kind == "mamba":
            specs.append(kf.mamba_spec(lay["bs"], lay["mode"], lay["nsb"]))
        else:
            specs.append(sl.specs(sl.Layout(groups=(kind,), block_size=lay["bs"],
                                            window=lay["window"]))[0])
    return kf.make_manager(specs, num_blocks=lay["num_blocks"], max_model_len=512,
                           enable_caching=lay["caching"])


@settings(max_examples=EXAMPLES, deadline=None, database=None,
          suppress_health_check=list(HealthCheck))
@given(lay=layouts(), ops=st.lists(op_st, min_size=4, max_size=24))
def test_no_call_takes_more_than_its_bound_on_any_manager(lay, ops):
    activate()
    try:
        m = build_manager(lay)
    except (AssertionError, ValueError, NotImplementedError, TypeError, sl.Unsupported):
        reject()                            # a combination this vLLM refuses to build
    measured = Measured(m)
    harness = Harness(lay, fixed=True, manager=m)        # the rollback property's traffic
    for op in [("admit", 0, 40, 0, None)] + ops:
        harness.run_op(op)      # no audit: vLLM 0.27.1 alone miscounts its free queue here
    assert "fast_path_fault" not in report.snapshot()
    event(f"{'+'.join(lay['kinds'])}: {measured.fast}/{measured.calls} calls with room")
    event(f"took up to {min(int(measured.worst * 4), 3) * 25}-"
          f"{min(int(measured.worst * 4), 3) * 25 + 25}% of the bound")


# ------------------------------------------------------------------------- real scheduler
LAYOUTS = [
    sl.Layout(("full",)), sl.Layout(("full",), prefix_caching=True, num_blocks=40),
    sl.Layout(("swa",), window=32), sl.Layout(("chunked",), window=32),
    sl.Layout(("mla",), prefix_caching=True), sl.Layout(("full", "swa"), num_blocks=40),
    sl.Layout(("full", "mamba"), mamba_mode="none", num_blocks=30),
    sl.Layout(("full", "mamba"), mamba_mode="align", prefix_caching=True, num_blocks=40),
    sl.Layout(("full",), spec="ngram:3", prefix_caching=True, num_blocks=30),
    sl.Layout(("full",), spec="draft_model:2", num_blocks=40),
    sl.Layout(("full", "swa"), spec="draft_model:2", prefix_caching=True, num_blocks=60),
    sl.Layout(("full",), prefix_caching=True, num_blocks=40, async_sched=True),
]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: lay.name)
def test_no_scheduler_call_takes_more_than_its_bound(layout):
    """Six requests over shared prompt families through vLLM's own schedule and
    update_from_output until all finish: every allocate_slots call within its bound."""
    activate()
    try:
        sched = sl.build(layout)
    except sl.Unsupported as exc:
        pytest.skip(str(exc))
    measured = Measured(sched.kv_cache_manager)
    for i in range(6):
        prompt = FAMILIES[i % 2][:40 + 23 * i] + [2000 + i]
        sched.add_request(kf.make_request(f"q{i}", prompt[:layout.max_model_len - 40],
                                          block_size=layout.block_size, max_tokens=24))
    for _ in range(400):
        if not sched.requests:
            break
        kf.scheduler_step(sched, sample_token=5)
    assert not sched.requests, "the traffic did not finish"
    assert measured.calls > 6 and measured.fast > 0
    assert "fast_path_fault" not in report.snapshot()
