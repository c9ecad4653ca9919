"""The patch registry: each patch is a small declarative unit (vllm-ascend style: what it
targets, why, which upstream issue, when to remove it) applied with wrapt.

* :class:`Target` names one host attribute (module + qualname). Names vLLM imports by
  value elsewhere list those modules in ``also_at``; each site gets the same wrapper.
* :class:`Patch` groups targets with the vLLM range they support. ``apply()`` is
  idempotent (a wrapper marker prevents double wrapping), ``revert()`` restores originals.
* :func:`hooked` turns a ``fn(call)`` into a wrapt wrapper that fails open: an exception
  of ours falls back to vLLM's original behaviour, logged once, and the patch then passes
  every later call straight through.
"""
from __future__ import annotations

import importlib
import logging
import sys
from dataclasses import dataclass, field
from typing import Any, Callable

import wrapt

from vllm_kvguard.log import logger, once
from vllm_kvguard.versions import in_range


class KvguardWrapper(wrapt.FunctionWrapper):
    """The marker type of every wrapper vllm-kvguard installs."""

    __kvguard_wrapper__ = True


def is_wrapped(obj: Any) -> bool:
    """Whether ``obj`` is a vllm-kvguard wrapper (also from a second copy of this module)."""
    return getattr(type(obj), "__kvguard_wrapper__", False) is True


# ---------------------------------------------------------------------------- fail open
_tripped: set[str] = set()


class KvguardOutcome(Exception):
    """Mixin for exceptions a fix raises on purpose (never swallowed by fail-open)."""


class InjectedFault(KvguardOutcome, ValueError):
    """The test-only allocator fault (a ValueError, like vLLM's own pool exhaustion)."""


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
                _tripped.add(patch)
                once(logging.ERROR, ("internal", patch),
                     "vllm-kvguard: internal error in patch %r (%s: %s); falling back to vLLM's "
                     "original behaviour for this and every later call in this process",
                     patch, type(exc).__name__, exc)
                return call.result if call.done else wrapped(*args, **kwargs)

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


def reset_tripped() -> None:
    _tripped.clear()


# ---------------------------------------------------------------------------- registry
@dataclass(frozen=True)
class Target:
    module: str
    qualname: str
    wrapper: Callable
    also_at: tuple[str, ...] = ()   # modules that did ``from module import name``
    required: bool = True           # missing optional targets are skipped, with a log line

    @property
    def name(self) -> str:
        return f"{self.module}.{self.qualname}"


