"""The other processes' counters, fetched through vLLM's own ``collective_rpc``.

Counts happen where vLLM runs the code (EngineCore, each worker, Ray workers on other
nodes); ``/metrics`` is served by the front end. The front end asks its engine for
:data:`METHOD` through ``AsyncLLM``/``LLMEngine.collective_rpc``: vLLM carries the call to
EngineCore as a utility call (run between steps, on EngineCore's own thread), where
:func:`engine_reply` answers with EngineCore's entry plus each worker's, taken through the
executor's ``collective_rpc`` (multiprocessing or Ray alike). No file, no shared directory:
a process that is gone simply stops answering.

``AsyncLLM`` cannot be awaited from a prometheus collector, so a task on its event loop
refreshes a cache every :data:`REFRESH_S` (every data-parallel engine is asked, through
vLLM's ``call_utility_all_async`` where it has one); ``LLMEngine`` is asked at collection
time. An EngineCore also hands the front end what it offers (:func:`offer`: the admission
limits, the verdicts of self-tests run there) as plain JSON values in its entry, read
with :func:`offered`; never code. A reply's verdicts are handed to
:func:`vllm_kvguard.verify.heard` as it arrives.
"""
from __future__ import annotations

import asyncio
import logging
import os
import sys
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
_offers: dict[str, object] = {}                     # key -> JSON value this process offers
_sync_cache: dict[int, list[dict]] = {}             # id(LLMEngine) -> its last reply
_first: dict[int, asyncio.Event] = {}               # id(AsyncLLM) -> first refresh ended
_tasks: dict[int, asyncio.Task] = {}                # id(AsyncLLM) -> its refresh task


def entry() -> dict:
    """This process's counters and gauges, tagged with its pid and role."""
    from vllm_kvguard import process, report

    out = {"pid": os.getpid(), "role": process.kind(), "counts": report.snapshot(),
           "gauges": report.gauges()}
    if _offers:
        out["offers"] = dict(_offers)
    return out


def offer(key: str, value) -> None:
    """Hand ``value`` (JSON-safe: numbers, strings, lists, dicts) to the front end in
    this process's entry under ``key``; None withdraws it."""
    if value is None:
        _offers.pop(key, None)
    else:
        _offers[key] = value


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
    if is_async and not _start(engine):
        once(logging.INFO, ("remote-no-loop",), "vllm-kvguard: AsyncLLM built outside an "
             "event loop; its engine is first asked at a request (admission patch on), else "
             "/metrics shows this process's counters only")


def _start(engine) -> bool:
    """Start ``engine``'s refresh task on the running loop (once); False: no loop."""
    key = id(engine)
    task = _tasks.get(key)
    if task is not None and not task.done():
        return True
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return False
    _first[key] = asyncio.Event()
    _tasks[key] = loop.create_task(_refresh_forever(weakref.ref(engine)),
                                   name="kvguard-remote-counters")
    return True


def first_reply_ended(engine) -> bool:
    """Whether ``engine``'s first refresh has ended (answered or failed)."""
    event = _first.get(id(engine))
    return event is not None and event.is_set()


async def first_reply(engine, timeout: float = RPC_TIMEOUT_S) -> None:
    """Wait until ``engine``'s first refresh has ended (at most ``timeout`` s), starting
    its refresh task here when ``AsyncLLM`` was built outside an event loop."""
    if not _start(engine):
        return
    try:
        await asyncio.wait_for(asyncio.shield(_first[id(engine)].wait()), timeout)
    except asyncio.TimeoutError:
        once(logging.INFO, ("remote-first-timeout",), "vllm-kvguard: the engine did not "
             "answer within %.0f s; requests go on without its admission limits", timeout)


async def _ask_async(engine) -> list:
    """One reply from every engine ``engine`` manages (data parallelism: each), else the
    first engine's through ``collective_rpc``."""
    every = getattr(getattr(engine, "engine_core", None), "call_utility_all_async", None)
    if every is None:
        return list(await engine.collective_rpc(METHOD) or ())
    replies = await every("collective_rpc", METHOD, None, (), None)
    return [e for reply in replies or () for e in (reply or ())]


