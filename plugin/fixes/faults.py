"""Test-only fault injection (``KVGUARD_FAULTS``) at one phase.

``phase=allocator`` (the default) fails ``BlockPool.get_new_blocks`` with a ValueError
like vLLM's own "Cannot get N free blocks from the pool", raised before the pool changes;
``lookup`` / ``update`` make the scheduler-side KV connector's
``get_num_new_matched_tokens`` / ``update_state_after_alloc`` raise a RuntimeError before
the connector runs. Deterministic per process: ``every=N`` fails the Nth, 2Nth, ... call
of the phase; ``rate=P,seed=S`` fails calls at random with a seeded generator. ``after=N``
spares the first N calls, ``limit=K`` stops after K faults.
"""
from __future__ import annotations

import logging
import random
import threading

from vllm_kvguard import report
from vllm_kvguard.flags import FaultSpec
from vllm_kvguard.hookspecs import hookimpl
from vllm_kvguard.log import once
from vllm_kvguard.hostcall import InjectedConnectorFault, InjectedFault

CONNECTOR_METHODS = {"lookup": "get_num_new_matched_tokens",
                     "update": "update_state_after_alloc"}


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
        where = CONNECTOR_METHODS.get(spec.phase, "BlockPool.get_new_blocks")
        once(logging.WARNING, ("faults-on",),
             "vllm-kvguard: TEST-ONLY %s fault injection is ON (KVGUARD_FAULTS: %s); "
             "%s will fail on purpose", spec.phase, spec, where)

    def reset(self, spec: FaultSpec) -> None:
        self.schedule = FaultSchedule(spec)

    @hookimpl
    def kvguard_inject_fault(self, pool, num_blocks):
        sched = self.schedule
        if sched.spec.phase == "allocator" and sched.should_fail():
            report.count("fault", "injected")      # every process's count reaches /metrics
            return InjectedFault(f"injected: Cannot get {num_blocks} free blocks from the "
                                 f"pool (vllm-kvguard fault #{sched.fired}, call {sched.calls})")
        return None

    @hookimpl
    def kvguard_inject_connector_fault(self, connector, phase, request):
        sched = self.schedule
        if sched.spec.phase == phase and sched.should_fail():
            report.count("fault", "injected")
            return InjectedConnectorFault(
                f"injected: KV connector {CONNECTOR_METHODS[phase]} failed for request "
                f"{request.request_id} (vllm-kvguard fault #{sched.fired}, call {sched.calls})")
        return None
