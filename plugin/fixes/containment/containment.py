"""Per-request fault containment: a KV connector call that fails ends only its request.

The scheduler calls its KV connector inline for one request at a time
(``get_num_new_matched_tokens``, ``update_state_after_alloc``, ``request_finished``; 0.34+:
``may_load_async`` as a request enters the waiting queues); an exception there escapes
``Scheduler.schedule`` (or ``add_request``) and EngineCore dies with every request on it.
Here each such call is guarded: an ``Exception`` is logged (one line naming the request,
the call and the exception), counted (``contained``, reason = the call) and answered with
the connector's neutral reply (no match yet / nothing to do / free now / no async load), so
vLLM's loop goes on; when the step's connector metadata is built the request is finished
with an error through the scheduler's own error path, its blocks freed. Blocks a failed
``update_state_after_alloc`` may have left without their external KV are evicted from the
prefix cache, so no other request reuses them. ``BaseException`` and errors outside these
calls (vLLM's own loop) propagate untouched; an internal error here re-raises the
connector's error (vLLM's behaviour).
"""
from __future__ import annotations

import logging
import threading
import weakref
from dataclasses import dataclass

from vllm_kvguard import report
from vllm_kvguard.fixes.request_errors import end_request
from vllm_kvguard.hookspecs import hookimpl
from vllm_kvguard.log import logger, once

#: Guarded connector methods and the reply that lets the scheduler go on without them.
NEUTRAL = {
    "get_num_new_matched_tokens": (None, False),     # "ask me again": the request waits
    "update_state_after_alloc": None,
    "request_finished": (False, None),               # free the blocks now, no transfer
    "request_finished_all_groups": (False, None),
    "may_load_async": False,                         # 0.34+: the plain waiting queue
}
METHODS = tuple(NEUTRAL)
REASONS = ("get_num_new_matched_tokens", "update_state_after_alloc", "request_finished",
           "may_load_async")
report.declare("contained", REASONS)


@dataclass
class Failure:
    request_id: str
    method: str
    error: Exception
    evict: bool          # the request's blocks may lack KV the connector was to load


class Containment:
    """The containment fix as a hookimpl object."""

    def __init__(self):
        self._lock = threading.Lock()
        self._pending: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
        self._doomed: "weakref.WeakSet" = weakref.WeakSet()    # failed, not finished yet

    @hookimpl
    def kvguard_guard_connector_call(self, connector, method, fn):
        if method not in NEUTRAL:
            return None
        neutral, contain, doomed = NEUTRAL[method], self.contain, self._doomed

        def guarded(request, *args, **kwargs):
            if doomed and request in doomed:    # asked again before its end (async steps)
                return neutral
            try:
                return fn(request, *args, **kwargs)
            except Exception as error:
                contain(connector, method, request, error, args, kwargs)
                return neutral

        guarded.__name__ = method
        return guarded

    def contain(self, connector, method, request, error, args, kwargs) -> None:
        """Record ``error`` of ``method`` for ``request``; re-raise it if that fails."""
        try:
            rid = request.request_id
            external = kwargs.get("num_external_tokens", args[1] if len(args) > 1 else 0)
            failure = Failure(rid, method, error, method == "update_state_after_alloc"
                              and bool(external))
            reason = "request_finished" if method.startswith("request_finished") else method
            report.count("contained", reason)
            if reason != "request_finished":      # a finishing request is ending anyway
                with self._lock:
                    self._pending.setdefault(connector, []).append(failure)
                    self._doomed.add(request)
        except Exception as exc:
            _internal(exc, "the KV connector's error is re-raised (vLLM's behaviour)")
            raise error from None
        ending = ("it was finishing; its blocks are freed now" if reason == "request_finished"
                  else "only this request is ended")
        logger.error("vllm-kvguard: KV connector %s(request %s) raised %s: %s; %s",
                     method, rid, type(error).__name__, error, ending)

    @hookimpl
    def kvguard_connector_meta_built(self, scheduler, connector):
        if not self._pending:
            return
        with self._lock:
            failures = self._pending.pop(connector, [])
        for failure in failures:
            try:
                self._end(scheduler, failure)
            except Exception as exc:
                _internal(exc, f"request {failure.request_id} is not ended")

    @staticmethod
    def _end(scheduler, failure: Failure) -> None:
        rid = failure.request_id
        message = (f"request {rid} failed: the KV connector's {failure.method} raised "
                   f"{type(failure.error).__name__}: {failure.error}")
        end_request(scheduler, rid, message, "kv_connector", evict=failure.evict)


def _internal(exc: Exception, outcome: str) -> None:
    report.count("internal_error", "containment")
    once(logging.ERROR, ("containment-internal", type(exc).__name__),
         "vllm-kvguard: internal error in fault containment (%s: %s); %s",
         type(exc).__name__, exc, outcome)
