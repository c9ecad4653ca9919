"""Finish one request with an error through the scheduler's own per-request error path.

vLLM drains ``Scheduler.grammar_compile_error_reqs`` in ``update_from_output``: it calls
``finish_requests(FINISHED_ERROR)`` (the blocks are freed, the connector is told) and
emits an ``EngineCoreOutput`` with ``finish_reason="error"``, so that client alone gets
an error (``vllm serve``: HTTP 500; on vLLM 0.33+ carrying the message). Where a vLLM has
no such path the request is finished at once (aborted on the oldest versions).
"""
from __future__ import annotations


def end_request(scheduler, request_id: str, message: str, code: str, *,
                evict: bool = False) -> str:
    """:func:`fail_request`; with ``evict``, first drop the request's blocks from the
    prefix cache (their KV may never have been written: nobody may reuse it)."""
    if evict and request_id in scheduler.requests:
        ids = {b for group in scheduler.kv_cache_manager.get_block_ids(request_id)
               for b in group}
        scheduler.kv_cache_manager.evict_blocks(ids)
    return fail_request(scheduler, request_id, message, code)


def fail_request(scheduler, request_id: str, message: str, code: str) -> str:
    """Queue ``request_id`` to finish with ``message``; returns how, for the log line."""
    from vllm.v1.request import RequestStatus

    errors = getattr(scheduler, "grammar_compile_error_reqs", None)
    request_error = _request_error(code, message) if isinstance(errors, dict) else None
    if request_error is not None:
        errors[request_id] = request_error
        return "finished with this error"
    if isinstance(errors, set):
        errors.add(request_id)
        return "finished with an error"
    status = getattr(RequestStatus, "FINISHED_ERROR", RequestStatus.FINISHED_ABORTED)
    scheduler.finish_requests(request_id, status)
    return f"finished as {status.name} (this vLLM has no error path to the client)"


def _request_error(code: str, message: str):
    try:
        from vllm.outputs import RequestError
    except ImportError:
        return None
    return RequestError(code=code, message=message)
