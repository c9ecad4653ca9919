"""EngineCore's heartbeat: per step, what it holds and how far it got (every DP rank).

After every ``Scheduler.schedule()`` (the allocator patch's ``kvguard_after_schedule``
hook) EngineCore updates one small dict in place: steps taken, the running and waiting
requests, what the head of the queue waits on when nothing was scheduled (the liveness
guard's ``waiting_cause``), the monotonic time of the step and the longest step seen with
work. The dict is offered once (``remote.offer``) when EngineCore enters its loop, so it
travels, as JSON numbers and strings, in the counters' reply the front end already fetches
through vLLM's ``collective_rpc``. No per-step allocation, lock or syscall besides one
clock read.
"""
from __future__ import annotations

import logging
import time
from collections import deque

from vllm_kvguard import remote
from vllm_kvguard.hookspecs import hookimpl
from vllm_kvguard.log import once

KEY = "heartbeat"


def new_beat() -> dict:
    return {"engine": "0", "steps": 0, "running": 0, "waiting": 0, "waits_on": "",
            "mono": 0.0, "longest_s": 0.0}


class Heartbeat:
    """The heartbeat as a hookimpl object (one per process: one EngineCore each)."""

    def __init__(self):
        self.beat = new_beat()
        self._shape = None          # (id(scheduler), len of its waiting queue, skipped?)
        self._busy = False          # the previous step had work

    @hookimpl
    def kvguard_engine_core_started(self, engine_core):
        try:
            parallel = engine_core.vllm_config.parallel_config
            self.beat["engine"] = str(getattr(parallel, "data_parallel_rank", 0) or 0)
        except AttributeError:
            pass
        remote.offer(KEY, self.beat)

    @hookimpl
    def kvguard_after_schedule(self, scheduler, output):
        try:
            beat = self.beat
            now = time.monotonic()
            if self._busy:
                gap = now - beat["mono"]
                if gap > beat["longest_s"]:
                    beat["longest_s"] = gap
            shape = self._shape
            if shape is None or shape[0] != id(scheduler):
                shape = self._shape = _shape(scheduler)
            waiting = shape[1](scheduler.waiting)
            if shape[2]:
                waiting += len(scheduler.skipped_waiting)
            running = len(scheduler.running)
            beat["steps"] += 1
            beat["mono"] = now
            beat["running"] = running
            beat["waiting"] = waiting
            self._busy = bool(running or waiting)
            if waiting and not getattr(output, "total_num_scheduled_tokens", 1):
                beat["waits_on"] = _head_cause(scheduler)
            elif beat["waits_on"]:
                beat["waits_on"] = ""
        except Exception as exc:        # fail open: the heartbeat never stops a step
            once(logging.ERROR, ("heartbeat-internal", type(exc).__name__),
                 "vllm-kvguard: internal error in the heartbeat (%s: %s); it is skipped",
                 type(exc).__name__, exc)


def _shape(scheduler) -> tuple:
    """How to count ``scheduler``'s waiting requests cheaply: vLLM's FCFS queue is a
    ``deque`` whose ``__len__`` is Python code calling ``deque.__len__`` (called here
    directly: same number); vLLM 0.27-0.29 also park requests in ``skipped_waiting``."""
    count = deque.__len__ if isinstance(scheduler.waiting, deque) else len
    return id(scheduler), count, hasattr(scheduler, "skipped_waiting")


def _head_cause(scheduler) -> str:
    """What the head of the waiting queue waits on (the liveness guard's causes)."""
    try:
        from vllm_kvguard.fixes.estimation.liveness import waiting_cause

        for queue in (scheduler.waiting, getattr(scheduler, "skipped_waiting", ())):
            for item in queue:
                return waiting_cause(scheduler, item if hasattr(item, "request_id") else item[-1])
    except Exception:       # fail open: the cause is informational
        return "unknown"
    return ""
