"""Test-only fault injection into ``BlockPool.get_new_blocks`` (``KVGUARD_FAULTS``).

Deterministic per process: ``every=N`` fails the Nth, 2Nth, ... call; ``rate=P,seed=S``
fails calls at random with a seeded generator. ``after=N`` spares the first N calls,
``limit=K`` stops after K faults. The injected error is a ValueError like vLLM's own
"Cannot get N free blocks from the pool", raised before the pool changes.
"""
from __future__ import annotations

import logging
import random
import threading

from vllm_kvguard import report
from vllm_kvguard.flags import FaultSpec
from vllm_kvguard.hookspecs import hookimpl
from vllm_kvguard.log import once
from vllm_kvguard.hostcall import InjectedFault


class FaultSchedule:
    def __init__(self, spec: FaultSpec):
        self.spec = spec
        self.calls = 0
        self.fired = 0
        self._rng = random.Random(spec.seed)
        self._lock = threading.Lock()

    def should_fail(self) -> bool:
        with self._lock:
            self.calls += 1
            s = self.spec
            if self.calls <= s.after or (s.limit and self.fired >= s.limit):
                return False
            hit = (self.calls % s.every == 0) if s.every else (self._rng.random() < s.rate)
            if hit:
                self.fired += 1
            return hit


class Injector:
    """The fault injector as a hookimpl object, built with its schedule."""

    def __init__(self, spec: FaultSpec):
        self.schedule = FaultSchedule(spec)
        once(logging.WARNING, ("faults-on",),
             "vllm-kvguard: TEST-ONLY allocator fault injection is ON (KVGUARD_FAULTS: %s); "
             "BlockPool.get_new_blocks will fail on purpose", spec)

    def reset(self, spec: FaultSpec) -> None:
        self.schedule = FaultSchedule(spec)

    @hookimpl
    def kvguard_inject_fault(self, pool, num_blocks):
        sched = self.schedule
        if sched.should_fail():
            report.count("fault", "injected")      # every process's count reaches /metrics
            return InjectedFault(f"injected: Cannot get {num_blocks} free blocks from the "
                                 f"pool (vllm-kvguard fault #{sched.fired}, call {sched.calls})")
        return None
