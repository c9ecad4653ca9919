"""Liveness guard: a request that can never run is finished at once; one that waits is not.

vLLM admits a waiting request only when its blocks fit, so a request that can never fit
heads the waiting queue forever and the requests behind it starve (vllm#35541, #39734,
#53130). After every ``Scheduler.schedule()`` this guard looks at the head of the waiting
queue and acts on proof only, finishing it with ``FINISHED_ERROR`` through the
scheduler's own error path (the client gets ``finish_reason="error"``, and on vLLM 0.33+
the message) and logging its numbers. Two proofs:

* the certificate (:meth:`~vllm_kvguard.fixes.estimation.certificate.Certificate.never`):
  its sequence can never be held, or vLLM's admission gate can never take it again (a
  request preempted after growing past the prompt limit), where no prefix hit can help;
* a fixed point: nothing runs, no block is held, nothing is scheduled and no outside
  event is pending (no KV connector, not paused, a plain WAITING or PREEMPTED head) for
  ``KVGUARD_LIVENESS_STEPS`` steps: vLLM's own scheduler refused the head with the whole
  pool free, and the next step sees the same state.

Everything else waits, however long: a KV connector deferring its match, remote KV
transfers, grammar compilation, streaming input, a paused scheduler, preemption, or
vLLM's own admission rule. A head that has not moved for ``KVGUARD_LIVENESS_STEPS``
(default 64) steps with nothing scheduled is reported, not failed: one warning per cause
with the request id and the steps waited, the ``waiting`` counter per cause, and while it
lasts the ``waiting_requests`` gauge: the waiting requests by cause.
"""
from __future__ import annotations

import logging
import weakref

from vllm_kvguard import report
from vllm_kvguard.fixes.estimation import certificate
from vllm_kvguard.fixes.request_errors import fail_request
from vllm_kvguard.hookspecs import hookimpl
from vllm_kvguard.log import logger, once


CAUSES = ("remote_kv", "grammar", "streaming_input", "paused", "kv_connector",
          "kv_transfer", "preempted", "admission")
GAUGE = "waiting_requests"


class _Watch:
    __slots__ = ("head", "tokens", "steps", "reported", "gauged")

    def __init__(self):
        self.head = None
        self.tokens = -1
        self.steps = 0
        self.reported = False
        self.gauged = False


# Per scheduler, while its waiting queue is not empty (nothing on the Scheduler itself:
# reading its __dict__ would make CPython 3.11 materialise it and slow every attribute).
_watches: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _waiting(scheduler):
    """The waiting requests, then ``skipped_waiting`` (vLLM 0.27-0.29 park deferred and
    blocked requests there); priority queues hold ``(priority, ..., request)`` items."""
    for queue in (scheduler.waiting, getattr(scheduler, "skipped_waiting", ())):
        for item in queue:
            yield item if hasattr(item, "request_id") else item[-1]


def _first(scheduler):
    return next(_waiting(scheduler), None)


def _gauge(scheduler=None) -> None:
    """Set the gauge from ``scheduler``'s waiting requests (None: all causes at 0)."""
    values = dict.fromkeys(CAUSES, 0)
    if scheduler is not None:
        for request in _waiting(scheduler):
            cause = waiting_cause(scheduler, request)
            values[cause] = values.get(cause, 0) + 1
    report.set_gauge(GAUGE, values)


def waiting_cause(scheduler, request) -> str:
    """Why ``request`` (waiting, able to fit) is not scheduled yet, as a short cause."""
    status = getattr(request.status, "name", str(request.status))
    by_status = {"WAITING_FOR_REMOTE_KVS": "remote_kv",
                 "WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR": "grammar",
                 "WAITING_FOR_FSM": "grammar",
                 "WAITING_FOR_STREAMING_REQ": "streaming_input"}
    if status in by_status:
        return by_status[status]
    pause = getattr(scheduler, "_pause_state", None)
    if pause is not None and getattr(pause, "name", "UNPAUSED") != "UNPAUSED":
        return "paused"
    if getattr(scheduler, "connector", None) is not None:
        return "kv_connector"
    if getattr(scheduler, "kv_holding_waiting", None) or getattr(
            scheduler, "deferred_frees", None):
        return "kv_transfer"
    if status == "PREEMPTED":
        return "preempted"
    return "admission"


