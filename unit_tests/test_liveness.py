"""Liveness guard (fixes/liveness.py) and admission certificate on a REAL Scheduler.

The pool has 16 usable blocks of 16 tokens (256 tokens); a 400-token request needs 25,
can never be admitted and heads the waiting queue, so the small requests behind it never
run either. A request waiting on a KV connector fits and is never failed.
"""
from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import vllm.v1.core.kv_cache_manager  # noqa: E402,F401  (loaded: patches apply at once)

from vllm_kvguard.testing.kv_fixtures import make_request, make_scheduler, scheduler_step  # noqa: E402

from vllm_kvguard import activation, log, report  # noqa: E402
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


def test_guard_finishes_the_never_fitting_head_at_once(kvguard_log):
    activation.activate({"KVGUARD": "1", "KVGUARD_PATCHES": "allocator",
                         "KVGUARD_LIVENESS_STEPS": str(STEPS)})
    sched = stuck_scheduler()
    finished, scheduled = run(sched, 1)
    assert finished == {"big": "error"}
    assert not any(scheduled)
    assert "big" not in sched.requests                  # freed through finish_requests
    line = next(line for line in kvguard_log.lines() if "can never be scheduled" in line)
    assert "request big" in line and "computing token 400 holds at least 25 blocks" in line
    assert "16 usable blocks" in line and "prompt + max_tokens <= 257 tokens" in line
    assert report.snapshot()["liveness"] == {"finished_never_fits": 1}
    if "big" in ERRORS:                                  # the client gets the message too
        assert "at least 25 blocks" in ERRORS["big"].message

    finished, scheduled = run(sched, 12)                 # the others proceed
    assert finished == {"small0": "length", "small1": "length"}
    assert scheduled[0] > 0


def _activate(on: bool) -> None:
    """vLLM alone (``on=False``: nothing applied) or the allocator patch, from scratch."""
    activation.deactivate()
    log.reset_once()
    report.reset_counters()
    activation.activate({"KVGUARD": "1", "KVGUARD_PATCHES": "allocator" if on else "none"})


@pytest.mark.parametrize("max_tokens, fits", [(57, True), (58, False)])
def test_the_certificate_is_the_exact_boundary(max_tokens, fits):
    """200 prompt tokens on a 256-token pool: 57 output tokens need 256 tokens of KV (the
    last sampled token is never computed) and complete; 58 need 257, never fit, and vLLM
    alone preempts the request and can never readmit it."""
    from vllm_kvguard.fixes.estimation import certificate

    results = {}
    for on in (False, True):
        _activate(on)
        sched = make_scheduler(num_gpu_blocks=17)
        cert = certificate.of_scheduler(sched)
        assert (cert.prompt_limit, cert.total_limit, cert.usable) == (256, 257, 16)
        sched.add_request(make_request("edge", prompt(3, 200), max_tokens=max_tokens))
        finished, _ = run(sched, 3 * max_tokens)
        results[on] = finished.get("edge")
    if fits:
        assert results == {False: "length", True: "length"}
    else:
        assert results == {False: None, True: "error"}     # vLLM alone: stuck forever
        assert report.snapshot()["liveness"] == {"finished_never_fits": 1}


LOAD_STEPS = 20      # an asynchronous connector's load: the worker reports it after this


def _deferred_run(on: bool, defers: int, is_async: bool, steps: int):
    """A 32-token request; the connector defers its match ``defers`` times, then (async)
    matches 16 tokens loaded asynchronously, reported done after LOAD_STEPS more steps."""
    from vllm_kvguard.testing.connector_fixtures import make_connector_scheduler

    _activate(on)
    sched = make_connector_scheduler(defers=defers, is_async=is_async,
                                     matched_tokens=16 if is_async else 0)
    sched.add_request(make_request("0", prompt(4, 32), max_tokens=4))
    first, finished, gauged = None, {}, []
    for step in range(1, steps + 1):
        done = ["0"] if is_async and step == defers + 1 + LOAD_STEPS else None
        out, engine_outputs = scheduler_step(sched, finished_recving=done)
        if first is None and out.total_num_scheduled_tokens:
            first = step
        finished.update(finish_reasons(engine_outputs))
        if report.gauges().get("waiting_requests", {}).get("kv_connector"):
            gauged.append(step)
    return first, finished, report.snapshot(), gauged


@pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("defers", [70, 200])
def test_a_connector_deferral_is_waited_for_not_failed(kvguard_log, defers, is_async):
    steps = defers + LOAD_STEPS + 12
    plain = _deferred_run(False, defers, is_async, steps)
    first, finished, counters, gauged = _deferred_run(True, defers, is_async, steps)
    start = defers + 1 + (LOAD_STEPS + 1 if is_async else 0)
    assert (first, finished) == plain[:2] == (start, {"0": "length"})
    assert "liveness" not in counters
    assert counters["waiting"] == {"kv_connector": 1}    # reported once, at 64 steps
    # the gauge: 1 waiting on the connector from the 64th idle step until it is scheduled
    assert gauged == list(range(64, defers + 1)), (gauged[:3], gauged[-3:])
    line = next(line for line in kvguard_log.lines() if "has waited" in line)
    assert "request 0 has waited 64 scheduler steps" in line and "kv_connector" in line


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


@pytest.mark.parametrize("caching", [False, True], ids=["no-cache", "prefix-cache"])
def test_a_request_preempted_past_what_the_gate_readmits_is_ended(caching):
    """Full attention + sliding window 32 (17 usable blocks): a request decodes until the
    pool is full, preempts itself, and vLLM's gate never takes its whole sequence back:
    vLLM alone leaves it PREEMPTED forever; the guard ends it with its numbers (the
    certificate's proof without prefix caching, the fixed point with it)."""
    from vllm_kvguard.testing import sched_layouts as sl

    results = {}
    for on in (False, True):
        _activate(on)
        sched = sl.build(sl.Layout(("full", "swa"), prefix_caching=caching))
        sched.add_request(make_request("grows", prompt(5, 8), max_tokens=240))
        finished, _ = run(sched, 400)
        req = sched.requests.get("grows")
        results[on] = (finished.get("grows"), req and req.status.name)
    assert results[False] == (None, "PREEMPTED")                    # vLLM alone: stuck
    assert results[True] == ("error", None)
    assert report.snapshot()["liveness"] == {"finished_never_fits": 1}


def _priority_scheduler(num_gpu_blocks: int = 17):
    """A real ``Scheduler`` as :func:`make_scheduler` builds it, with the priority policy."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    from vllm_kvguard.tools.tiny_models import (
        BLOCK_SIZE, accepted, attention_spec, kv_cache_config, make_vllm_config)

    config = make_vllm_config(num_gpu_blocks=num_gpu_blocks)
    config.scheduler_config.policy = "priority"
    return Scheduler(**accepted(Scheduler.__init__, dict(
        vllm_config=config, kv_cache_config=kv_cache_config([attention_spec()], num_gpu_blocks),
        structured_output_manager=StructuredOutputManager(config), block_size=BLOCK_SIZE,
        log_stats=False)))


def test_the_head_of_a_priority_queue_is_the_request_it_yields_first():
    """Priority policy: the never-fitting request added last but first by priority heads
    the queue (not the one added first): it is ended at once and the other proceeds. A
    guard reading another request as the head would see one that fits, and end it at the
    fixed point instead."""
    activation.activate({"KVGUARD": "1", "KVGUARD_PATCHES": "allocator",
                         "KVGUARD_LIVENESS_STEPS": str(STEPS)})
    sched = _priority_scheduler()
    assert type(sched.waiting).__name__ == "PriorityRequestQueue"
    small = make_request("small", prompt(2, 20), max_tokens=4)
    big = make_request("big", prompt(1, 400), max_tokens=4)
    small.priority, big.priority = 1, 0
    sched.add_request(small)
    sched.add_request(big)
    assert [r.request_id for r in sched.waiting] == ["big", "small"]
    finished, scheduled = run(sched, 1)
    assert finished == {"big": "error"} and not any(scheduled)
    finished, _ = run(sched, 12)
    assert finished == {"small": "length"}
    assert report.snapshot()["liveness"] == {"finished_never_fits": 1}


def test_each_scheduler_is_watched_on_its_own():
    """Two schedulers stepped in turn, each with a request its connector defers for 70
    steps: each head is counted once as waiting after its own 64 idle steps (a watch shared
    between them would see the head change every call and never count)."""
    from vllm_kvguard.testing.connector_fixtures import make_connector_scheduler

    _activate(True)
    scheds = [make_connector_scheduler(defers=70) for _ in range(2)]
    for i, sched in enumerate(scheds):
        sched.add_request(make_request(str(i), prompt(4 + i, 32), max_tokens=4))
    first, finished = {}, {}
    for step in range(1, 81):
        for i, sched in enumerate(scheds):
            out, engine_outputs = scheduler_step(sched)
            if out.total_num_scheduled_tokens:
                first.setdefault(i, step)
            finished.update(finish_reasons(engine_outputs))
    assert first == {0: 71, 1: 71} and finished == {"0": "length", "1": "length"}
    counters = report.snapshot()
    assert counters["waiting"] == {"kv_connector": 2} and "liveness" not in counters
    assert report.gauges()["waiting_requests"]["kv_connector"] == 0
