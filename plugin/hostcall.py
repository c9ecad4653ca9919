"""vLLM's original call as an object, and the fail-open wrapper around our logic.

:func:`hooked` turns ``fn(call)`` into a wrapt wrapper: an unexpected exception of ours
is logged once, the patch is marked tripped (every later call goes straight to vLLM) and
vLLM's original code runs. vLLM's own errors and outcomes we raise on purpose pass.
:func:`after` is the same contract for a fix that only looks at a finished call's result,
without the per-call :class:`HostCall` (for ``Scheduler.schedule``, once a step).
"""
from __future__ import annotations

import logging
from typing import Any, Callable

from vllm_kvguard.log import once

_tripped: set[str] = set()
_trip_listeners: list[Callable[[str], None]] = []


class KvguardOutcome(Exception):
    """Mixin for exceptions a fix raises on purpose (never swallowed by fail-open)."""


class InjectedFault(KvguardOutcome, ValueError):
    """The test-only allocator fault (a ValueError, like vLLM's own pool exhaustion)."""


class InjectedConnectorFault(KvguardOutcome, RuntimeError):
    """The test-only KV connector fault (a connector's own bug, as far as vLLM can tell)."""


class HostCall:
    """vLLM's original call, run at most once, remembering whether it ran and how it ended."""

    __slots__ = ("wrapped", "instance", "args", "kwargs", "started", "done", "result", "error")

    def __init__(self, wrapped, instance, args, kwargs):
        self.wrapped, self.instance, self.args, self.kwargs = wrapped, instance, args, kwargs
        self.started = self.done = False
        self.result = self.error = None

    def __call__(self):
        if self.started:
            raise RuntimeError("vllm-kvguard: host call run twice")
        self.started = True
        try:
            self.result = self.wrapped(*self.args, **self.kwargs)
        except BaseException as exc:
            self.error = exc
            raise
        self.done = True
        return self.result

    def arg(self, index: int, name: str, default=None):
        """A parameter of the host call, whether it was passed by position or by keyword."""
        if name in self.kwargs:
            return self.kwargs[name]
        return self.args[index] if index < len(self.args) else default


def tripped(patch: str) -> bool:
    """Whether ``patch`` hit an internal error in this process (it then passes through)."""
    return patch in _tripped


def trip(patch: str, exc: BaseException) -> None:
    """Mark ``patch`` tripped: log once, tell the listeners (they drop their fast paths)."""
    _tripped.add(patch)
    once(logging.ERROR, ("internal", patch),
         "vllm-kvguard: internal error in patch %r (%s: %s); falling back to vLLM's "
         "original behaviour for this and every later call in this process",
         patch, type(exc).__name__, exc)
    for listener in list(_trip_listeners):
        listener(patch)


def on_trip(listener: Callable[[str], None]) -> Callable[[], None]:
    """Call ``listener(patch)`` when a patch trips; returns the undo."""
    _trip_listeners.append(listener)
    return lambda: listener in _trip_listeners and _trip_listeners.remove(listener)


def reset_tripped() -> None:
    _tripped.clear()


def hooked(patch: str) -> Callable[[Callable[[HostCall], Any]], Callable]:
    """Decorate ``fn(call) -> result`` into a wrapt wrapper that fails open for ``patch``."""

    def decorate(fn: Callable[[HostCall], Any]) -> Callable:
        def wrapper(wrapped, instance, args, kwargs):
            if patch in _tripped:
                return wrapped(*args, **kwargs)
            call = HostCall(wrapped, instance, args, kwargs)
            try:
                return fn(call)
            except Exception as exc:
                if exc is call.error or isinstance(exc, KvguardOutcome):
                    raise                      # vLLM's own error, or an intended outcome
                if call.started and not call.done:
                    raise
                trip(patch, exc)
                return call.result if call.done else wrapped(*args, **kwargs)

        wrapper.__name__ = getattr(fn, "__name__", "wrapper")
        wrapper.__doc__ = fn.__doc__
        return wrapper

    return decorate


def after(patch: str) -> Callable[[Callable[[Any, Any], None]], Callable]:
    """Decorate ``fn(instance, result)`` into a wrapt wrapper that runs vLLM's call, then
    ``fn`` on its result, failing open for ``patch`` like :func:`hooked`."""

    def decorate(fn: Callable[[Any, Any], None]) -> Callable:
        def wrapper(wrapped, instance, args, kwargs):
            result = wrapped(*args, **kwargs)
            if patch not in _tripped:
                try:
                    fn(instance, result)
                except KvguardOutcome:
                    raise
                except Exception as exc:
                    trip(patch, exc)
            return result

        wrapper.__name__ = getattr(fn, "__name__", "wrapper")
        wrapper.__doc__ = fn.__doc__
        return wrapper

    return decorate


def first_result(hook_caller, call: HostCall, **kwargs):
    """Call a ``firstresult`` hook that may run ``call``; run it here if no impl did.

    vLLM's own results can be None (``allocate_slots``: no room), so "the host call ran"
    rather than "a result came back" decides whether the hook handled the call.
    """
    result = hook_caller(call=call, **kwargs)
    if not call.started:
        return call()
    return result