async def _refresh_forever(ref: weakref.ref) -> None:
    key = id(ref())
    first = _first.get(key)
    while True:
        engine = ref()
        if engine is None or getattr(engine, "errored", False):
            _cache.pop(key, None)
            if first is not None:
                first.set()
            return
        try:
            reply = await asyncio.wait_for(_ask_async(engine), RPC_TIMEOUT_S)
            _cache[key] = [e for e in reply if isinstance(e, dict)]
            _refreshes[0] += 1
            _heard(_cache[key])
        except asyncio.CancelledError:
            raise
        except Exception as exc:   # the engine is shutting down or gone: keep the last
            once(logging.INFO, ("remote-refresh", type(exc).__name__),
                 "vllm-kvguard: refreshing the engine's counters failed (%s: %s)",
                 type(exc).__name__, exc)
        if first is not None:
            first.set()
        del engine
        await asyncio.sleep(REFRESH_S)


def entries() -> list[dict]:
    """The other processes' entries: cached for ``AsyncLLM``, asked now for ``LLMEngine``."""
    return _gather(fresh=True)


def _gather(fresh: bool) -> list[dict]:
    """Every attached engine's entries, one per process: ``AsyncLLM``'s from its cache,
    ``LLMEngine``'s asked now (``fresh``) or its last reply (asked once if none)."""
    out: list[dict] = []
    with _lock:
        engines = [(r(), a) for r, a in _engines]
    for engine, is_async in engines:
        if engine is None:
            continue
        if is_async:
            out.extend(_cache.get(id(engine), ()))
            continue
        reply = None if fresh else _sync_cache.get(id(engine))
        out.extend(_ask_sync(engine) if reply is None else reply)
    return _unique(out)


def _ask_sync(engine) -> list[dict]:
    """``LLMEngine``'s reply now (remembered for :func:`offered`); [] when it cannot."""
    try:
        reply = [e for e in engine.collective_rpc(METHOD) if isinstance(e, dict)]
    except Exception as exc:   # a dead or shut-down engine has nothing to add
        once(logging.DEBUG, ("remote-sync", type(exc).__name__),
             "vllm-kvguard: asking the engine for its counters failed (%s: %s)",
             type(exc).__name__, exc)
        reply = []
    _sync_cache[id(engine)] = reply
    _heard(reply)
    return reply


def _heard(reply: list[dict]) -> None:
    """Self-test verdicts other processes offer, for patches pending here."""
    verify = sys.modules.get("vllm_kvguard.verify")
    if verify is None:                       # nothing is verified in this process tree
        return
    own = os.getpid()
    try:
        verify.heard([e["offers"][verify.VERDICTS] for e in reply
                      if e.get("pid") != own and isinstance(e.get("offers"), dict)
                      and verify.VERDICTS in e["offers"]])
    except Exception as exc:   # fail open: a verdict not heard leaves the patch as it is
        once(logging.INFO, ("remote-verdicts", type(exc).__name__),
             "vllm-kvguard: a self-test verdict from the engine was not read (%s: %s)",
             type(exc).__name__, exc)


def _unique(out: list[dict]) -> list[dict]:
    own, seen, unique = os.getpid(), set(), []
    for e in out:
        if e.get("pid") != own and e.get("pid") not in seen:
            seen.add(e.get("pid"))
            unique.append(e)
    return unique


def offered(key: str) -> list:
    """What the other processes offer under ``key`` (raw: the caller validates it), one
    per process: ``AsyncLLM``'s from its cache, ``LLMEngine``'s asked once, then kept."""
    return [e["offers"][key] for e in _gather(fresh=False)
            if isinstance(e.get("offers"), dict) and key in e["offers"]]


def refreshes() -> int | None:
    """Completed ``AsyncLLM`` refreshes in this process (None: no async engine attached)."""
    with _lock:
        any_async = any(a for _, a in _engines)
    return _refreshes[0] if any_async else None


def reset() -> None:
    with _lock:
        _engines.clear()
    for store in (_cache, _sync_cache, _first, _tasks):
        store.clear()
