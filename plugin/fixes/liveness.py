"""Liveness guard: a request that can never be scheduled is finished, not waited on forever.

vLLM admits a waiting request only when its blocks fit; one that never fits (its need
above what the pool can ever offer, or an estimate that never passes) blocks the head of
the waiting queue, and with nothing running the engine spins on empty steps forever
(vllm#35541, #39734; TensorRT-LLM's startup hang). After every ``Scheduler.schedule()``
this guard counts consecutive steps in which

* nothing was scheduled and nothing is running,
* the pool is as free as it will get: no deferred frees, no request holding blocks while
  it waits (async KV loads), the free-block count unchanged,
* the same request heads the waiting queue (the first one not blocked on a grammar, a
  remote KV transfer or a streaming input),

and after ``KVGUARD_LIVENESS_STEPS`` (default 64) such steps finishes that request with
``FINISHED_ERROR`` through the scheduler's own error path (the client gets a finished
output with ``finish_reason="error"``) and logs why: its block need and the pool size.
The requests behind it proceed. Anything else (a step that schedules, a running request,
a change of head or free count) resets the count.
"""
from __future__ import annotations

import logging
import weakref

from vllm_kvguard import report
from vllm_kvguard.hookspecs import hookimpl
from vllm_kvguard.log import logger, once


class _Watch:
    __slots__ = ("head", "free", "steps")

    def __init__(self):
        self.head = None
        self.free = None
        self.steps = 0


# The scheduler's _Watch while it is stalled (nothing on the Scheduler itself: reading its
# __dict__ would make CPython 3.11 materialise it and slow every attribute vLLM reads).
_watches: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def block_need(manager, request) -> int:
    """Blocks ``request`` needs to hold its whole sequence, summed over KV-cache groups
    (an estimate for the message: Mamba holds 1 + speculative (+1 in align) state blocks,
    attention groups one per ``block_size`` tokens, capped where vLLM caps admission)."""
    tokens = min(request.num_tokens, getattr(manager, "max_model_len", request.num_tokens))
    need = 0
    for m in manager.coordinator.single_type_managers:
        if type(m).__name__ == "MambaManager":
            nsb = int(getattr(m, "num_speculative_blocks", 0) or 0)
            need += 1 + nsb + int(getattr(m, "mamba_cache_mode", "none") == "align")
            continue
        n = _cdiv(tokens, m.block_size)
        cap = getattr(m, "max_admission_blocks_per_request", None)
        need += min(n, cap) if cap else n
    return need


def _head(scheduler):
    from vllm.v1.request import RequestStatus

    ready = (RequestStatus.WAITING, RequestStatus.PREEMPTED)
    for item in scheduler.waiting:
        request = item if hasattr(item, "request_id") else item[-1]
        if request.status in ready:
            return request
    return None


def _stuck(scheduler, output) -> bool:
    if getattr(output, "total_num_scheduled_tokens", 1) != 0 or scheduler.running:
        return False
    if getattr(scheduler, "kv_holding_waiting", None) or getattr(
            scheduler, "deferred_frees", None):
        return False
    pause = getattr(scheduler, "_pause_state", None)
    return pause is None or getattr(pause, "name", "UNPAUSED") == "UNPAUSED"


def _finish(scheduler, request, steps: int) -> None:
    from vllm.v1.request import RequestStatus

    manager = scheduler.kv_cache_manager
    pool = manager.block_pool
    usable = pool.num_gpu_blocks - 1
    need = block_need(manager, request)
    waiting = max(len(scheduler.waiting) - 1, 0)
    message = (
        f"vllm-kvguard: request {request.request_id} cannot be scheduled: it needs about "
        f"{need} KV-cache blocks for its {request.num_tokens} tokens, the pool has {usable} "
        f"usable blocks ({pool.get_num_free_blocks()} free, nothing running), and no "
        f"progress was made for {steps} scheduler steps. Finishing it with an error so the "
        f"{waiting} request(s) behind it can run. Give the KV cache more room "
        f"(gpu_memory_utilization, kv_cache_memory_bytes or VLLM_CPU_KVCACHE_SPACE), or "
        f"lower max_model_len / the prompt length; KVGUARD_LIVENESS_STEPS sets the patience.")
    # The scheduler's own per-request error path, drained by update_from_output:
    # finish_requests(FINISHED_ERROR) and an EngineCoreOutput with finish_reason=error
    # (on 0.33+ carrying this message to the client as a GenerationError).
    errors = getattr(scheduler, "grammar_compile_error_reqs", None)
    request_error = _request_error(message) if isinstance(errors, dict) else None
    if request_error is not None:
        errors[request.request_id] = request_error
        how = "finished with this error"
    elif isinstance(errors, set):
        errors.add(request.request_id)
        how = "finished with an error"
    else:
        status = getattr(RequestStatus, "FINISHED_ERROR", RequestStatus.FINISHED_ABORTED)
        scheduler.finish_requests(request.request_id, status)
        how = f"finished as {status.name} (this vLLM has no error path to the client)"
    report.count("liveness", "finished_unschedulable")
    logger.error("%s [%s]", message, how)
    once(logging.INFO, ("liveness-first",),
         "vllm-kvguard: liveness guard acted; counter 'liveness' in the report")


def _request_error(message: str):
    try:
        from vllm.outputs import RequestError
    except ImportError:
        return None
    return RequestError(code="kv_cache_capacity", message=message)


class Liveness:
    """The guard as a hookimpl object; ``steps``: stalled steps before it acts."""

    def __init__(self, steps: int = 64):
        self.steps = steps

    @hookimpl
    def kvguard_after_schedule(self, scheduler, output):
        try:
            head = _head(scheduler) if _stuck(scheduler, output) else None
            if head is None:            # progress (the every-step case): nothing to watch
                if _watches:
                    _watches.pop(scheduler, None)
                return
            watch = _watches.get(scheduler)
            if watch is None:
                watch = _watches[scheduler] = _Watch()
            free = scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
            if head is not watch.head or free != watch.free:
                watch.head, watch.free, watch.steps = head, free, 1
            else:
                watch.steps += 1
            if watch.steps >= self.steps:
                _finish(scheduler, head, watch.steps)
                watch.head, watch.free, watch.steps = None, None, 0
        except Exception as exc:        # fail open: the guard never takes the engine down
            once(logging.ERROR, ("liveness-internal", type(exc).__name__),
                 "vllm-kvguard: internal error in the liveness guard (%s: %s); it is skipped",
                 type(exc).__name__, exc)
