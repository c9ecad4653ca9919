"""The other processes' counters, fetched through vLLM's own ``collective_rpc``.

Counts happen where vLLM runs the code (EngineCore, each worker, Ray workers on other
nodes); ``/metrics`` is served by the front end. The front end asks its engine for
:data:`METHOD` through ``AsyncLLM``/``LLMEngine.collective_rpc``: vLLM carries the call to
EngineCore as a utility call (run between steps, on EngineCore's own thread), where
:func:`engine_reply` answers with EngineCore's entry plus each worker's, taken through the
executor's ``collective_rpc`` (multiprocessing or Ray alike). No file, no shared directory:
a process that is gone simply stops answering.

``AsyncLLM`` cannot be awaited from a prometheus collector, so a task on its event loop
refreshes a cache every :data:`REFRESH_S`; ``LLMEngine`` is asked at collection time.
Limit: with data parallelism only the first engine's processes are asked.
"""
from __future__ import annotations

import asyncio
import logging
import os
import threading
import weakref

from vllm_kvguard.log import once

METHOD = "kvguard_snapshot"
REFRESH_S = 1.0
RPC_TIMEOUT_S = 10.0

_lock = threading.Lock()
_engines: list[tuple[weakref.ref, bool]] = []      # (engine, is_async)
_cache: dict[int, list[dict]] = {}                  # id(async engine) -> its last reply
_refreshes = [0]


def entry() -> dict:
    """This process's counters and gauges, tagged with its pid and role."""
    from vllm_kvguard import process, report

    return {"pid": os.getpid(), "role": process.kind(), "counts": report.snapshot(),
            "gauges": report.gauges()}


def worker_entry(_worker) -> dict:
    """Run in each worker by the executor's ``collective_rpc`` (``_worker``: vLLM's worker)."""
    return entry()


def engine_reply(engine_core) -> list[dict]:
    """EngineCore's answer to :data:`METHOD`: its entry and every worker's (one per pid)."""
    entries = [entry()]
    try:
        workers = engine_core.model_executor.collective_rpc(worker_entry,
                                                            timeout=RPC_TIMEOUT_S)
    except Exception as exc:       # a worker that cannot answer: EngineCore's counts only
        once(logging.INFO, ("remote-workers", type(exc).__name__),
             "vllm-kvguard: the workers' counters could not be fetched (%s: %s); "
             "/metrics shows EngineCore's", type(exc).__name__, exc)
        workers = []
    seen = {os.getpid()}
    for item in workers or ():
        if isinstance(item, dict) and item.get("pid") not in seen:
            seen.add(item.get("pid"))
            entries.append(item)
    return entries


def attach(engine, is_async: bool) -> None:
    """Remember a front-end engine (weakly); an ``AsyncLLM`` gets its refresh task."""
    ref = weakref.ref(engine)
    with _lock:
        _engines[:] = [(r, a) for r, a in _engines if r() is not None]
        _engines.append((ref, is_async))
    if is_async:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            once(logging.INFO, ("remote-no-loop",), "vllm-kvguard: AsyncLLM built outside an "
                 "event loop; /metrics shows this process's counters only")
            return
        loop.create_task(_refresh_forever(ref), name="kvguard-remote-counters")


async def _refresh_forever(ref: weakref.ref) -> None:
    key = id(ref())
    while True:
        engine = ref()
        if engine is None or getattr(engine, "errored", False):
            _cache.pop(key, None)
            return
        try:
            reply = await asyncio.wait_for(engine.collective_rpc(METHOD), RPC_TIMEOUT_S)
            _cache[key] = [e for e in reply if isinstance(e, dict)]
            _refreshes[0] += 1
        except asyncio.CancelledError:
            raise
        except Exception as exc:   # the engine is shutting down or gone: keep the last
            once(logging.INFO, ("remote-refresh", type(exc).__name__),
                 "vllm-kvguard: refreshing the engine's counters failed (%s: %s)",
                 type(exc).__name__, exc)
        del engine
        await asyncio.sleep(REFRESH_S)


def entries() -> list[dict]:
    """The other processes' entries: cached for ``AsyncLLM``, asked now for ``LLMEngine``."""
    out: list[dict] = []
    with _lock:
        engines = [(r(), a) for r, a in _engines]
    for engine, is_async in engines:
        if engine is None:
            continue
        if is_async:
            out.extend(_cache.get(id(engine), ()))
            continue
        try:
            out.extend(e for e in engine.collective_rpc(METHOD) if isinstance(e, dict))
        except Exception as exc:   # a dead or shut-down engine has nothing to add
            once(logging.DEBUG, ("remote-sync", type(exc).__name__),
                 "vllm-kvguard: asking the engine for its counters failed (%s: %s)",
                 type(exc).__name__, exc)
    own, seen, unique = os.getpid(), set(), []
    for e in out:
        if e.get("pid") != own and e.get("pid") not in seen:
            seen.add(e.get("pid"))
            unique.append(e)
    return unique


def refreshes() -> int | None:
    """Completed ``AsyncLLM`` refreshes in this process (None: no async engine attached)."""
    with _lock:
        any_async = any(a for _, a in _engines)
    return _refreshes[0] if any_async else None


def reset() -> None:
    with _lock:
        _engines.clear()
    _cache.clear()
