"""Test-only fault injection (``KVGUARD_FAULTS``) at one phase.

``phase=allocator`` (the default) fails ``BlockPool.get_new_blocks`` with a ValueError
like vLLM's own "Cannot get N free blocks from the pool", raised before the pool changes;
``lookup`` / ``update`` make the scheduler-side KV connector's
``get_num_new_matched_tokens`` / ``update_state_after_alloc`` raise a RuntimeError before
the connector runs; ``load`` reports a request's KV load of the step failed (the last
block it loaded, in ``invalid_block_ids``), as a worker does, for vLLM's own
``kv_load_failure_policy`` to handle. A call of ``load`` is a new request scheduled with
computed tokens. ``freeze`` blocks EngineCore's step forever in
``Scheduler.update_from_output`` (a call: one step completing), as a stuck collective or
CUDA call would: the process stays up, its loop stops (``/health``'s verdict). Deterministic per process: ``every=N`` fails the Nth, 2Nth, ... call
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
from vllm_kvguard.log import logger, once
from vllm_kvguard.hostcall import InjectedConnectorFault, InjectedFault

CONNECTOR_METHODS = {"lookup": "get_num_new_matched_tokens",
                     "update": "update_state_after_alloc",
                     "load": "a KV load the worker reports",
                     "freeze": "EngineCore's step (it blocks forever)"}


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

    @hookimpl
    def kvguard_inject_freeze(self, scheduler):
        sched = self.schedule
        if sched.spec.phase != "freeze" or not sched.should_fail():
            return
        report.count("fault", "injected")
        logger.warning("vllm-kvguard: TEST-ONLY fault: EngineCore's step %d is frozen "
                       "(KVGUARD_FAULTS phase=freeze); it never returns", sched.calls)
        frozen = threading.Event()
        while not frozen.wait(1.0):     # signals still reach the thread between waits
            pass

    @hookimpl
    def kvguard_inject_load_failure(self, scheduler, scheduler_output, model_runner_output):
        sched = self.schedule
        if sched.spec.phase != "load" or getattr(scheduler, "connector", None) is None:
            return None
        block_size = scheduler.kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size
        failed = set()
        for new in scheduler_output.scheduled_new_reqs:
            if new.num_computed_tokens > 0 and sched.should_fail():
                failed.add(new.block_ids[0][(new.num_computed_tokens - 1) // block_size])
                report.count("fault", "injected")
        if not failed:
            return None
        import dataclasses

        from vllm.v1.outputs import KVConnectorOutput

        kvo = model_runner_output.kv_connector_output or KVConnectorOutput()
        kvo = dataclasses.replace(kvo, invalid_block_ids=set(kvo.invalid_block_ids) | failed)
        return dataclasses.replace(model_runner_output, kv_connector_output=kvo)
