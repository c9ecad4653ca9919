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

import enum
import logging
import weakref
from collections import deque

from vllm_kvguard import report
from vllm_kvguard.fixes.estimation import certificate
from vllm_kvguard.fixes.request_errors import fail_request
from vllm_kvguard.hookspecs import hookimpl
from vllm_kvguard.log import logger, once


CAUSES = ("remote_kv", "grammar", "streaming_input", "paused", "kv_connector",
          "kv_transfer", "preempted", "admission")
GAUGE = "waiting_requests"


# How the first request a queue yields is read. vLLM's FCFS queue is a deque whose head is
# ``q[0]`` (its ``__bool__``, ``__len__`` and ``__iter__`` are Python code around deque's
# own); its priority queue iterates by popping a copy of its heap, whose first pop is what
# ``peek_request()`` returns; any other queue is iterated.
_DEQUE, _PEEK, _ITER = 0, 1, 2
_QUEUES = "vllm.v1.core.sched.request_queue"
_deque_len = deque.__len__


def queue_kind(queue) -> int:
    """How :func:`head_of` reads the head of ``queue`` (by its type)."""
    cls = type(queue)
    if cls is deque or (cls.__name__ == "FCFSRequestQueue" and cls.__module__ == _QUEUES):
        return _DEQUE
    if cls.__name__ == "PriorityRequestQueue" and cls.__module__ == _QUEUES:
        return _PEEK
    return _ITER


def head_of(queue, kind):
    """The first request iterating ``queue`` yields, or None; priority queues of old vLLM
    hold ``(priority, ..., request)`` items."""
    if kind == _DEQUE:
        return queue[0] if _deque_len(queue) else None
    if kind == _PEEK:
        item = queue.peek_request() if queue else None
    else:
        item = next(iter(queue), None)
    return item if item is None or hasattr(item, "request_id") else item[-1]


def first_waiting(scheduler):
    """The first request ``scheduler`` would look at: the head of its waiting queue, else
    of ``skipped_waiting`` (vLLM 0.27-0.29); None when nothing waits."""
    head = head_of(scheduler.waiting, queue_kind(scheduler.waiting))
    skipped = getattr(scheduler, "skipped_waiting", None)
    if head is None and skipped is not None:
        head = head_of(skipped, queue_kind(skipped))
    return head


class _Watch:
    """Per scheduler: the head watched, and its queues with how to read their head."""

    __slots__ = ("head", "tokens", "steps", "reported", "gauged",
                 "waiting", "kind", "has_skipped", "skipped", "skipped_kind")

    def __init__(self, scheduler):
        self.head = None
        self.tokens = -1
        self.steps = 0
        self.reported = False
        self.gauged = False
        self.waiting = self.skipped = None
        self.kind = self.skipped_kind = _ITER
        # vLLM 0.27-0.29 park deferred and blocked requests in ``skipped_waiting``,
        # consulted after ``waiting``
        self.has_skipped = hasattr(scheduler, "skipped_waiting")

    def skipped_head(self, scheduler):
        """The head of ``skipped_waiting`` (vLLM 0.27-0.29), or None."""
        skipped = scheduler.skipped_waiting
        if skipped is not self.skipped:
            self.skipped, self.skipped_kind = skipped, queue_kind(skipped)
        return head_of(skipped, self.skipped_kind)


# Per scheduler (nothing on the Scheduler itself: reading its __dict__ would make CPython
# 3.11 materialise it and slow every attribute). The last scheduler's watch is found by
# calling a weak reference to it; the weak dictionary serves the others.
_watches: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


class _Last:
    __slots__ = ("ref", "watch")


_last = _Last()
_last.ref, _last.watch = (lambda: None), None


def _watch_of(scheduler) -> _Watch:
    """``scheduler``'s watch, now the last one."""
    watch = _watches.get(scheduler)
    if watch is None:
        watch = _watches[scheduler] = _Watch(scheduler)
    _last.ref, _last.watch = weakref.ref(scheduler, _forget_last), watch
    return watch


def _forget_last(ref) -> None:
    """The last scheduler is gone: let its watch go too."""
    if _last.ref is ref:
        _last.watch = None


def _waiting(scheduler):
    """The waiting requests, then ``skipped_waiting`` (vLLM 0.27-0.29 park deferred and
    blocked requests there); priority queues of old vLLM hold ``(priority, ...,
    request)`` items."""
    for queue in (scheduler.waiting, getattr(scheduler, "skipped_waiting", ())):
        for item in queue:
            yield item if hasattr(item, "request_id") else item[-1]