@dataclass
class Patch:
    name: str
    summary: str
    targets: list[Target]
    vllm_versions: str              # packaging specifier, e.g. ">=0.27.1,<0.34"
    upstream: tuple[str, ...]       # vLLM issues/PRs it mitigates
    remove_when: str
    setup: Callable[[], None] | None = None      # at the first wrap (register hookimpls)
    teardown: Callable[[], None] | None = None   # at revert, if setup ran
    _installed: list = field(default_factory=list, repr=False)
    _active: bool = field(default=False, repr=False)
    _generation: int = field(default=0, repr=False)
    _set_up: bool = field(default=False, repr=False)

    @property
    def applied(self) -> bool:
        return self._active

    def supports(self, version) -> bool:
        return in_range(version, self.vllm_versions)

    def missing_targets(self) -> list[str]:
        """Required targets absent from the installed vLLM (the drift guard)."""
        missing = []
        for t in self.targets:
            if t.required and resolve(t.module, t.qualname) is None:
                missing.append(t.name)
        return missing

    def apply(self) -> list[str]:
        """Wrap every target; return notes (optional targets absent, targets deferred).

        Idempotent. Targets whose module vLLM has already imported are wrapped now; the
        others when vLLM imports that module (a wrapt post-import hook), so activation
        never imports vLLM modules a process would not load itself (the front end does
        not load the GPU worker, and the entry point stays fast).
        Raises LookupError (naming the target) if a required target of a loaded module is
        missing; nothing is left wrapped then. A required target found missing later, at
        import, reverts the whole patch with one warning.
        """
        if self._active:
            return []
        loaded = [t for t in self.targets if t.module in sys.modules]
        missing = [t.name for t in loaded
                   if t.required and resolve(t.module, t.qualname) is None]
        if missing:
            raise LookupError(f"target(s) missing in this vLLM: {', '.join(missing)}")
        self._active = True
        self._generation += 1
        notes, deferred = [], 0
        try:
            for t in self.targets:
                if t.module in sys.modules:
                    note = self._wrap(t)
                    if note:
                        notes.append(note)
                else:
                    self._defer(t)
                    deferred += 1
        except BaseException:
            self.revert()
            raise
        if deferred:
            notes.append(f"{deferred} target(s) wrapped when vLLM imports their module")
        return notes

    def _wrap(self, t: Target) -> str | None:
        resolved = resolve(t.module, t.qualname)
        if resolved is None:
            return f"{t.name} absent (optional part skipped)"
        parent, attr, original = resolved
        if is_wrapped(original):        # loaded twice: already wrapped, keep it
            return None
        if not self._set_up:            # the fixes load with the first target that needs them
            self._set_up = True
            if self.setup:
                self.setup()
        wrapper = KvguardWrapper(original, t.wrapper)
        self._install(parent, attr, original, wrapper)
        logger.debug("vllm-kvguard: patch %r wrapped %s", self.name, t.name)
        leaf = t.qualname.rsplit(".", 1)[-1]
        for mod_name in t.also_at:      # importers not loaded yet will import the wrapper
            mod = sys.modules.get(mod_name)
            if mod is not None and getattr(mod, leaf, None) is original:
                self._install(mod, leaf, original, wrapper)
        return None

    def _defer(self, t: Target) -> None:
        generation = self._generation

        def on_import(_module) -> None:
            if not self._active or self._generation != generation:
                return                  # reverted (or re-applied) since
            try:
                if t.required and resolve(t.module, t.qualname) is None:
                    logger.warning("vllm-kvguard: patch %r skipped: target missing in this "
                                   "vLLM: %s", self.name, t.name)
                    self.revert()
                    return
                note = self._wrap(t)
                if note:
                    logger.info("vllm-kvguard: patch %r: %s", self.name, note)
            except Exception as exc:    # fail open: vLLM keeps its original code
                logger.error("vllm-kvguard: patch %r reverted, internal error wrapping %s "
                             "(%s: %s)", self.name, t.name, type(exc).__name__, exc)
                self.revert()

        wrapt.register_post_import_hook(on_import, t.module)

    def _install(self, parent, attr, original, wrapper) -> None:
        had_own = attr in vars(parent) if isinstance(parent, type) else True
        setattr(parent, attr, wrapper)
        self._installed.append((parent, attr, original, had_own))

    def revert(self) -> None:
        self._active = False
        while self._installed:
            parent, attr, original, had_own = self._installed.pop()
            if had_own:
                setattr(parent, attr, original)
            else:                       # inherited method: drop the subclass attribute
                delattr(parent, attr)
        if self._set_up:
            self._set_up = False
            if self.teardown:
                self.teardown()


def _import(module: str):
    try:
        return importlib.import_module(module)
    except Exception:
        return None


def resolve(module: str, qualname: str):
    """(parent, attribute, original) for ``module:qualname``, or None if absent."""
    mod = _import(module)
    if mod is None:
        return None
    parent: Any = mod
    parts = qualname.split(".")
    for part in parts[:-1]:
        parent = getattr(parent, part, None)
        if parent is None:
            return None
    attr = parts[-1]
    if isinstance(parent, type):
        for klass in parent.__mro__:        # the raw descriptor, not a bound function
            if attr in vars(klass):
                return parent, attr, vars(klass)[attr]
        return None
    if not hasattr(parent, attr):
        return None
    return parent, attr, getattr(parent, attr)
