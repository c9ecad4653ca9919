"""Liveness guard (fixes/liveness.py) on a REAL Scheduler.

The pool has 16 usable blocks of 16 tokens; a 400-token request needs 25, can never be
admitted and heads the waiting queue, so the small requests behind it never run either.
"""
from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import vllm.v1.core.kv_cache_manager  # noqa: E402,F401  (loaded: patches apply at once)

from vllm_kvguard.testing.kv_fixtures import make_request, make_scheduler, scheduler_step  # noqa: E402

from vllm_kvguard import activation, report  # noqa: E402
from vllm_kvguard.tools.truth_table import record_defect  # noqa: E402

STEPS = 8


def prompt(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 1000 + 3 for i in range(n)]


ERRORS: dict = {}


def finish_reasons(engine_outputs) -> dict[str, str]:
    for eco in engine_outputs.values():
        for o in eco.outputs:
            if getattr(o, "error", None) is not None:        # vLLM 0.33+: per-request error
                ERRORS[o.request_id] = o.error
    return {o.request_id: str(o.finish_reason) for eco in engine_outputs.values()
            for o in eco.outputs if o.finish_reason is not None}


def stuck_scheduler():
    sched = make_scheduler(num_gpu_blocks=17)
    sched.add_request(make_request("big", prompt(1, 400), max_tokens=4))
    for i in range(2):
        sched.add_request(make_request(f"small{i}", prompt(2 + i, 20), max_tokens=4))
    return sched


def run(sched, steps: int):
    """Step the scheduler; return (finish reasons seen, tokens scheduled per step)."""
    finished, scheduled = {}, []
    for _ in range(steps):
        out, engine_outputs = scheduler_step(sched)
        scheduled.append(out.total_num_scheduled_tokens)
        finished.update(finish_reasons(engine_outputs))
    return finished, scheduled


def test_without_the_guard_nothing_ever_progresses():
    activation.activate({"KVGUARD": "1", "KVGUARD_PATCHES": "none"})
    sched = stuck_scheduler()
    finished, scheduled = run(sched, 20 * STEPS)      # the "timeout"
    stuck = finished == {} and not any(scheduled) and len(sched.waiting) == 3
    mml = sched.vllm_config.model_config.max_model_len
    usable = sched.kv_cache_manager.block_pool.get_num_free_blocks()
    detail = (f"400-token prompt needs 25 blocks, {usable} usable: after {20 * STEPS} steps "
              f"{len(finished)} finished, {sum(scheduled)} tokens scheduled, "
              f"{len(sched.waiting)} waiting")
    record_defect("allocator", "vllm#35541", present=stuck, detail=detail)
    record_defect("allocator", "vllm#39734", present=stuck and 400 + 4 <= mml,
                  detail=f"{detail}; request within max_model_len={mml}")
    assert finished == {} and not any(scheduled)
    assert len(sched.waiting) == 3


def test_guard_finishes_the_unschedulable_head_within_bounded_steps(kvguard_log):
    activation.activate({"KVGUARD": "1", "KVGUARD_PATCHES": "allocator",
                         "KVGUARD_LIVENESS_STEPS": str(STEPS)})
    sched = stuck_scheduler()
    finished, scheduled = run(sched, STEPS)
    assert finished == {"big": "error"}
    assert not any(scheduled)
    assert "big" not in sched.requests                  # freed through finish_requests
    line = next(line for line in kvguard_log.lines() if "cannot be scheduled" in line)
    assert "request big" in line and "25 KV-cache blocks" in line
    assert "16 usable blocks" in line and "KVGUARD_LIVENESS_STEPS" in line
    assert report.snapshot()["liveness"] == {"finished_unschedulable": 1}
    if "big" in ERRORS:                                  # the client gets the message too
        assert "25 KV-cache blocks" in ERRORS["big"].message

    finished, scheduled = run(sched, 12)                 # the others proceed
    assert finished == {"small0": "length", "small1": "length"}
    assert scheduled[0] > 0


def test_guard_leaves_requests_alone_while_others_run():
    """A request that fits once a running one finishes is waited for, not failed."""
    activation.activate({"KVGUARD": "1", "KVGUARD_PATCHES": "allocator",
                         "KVGUARD_LIVENESS_STEPS": "2"})
    sched = make_scheduler(num_gpu_blocks=17)
    sched.add_request(make_request("long", prompt(1, 200), max_tokens=12))
    sched.add_request(make_request("next", prompt(2, 200), max_tokens=4))   # waits
    finished, _ = run(sched, 40)
    assert finished == {"long": "length", "next": "length"}
    assert "liveness" not in report.snapshot()
