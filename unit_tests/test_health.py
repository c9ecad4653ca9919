"""Health that tells the truth (patches/health.py, fixes/health/): EngineCore's heartbeat
on a REAL Scheduler, the front end's verdict on it, and vLLM's own ``/health`` route and
``AsyncLLM.check_health`` answering 503 through the patch.

The verdict's inputs are what the front end really has: the counters' reply count
(``remote.refreshes()``), the replies (``remote.entries()``) and the requests in flight.
A frozen EngineCore is simulated by replies that stop (the fault); time is passed in.
"""
from __future__ import annotations

import asyncio
import types

import pytest

pytest.importorskip("vllm")

import vllm.v1.core.kv_cache_manager  # noqa: E402,F401  (loaded: patches apply at once)
import vllm.v1.core.sched.scheduler  # noqa: E402,F401

from vllm_kvguard import activation, metrics, remote  # noqa: E402
from vllm_kvguard.fixes.health import heartbeat, verdict  # noqa: E402
from vllm_kvguard.manager import get_plugin_manager  # noqa: E402
from vllm_kvguard.testing.kv_fixtures import (  # noqa: E402
    make_request, make_scheduler, make_vllm_config, scheduler_step)

STALL = 30.0


def _async_llm():
    try:
        from vllm.v1.engine.async_llm import AsyncLLM
    except Exception as exc:        # a build whose front end does not import here
        pytest.skip(f"vllm.v1.engine.async_llm does not import here: {exc}")
    return AsyncLLM


def _beat() -> heartbeat.Heartbeat:
    return get_plugin_manager().get_plugin("kvguard.heartbeat")


def test_heartbeat_counts_steps_and_what_the_engine_holds_on_a_real_scheduler():
    try:
        import vllm.v1.engine.core  # noqa: F401  (EngineCore's module: the patch sets up)
    except Exception as exc:
        pytest.skip(f"vllm.v1.engine.core does not import here: {exc}")
    activation.activate({"KVGUARD": "1"})
    beat = _beat()
    assert beat is not None, "the health patch registers the heartbeat"
    beat.kvguard_engine_core_started(engine_core=types.SimpleNamespace(
        vllm_config=make_vllm_config(num_gpu_blocks=64)))
    sched = make_scheduler(num_gpu_blocks=64, max_num_seqs=2)
    for i in range(4):
        sched.add_request(make_request(f"r{i}", list(range(3, 40)), max_tokens=4))
    before = beat.beat["steps"]
    for n in range(1, 4):
        scheduler_step(sched)
        assert beat.beat["steps"] == before + n
    assert beat.beat["running"] == 2 and beat.beat["waiting"] == 2
    assert beat.beat["waits_on"] == ""          # something was scheduled
    assert beat.beat["longest_s"] > 0.0
    offered = remote.entry()["offers"][heartbeat.KEY]
    assert offered["engine"] == "0" and offered["steps"] == beat.beat["steps"]


class _Engine:
    """The front end as the verdict reads it: requests in flight."""

    def __init__(self, inflight: int = 0):
        self.inflight = inflight
        self.output_processor = types.SimpleNamespace(
            get_num_unfinished_requests=lambda: self.inflight)


class _Replies:
    """EngineCore's answers as the front end caches them (the fault: they stop)."""

    def __init__(self, monkeypatch):
        self.count, self.beat, self.gauges = 0, heartbeat.new_beat(), {}
        monkeypatch.setattr(remote, "refreshes", lambda: self.count)
        monkeypatch.setattr(remote, "entries", lambda: [
            {"pid": 7, "offers": {heartbeat.KEY: dict(self.beat)}, "gauges": self.gauges}])

    def answer(self, steps: int = 0, running: int = 0, waiting: int = 0, **gauges):
        self.count += 1
        self.beat.update(steps=self.beat["steps"] + steps, running=running, waiting=waiting)
        self.gauges = {"waiting_requests": gauges} if gauges else {}


def _run(watch, engine, replies, seconds: float, every: float = 1.0, **answer):
    """Tick for ``seconds`` (answers each second when ``answer`` is given); the verdicts."""
    out, t = [], watch.progress_at
    while t < watch.progress_at + seconds if not answer else len(out) < seconds / every:
        t += every
        if answer:
            replies.answer(**answer)
        watch.tick(engine, now=t)
        out.append(watch.judge(STALL, now=t))
    return out


def test_idle_and_saturated_engines_stay_healthy(monkeypatch):
    replies = _Replies(monkeypatch)
    idle = _Engine(0)
    watch = verdict._Watch(idle)
    assert _run(watch, idle, replies, 10 * STALL) == [None] * int(10 * STALL)
    busy = _Engine(64)
    watch = verdict._Watch(busy)
    got = _run(watch, busy, replies, 10 * STALL, steps=3, running=16, waiting=48)
    assert set(got) == {None}
    assert watch.seconds_since_step(now=watch.progress_at) == 0.0


def test_a_step_longer_than_the_rpc_timeout_but_under_the_threshold_is_not_a_stall(monkeypatch):
    replies = _Replies(monkeypatch)
    engine = _Engine(4)
    watch = verdict._Watch(engine)
    t0 = watch.progress_at
    for t in range(1, int(STALL) - 2):          # one long step: no reply meanwhile
        watch.tick(engine, now=t0 + t)
        assert watch.judge(STALL, now=t0 + t) is None
    replies.answer(steps=1, running=4)          # the step ended: the queued call answers
    watch.tick(engine, now=t0 + STALL)
    assert watch.judge(STALL, now=t0 + STALL) is None


