"""The front end's verdict on EngineCore's health, for vLLM's own ``/health``.

A frozen EngineCore cannot say it is frozen: the counters' ``collective_rpc``
(:mod:`vllm_kvguard.remote`, asked every second) is a utility call, and EngineCore runs
utility calls only between steps, on its own thread. So the front end judges by itself:

* **progress**: a reply arrived (``remote.refreshes()`` grew; a reply proves EngineCore's
  loop got between two steps) or a rank's heartbeat ``steps`` changed; a step longer than
  the RPC's timeout delays its reply to the step's end, so a long step is progress late,
  never missing;
* **work**: the front end has requests in flight (``output_processor``), or a rank's last
  heartbeat held running or waiting requests;
* **stalled**: work, and no progress for ``KVGUARD_HEALTH_STALL_S`` seconds;
* **wedged**: a rank's liveness gauge (``waiting_requests``, set only after
  ``KVGUARD_LIVENESS_STEPS`` steps with nothing running or scheduled) counts requests
  waiting for a cause no outside event clears (:data:`WEDGED_CAUSES`) and none paused,
  for :data:`WEDGE_CONFIRM_S` seconds.

A task on the front end's event loop samples this every :data:`WATCH_S` (started by the
first ``/health`` call); ``AsyncLLM.check_health`` then raises vLLM's ``EngineDeadError``
with the reason, which vLLM's route answers with 503. Data-parallel replies are gathered,
so one frozen rank stops every rank's progress: the verdict is right, the per-rank
ages then equal.
"""
from __future__ import annotations

import asyncio
import logging
import time
import weakref

from vllm_kvguard import remote
from vllm_kvguard.hookspecs import hookimpl
from vllm_kvguard.log import logger, once

WATCH_S = 0.5
WEDGE_CONFIRM_S = 5.0
#: Causes that leave the queue where it is until someone acts: vLLM's scheduler refused
#: the head with nothing running, scheduled or pending outside (KV connector, transfer,
#: grammar, streaming input, a pause are outside events: reported, never 503).
WEDGED_CAUSES = ("admission", "preempted")
KEY = "heartbeat"