def _gauge(scheduler=None) -> None:
    """Set the gauge from ``scheduler``'s waiting requests (None: all causes at 0)."""
    values = dict.fromkeys(CAUSES, 0)
    if scheduler is not None:
        for request in _waiting(scheduler):
            cause = waiting_cause(scheduler, request)
            values[cause] = values.get(cause, 0) + 1
    report.set_gauge(GAUGE, values)


_BY_STATUS = {"WAITING_FOR_REMOTE_KVS": "remote_kv",
              "WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR": "grammar",
              "WAITING_FOR_FSM": "grammar",
              "WAITING_FOR_STREAMING_REQ": "streaming_input"}
_names: dict = {}       # enum member -> (member, its name): ``name`` is Python code
_MISSING = object()


def _name(value, default=None) -> str:
    """``value.name`` (an enum's, cached), else ``default``, else ``str(value)``."""
    try:
        known = _names.get(value)
    except TypeError:                   # unhashable
        known = None
    if known is not None and known[0] is value:
        return known[1]
    name = getattr(value, "name", _MISSING)
    if name is _MISSING:
        return str(value) if default is None else default
    if isinstance(value, enum.Enum) and len(_names) < 64:
        _names[value] = (value, name)
    return name


def waiting_cause(scheduler, request) -> str:
    """Why ``request`` (waiting, able to fit) is not scheduled yet, as a short cause."""
    status = _name(request.status)
    cause = _BY_STATUS.get(status)
    if cause is not None:
        return cause
    pause = getattr(scheduler, "_pause_state", None)
    if pause is not None and _name(pause, "UNPAUSED") != "UNPAUSED":
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

    __slots__ = ("steps",)      # no instance dict for pluggy's dir() to materialise (Heartbeat)

    def __init__(self, steps: int = 64):
        self.steps = steps
        _gauge()

    @hookimpl
    def kvguard_after_schedule(self, scheduler, output):
        try:
            watch = _last.watch
            if _last.ref() is not scheduler:
                watch = _watch_of(scheduler)
            waiting = scheduler.waiting
            if waiting is not watch.waiting:
                watch.waiting, watch.kind = waiting, queue_kind(waiting)
            if watch.kind == _DEQUE:
                head = waiting[0] if _deque_len(waiting) else None
            else:
                head = head_of(waiting, watch.kind)
            if head is None and watch.has_skipped:
                head = watch.skipped_head(scheduler)
            if head is None:
                # the every-step case: nothing to watch; a later head starts afresh
                if watch.head is not None or watch.gauged:
                    watch.head, watch.tokens, watch.steps, watch.reported = None, -1, 0, False
                    if watch.gauged:
                        watch.gauged = False
                        _gauge()
                return
            if head is not watch.head or head.num_tokens != watch.tokens:
                if self._new_head(scheduler, head, watch):
                    return
            if not scheduler.running and getattr(output, "total_num_scheduled_tokens", 1) == 0:
                watch.steps += 1
            else:
                watch.steps = 0
            if watch.steps >= self.steps:
                self._stalled(scheduler, head, watch)
            elif watch.gauged:
                _gauge()
                watch.gauged = False
        except Exception as exc:        # fail open: the guard never takes the engine down
            once(logging.ERROR, ("liveness-internal", type(exc).__name__),
                 "vllm-kvguard: internal error in the liveness guard (%s: %s); it is skipped",
                 type(exc).__name__, exc)

    def _new_head(self, scheduler, head, watch) -> bool:
        """Watch ``head`` from now on; True when the certificate ended it."""
        if _name(head.status, "") in ("WAITING", "PREEMPTED"):
            why = certificate.of_scheduler(scheduler).never(
                head.num_tokens, getattr(head, "num_prompt_tokens", head.num_tokens))
            if why is not None:
                self._end(scheduler, head, watch, why)
                return True
        watch.head, watch.tokens, watch.steps, watch.reported = head, head.num_tokens, 0, False
        return False

    def _stalled(self, scheduler, head, watch) -> None:
        """``head`` has waited ``self.steps`` steps or more with nothing scheduled."""
        _gauge(scheduler)
        watch.gauged = True
        if _fixed_point(scheduler, head):
            self._end(scheduler, head, watch, "vLLM's scheduler refused it for "
                      f"{watch.steps} steps with every block free and nothing else "
                      "running or pending")
            return
        if not watch.reported:
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