def test_a_frozen_engine_with_work_is_stalled_after_the_threshold(monkeypatch):
    replies = _Replies(monkeypatch)
    engine = _Engine(0)
    watch = verdict._Watch(engine)
    replies.answer()                            # idle, answering
    t0 = watch.progress_at + 1
    watch.tick(engine, now=t0)
    engine.inflight = 3                         # a request arrives; the step freezes
    watch.tick(engine, now=t0 + STALL - 1)
    assert watch.judge(STALL, now=t0 + STALL - 1) is None
    watch.tick(engine, now=t0 + STALL)
    reason = watch.judge(STALL, now=t0 + STALL)
    assert reason.startswith("stalled:") and "3 requests in flight" in reason
    assert "KVGUARD_HEALTH_STALL_S=30" in reason
    replies.answer(steps=1, running=3)          # it moves again: healthy at once
    watch.tick(engine, now=t0 + STALL + 1)
    assert watch.judge(STALL, now=t0 + STALL + 1) is None


@pytest.mark.parametrize("cause,wedged", [("admission", True), ("preempted", True),
                                          ("kv_connector", False), ("remote_kv", False),
                                          ("paused", False)])
def test_a_wedged_queue_is_unhealthy_only_for_a_cause_that_does_not_clear(monkeypatch,
                                                                          cause, wedged):
    replies = _Replies(monkeypatch)
    engine = _Engine(2)
    watch = verdict._Watch(engine)
    t = watch.progress_at
    reasons = []
    for _ in range(int(verdict.WEDGE_CONFIRM_S) + 2):
        t += 1
        replies.answer(steps=100, waiting=2, **{cause: 2})
        watch.tick(engine, now=t)
        reasons.append(watch.judge(STALL, now=t))
    assert reasons[0] is None                   # confirmed over WEDGE_CONFIRM_S, not at once
    if wedged:
        assert reasons[-1].startswith("wedged:") and f"cause: {cause}" in reasons[-1]
    else:
        assert reasons[-1] is None


def test_vllm_health_route_answers_503_with_the_plugin_and_200_without(monkeypatch,
                                                                        kvguard_log):
    AsyncLLM = _async_llm()
    from vllm.entrypoints.serve.instrumentator.health import health

    replies = _Replies(monkeypatch)
    engine = AsyncLLM.__new__(AsyncLLM)         # vLLM's class; only what check_health reads
    engine.output_handler = None
    engine.engine_core = types.SimpleNamespace(resources=types.SimpleNamespace(
        engine_dead=False), shutdown=lambda **_: None)
    engine.output_processor = _Engine(5).output_processor
    request = types.SimpleNamespace(app=types.SimpleNamespace(
        state=types.SimpleNamespace(engine_client=engine)))

    async def probe():
        return (await health(request)).status_code

    assert asyncio.run(probe()) == 200          # plugin off: vLLM alone
    activation.activate({"KVGUARD": "1", "KVGUARD_HEALTH_STALL_S": str(STALL)})
    assert asyncio.run(probe()) == 200          # the watch starts, healthy
    watch = verdict.live().watches[engine]
    watch.progress_at -= STALL + 1              # no reply since (replies.count unchanged)
    assert asyncio.run(probe()) == 503
    assert any("/health answers 503: stalled" in line for line in kvguard_log.lines())
    families = {f.name: f for f in metrics.health_families()}
    assert families["kvguard_health_unhealthy"].samples[0].labels == {"reason": "stalled"}
    assert families["kvguard_health_unhealthy"].samples[0].value == 1.0
    assert families["kvguard_seconds_since_step"].samples[0].value > STALL
    replies.answer(steps=1, running=5)
    assert asyncio.run(probe()) == 200
    activation.deactivate()
    watch.progress_at -= 10 * STALL
    assert asyncio.run(probe()) == 200          # reverted: vLLM's own answer again


def test_status_prints_one_line_per_engine_core_and_the_verdict():
    from vllm_kvguard.tools.cli import format_health, parse_metrics

    text = "\n".join([
        'kvguard_seconds_since_step{engine="0"} 42.5',
        'kvguard_longest_step_seconds{engine="0"} 0.25',
        'kvguard_engine_wedged{engine="0",cause="admission"} 0',
        'kvguard_health_unhealthy{reason="stalled"} 1',
        'kvguard_health_unhealthy{reason="wedged"} 0'])
    lines = format_health(parse_metrics(text))
    assert lines == ["EngineCore dp0: 42.5 s holding work without a step, longest step "
                     "0.25 s, wedged: no", "/health: 503 (stalled)"]


def test_the_heartbeat_names_what_the_head_waits_on_while_nothing_is_scheduled():
    """A request its KV connector defers for 3 steps, on a REAL Scheduler: the beat names
    the cause while nothing is scheduled, clears it once the request runs, and counts what
    the scheduler holds at every step (the hookimpl called directly, as vLLM's hook does)."""
    from vllm_kvguard.testing.connector_fixtures import make_connector_scheduler

    beat = heartbeat.Heartbeat()
    sched = make_connector_scheduler(defers=3)
    sched.add_request(make_request("r0", list(range(3, 40)), max_tokens=4))
    seen = []
    for _ in range(5):
        out, _ = scheduler_step(sched)
        beat.kvguard_after_schedule(sched, out)
        b = beat.beat
        seen.append((b["steps"], b["running"], b["waiting"], b["waits_on"]))
    assert seen == [(1, 0, 1, "kv_connector"), (2, 0, 1, "kv_connector"),
                    (3, 0, 1, "kv_connector"), (4, 1, 0, ""), (5, 1, 0, "")]
    assert beat.beat["longest_s"] > 0.0 and beat.beat["mono"] > 0.0
    assert set(beat.beat) == set(heartbeat.new_beat())