def _finish(scheduler, request, message: str) -> None:
    how = fail_request(scheduler, request.request_id, message, "kv_cache_capacity")
    report.count("liveness", "finished_never_fits")
    logger.error("%s [%s]", message, how)
    once(logging.INFO, ("liveness-first",),
         "vllm-kvguard: liveness guard acted; counter 'liveness' in the report")


class Liveness:
    """The guard as a hookimpl object; ``steps``: stalled steps before a wait is reported."""

    def __init__(self, steps: int = 64):
        self.steps = steps
        _gauge()

    @hookimpl
    def kvguard_after_schedule(self, scheduler, output):
        try:
            if not (scheduler.waiting or getattr(scheduler, "skipped_waiting", None)):
                # the every-step case: nothing to watch
                if _watches:
                    watch = _watches.pop(scheduler, None)
                    if watch is not None and watch.gauged:
                        _gauge()
                return
            self._watch(scheduler, output)
        except Exception as exc:        # fail open: the guard never takes the engine down
            once(logging.ERROR, ("liveness-internal", type(exc).__name__),
                 "vllm-kvguard: internal error in the liveness guard (%s: %s); it is skipped",
                 type(exc).__name__, exc)

    def _watch(self, scheduler, output) -> None:
        watch = _watches.get(scheduler)
        if watch is None:
            watch = _watches[scheduler] = _Watch()
        head = _first(scheduler)
        if head is None:
            return
        if head is not watch.head or head.num_tokens != watch.tokens:
            name = getattr(head.status, "name", "")
            if name in ("WAITING", "PREEMPTED"):
                why = certificate.of_scheduler(scheduler).never(
                    head.num_tokens, getattr(head, "num_prompt_tokens", head.num_tokens))
                if why is not None:
                    self._end(scheduler, head, watch, why)
                    return
            watch.head, watch.tokens, watch.steps, watch.reported = \
                head, head.num_tokens, 0, False
        stalled = getattr(output, "total_num_scheduled_tokens", 1) == 0 and not scheduler.running
        watch.steps = watch.steps + 1 if stalled else 0
        if watch.steps >= self.steps:
            _gauge(scheduler)
            watch.gauged = True
        elif watch.gauged:
            _gauge()
            watch.gauged = False
        if watch.steps >= self.steps and _fixed_point(scheduler, head):
            self._end(scheduler, head, watch, "vLLM's scheduler refused it for "
                      f"{watch.steps} steps with every block free and nothing else "
                      "running or pending")
            return
        if watch.steps >= self.steps and not watch.reported:
            watch.reported = True
            cause = waiting_cause(scheduler, head)
            report.count("waiting", cause)
            once(logging.WARNING, ("liveness-waiting", cause),
                 "vllm-kvguard: request %s has waited %d scheduler steps with nothing "
                 "scheduled (cause: %s); it can fit the KV cache, so it is left waiting "
                 "(counter 'waiting' in the report; further waits for this cause are "
                 "counted, not logged)", head.request_id, watch.steps, cause)

    @staticmethod
    def _end(scheduler, head, watch, why: str) -> None:
        cert = certificate.of_scheduler(scheduler)
        _finish(scheduler, head, f"vllm-kvguard: request {head.request_id} can never be "
                f"scheduled: {why}; the pool has {cert.usable} usable blocks; "
                f"{cert.statement()}. Lower the prompt or max_tokens, or give the KV cache "
                f"more room (gpu_memory_utilization, kv_cache_memory_bytes or "
                f"VLLM_CPU_KVCACHE_SPACE).")
        watch.head, watch.tokens, watch.steps = None, -1, 0


def _fixed_point(scheduler, head) -> bool:
    """Nothing can change the next step's outcome for ``head``: nothing runs, every
    block is free, and no outside event (a connector, a pause, a non-plain status) is
    pending; ``schedule()`` then sees the same state again."""
    if scheduler.running or waiting_cause(scheduler, head) not in ("admission", "preempted"):
        return False
    if getattr(scheduler, "ec_connector", None) is not None:    # encoder cache transfers
        return False
    pool = scheduler.kv_cache_manager.block_pool
    return pool.get_num_free_blocks() >= pool.num_gpu_blocks - 1