class _Watch:
    """One ``AsyncLLM``'s state, sampled by :meth:`tick`."""

    def __init__(self, engine):
        self.ref = weakref.ref(engine)
        self.progress_at = time.monotonic()
        self.refreshes = remote.refreshes()
        self.steps: dict = {}           # pid -> last heartbeat steps
        self.beats: list[dict] = []     # the last heartbeats, with pid and gauges
        self.has_work = False
        self.inflight = 0
        self.wedged: dict = {}          # engine -> (cause, requests, since)
        self.reason: str | None = None
        self.task: asyncio.Task | None = None

    def tick(self, engine, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        count = remote.refreshes()
        fresh = count is not None and count != self.refreshes
        self.refreshes = count
        if count is None:       # no engine the counters are fetched from: no judgement
            self.progress_at = now
        beats = []
        for e in remote.entries():
            beat = (e.get("offers") or {}).get(KEY) if isinstance(e, dict) else None
            if isinstance(beat, dict):
                beats.append({**beat, "pid": e.get("pid"), "gauges": e.get("gauges") or {}})
        moved = False
        for beat in beats:
            if self.steps.get(beat["pid"]) != beat.get("steps"):
                moved = moved or beat["pid"] in self.steps
                self.steps[beat["pid"]] = beat.get("steps")
        if fresh or moved:
            self.progress_at = now
        self.beats = beats
        self.inflight = _inflight(engine)
        self.has_work = bool(self.inflight or any(
            int(b.get("running") or 0) + int(b.get("waiting") or 0) for b in beats))
        self._wedged(beats, now, fresh)

    def _wedged(self, beats: list[dict], now: float, fresh: bool) -> None:
        if not fresh:           # no new reply: the old one is judged already
            return
        seen = {}
        for beat in beats:
            waiting = (beat["gauges"].get("waiting_requests") or {})
            if int(waiting.get("paused") or 0):
                continue
            for cause in WEDGED_CAUSES:
                n = int(waiting.get(cause) or 0)
                if n:
                    name = str(beat.get("engine", beat["pid"]))
                    since = self.wedged.get(name, (None, 0, now))[2]
                    seen[name] = (cause, n, since)
                    break
        self.wedged = seen

    def seconds_since_step(self, now: float | None = None) -> float:
        if not self.has_work:
            return 0.0
        return max(0.0, (time.monotonic() if now is None else now) - self.progress_at)

    def judge(self, stall_s: float, now: float | None = None) -> str | None:
        now = time.monotonic() if now is None else now
        age = self.seconds_since_step(now)
        if age >= stall_s:
            held = ", ".join(f"dp{b.get('engine')}: {b.get('running')} running, "
                             f"{b.get('waiting')} waiting"
                             + (f" on {b['waits_on']}" if b.get("waits_on") else "")
                             for b in self.beats) or "no heartbeat"
            return (f"stalled: EngineCore holds work ({self.inflight} requests in flight; "
                    f"{held}) and has completed no step for {age:.0f} s "
                    f"(KVGUARD_HEALTH_STALL_S={stall_s:g})")
        for name, (cause, n, since) in sorted(self.wedged.items()):
            if now - since >= WEDGE_CONFIRM_S:
                return (f"wedged: EngineCore dp{name} has {n} requests waiting (cause: "
                        f"{cause}) with nothing running or scheduled for {now - since:.0f} s; "
                        f"it will not clear by itself")
        return None


def _inflight(engine) -> int:
    processor = getattr(engine, "output_processor", None)
    if processor is None:
        return 0
    return int(processor.get_num_unfinished_requests())


class Verdict:
    """The verdict as a hookimpl object, built with ``KVGUARD_HEALTH_STALL_S``."""

    def __init__(self, stall_s: float):
        self.stall_s = stall_s
        self.watches: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()

    @hookimpl
    def kvguard_check_health(self, engine):
        try:
            watch = self.watches.get(engine)
            if watch is None:
                watch = self.watches[engine] = _Watch(engine)
            self._start(watch)
            watch.tick(engine)
            return self._record(watch, watch.judge(self.stall_s))
        except Exception as exc:        # fail open: vLLM's own verdict stands
            once(logging.ERROR, ("health-internal", type(exc).__name__),
                 "vllm-kvguard: internal error in the health verdict (%s: %s); /health "
                 "answers as vLLM does", type(exc).__name__, exc)
            return None

    def _start(self, watch: _Watch) -> None:
        if watch.task is not None and not watch.task.done():
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        watch.task = loop.create_task(self._watch_forever(watch), name="kvguard-health")

    async def _watch_forever(self, watch: _Watch) -> None:
        engine = watch.ref()
        if engine is not None:      # the counters' refresh runs (an AsyncLLM built outside
            await remote.first_reply(engine)    # a loop starts it here): progress is seen
        del engine
        while True:
            await asyncio.sleep(WATCH_S)
            engine = watch.ref()
            if engine is None or getattr(engine, "errored", False):
                return
            try:
                watch.tick(engine)
                self._record(watch, watch.judge(self.stall_s))
            except Exception as exc:    # fail open: stop watching, /health as vLLM's
                once(logging.ERROR, ("health-watch", type(exc).__name__),
                     "vllm-kvguard: internal error in the health watch (%s: %s); it stops",
                     type(exc).__name__, exc)
                return
            del engine

    @staticmethod
    def _record(watch: _Watch, reason: str | None) -> str | None:
        """Log a change of verdict once (503 at WARNING: someone must act)."""
        if reason is not None and watch.reason is None:
            logger.warning("vllm-kvguard: /health answers 503: %s", reason)
        elif reason is None and watch.reason is not None:
            logger.info("vllm-kvguard: /health answers 200 again (EngineCore stepped)")
        watch.reason = reason
        return reason

    def close(self) -> None:
        for watch in list(self.watches.values()):
            if watch.task is not None:
                watch.task.cancel()
        self.watches.clear()


_live: list[Verdict] = []


def live() -> Verdict | None:
    """The verdict the health patch registered (None when it is not applied)."""
    return _live[0] if _live else None


def reasons() -> set[str]:
    """The kinds (``stalled``, ``wedged``) of the verdicts answering 503 now."""
    verdict = live()
    return {w.reason.split(":", 1)[0] for w in list(verdict.watches.values())
            if w.reason} if verdict else set()


def rows(now: float | None = None) -> list[dict]:
    """Per EngineCore, for ``/metrics`` and ``kvguard status``: ``engine``, ``pid``,
    ``seconds_since_step``, ``running``, ``waiting``, ``waits_on``, ``longest_s`` and
    ``wedged`` (the cause or "")."""
    verdict = live()
    out = []
    for watch in list(verdict.watches.values()) if verdict else ():
        age = watch.seconds_since_step(now)
        for beat in watch.beats:
            name = str(beat.get("engine", beat.get("pid")))
            out.append({"engine": name, "pid": beat.get("pid"), "seconds_since_step": age,
                        "running": beat.get("running", 0), "waiting": beat.get("waiting", 0),
                        "waits_on": beat.get("waits_on", ""),
                        "longest_s": beat.get("longest_s", 0.0),
                        "wedged": watch.wedged.get(name, ("",))[0]})
    return out
