"""The plugin manager: our hookspecs, our fixes, and third-party hookimpls.

Hot paths that skip pluggy's per-call dispatch (the allocator's per-manager transaction,
the per-step :func:`direct` calls after ``schedule()``) decide once per registration
change, from pluggy's public ``get_hookimpls()``. The manager is a
:class:`pluggy.PluginManager` whose ``register``/``unregister`` (the one seam every
registration passes) tell :func:`on_change` listeners.
"""
from __future__ import annotations

from typing import Callable

import pluggy

from vllm_kvguard import hookspecs

ENTRY_POINT_GROUP = "vllm_kvguard.hooks"


class KvguardPluginManager(pluggy.PluginManager):
    """pluggy's manager, telling listeners after each registration change."""

    def __init__(self):
        super().__init__(hookspecs.PROJECT)
        self._kvguard_listeners: list[Callable[[], None]] = []

    def register(self, plugin, name=None):
        result = super().register(plugin, name)
        self._kvguard_changed()
        return result

    def unregister(self, plugin=None, name=None):
        result = super().unregister(plugin, name)
        self._kvguard_changed()
        return result

    def _kvguard_changed(self) -> None:
        for listener in list(self._kvguard_listeners):
            listener()


_pm: KvguardPluginManager | None = None


def get_plugin_manager() -> KvguardPluginManager:
    """The process-wide manager, built on first use (idempotent)."""
    global _pm
    if _pm is None:
        pm = KvguardPluginManager()
        pm.add_hookspecs(hookspecs)
        pm.load_setuptools_entrypoints(ENTRY_POINT_GROUP)
        _pm = pm
    return _pm


def hook():
    """``get_plugin_manager().hook``: what the patch wrappers call."""
    return get_plugin_manager().hook


def impls(hook_name: str) -> list:
    """The hook's implementations (pluggy's ``HookImpl``), in call order."""
    caller = getattr(get_plugin_manager().hook, hook_name)
    return list(reversed(caller.get_hookimpls()))


def direct(hook_name: str) -> tuple | None:
    """The hook's implementations as plain callables taking the spec's arguments by
    position, in pluggy's call order; None when one is a wrapper (then call the hook).

    What pluggy's ``_multicall`` does for a hook whose result is ignored, without its
    per-call cost (bench_engine counted ~25,000 instructions a step in pluggy for
    ``kvguard_after_schedule``). Refresh it from an :func:`on_change` listener."""
    caller = getattr(get_plugin_manager().hook, hook_name)
    spec = tuple(caller.spec.argnames)
    calls = []
    for impl in impls(hook_name):
        if impl.hookwrapper or getattr(impl, "wrapper", False):
            return None
        if tuple(impl.argnames) == spec:
            calls.append(impl.function)
        else:                           # an implementation taking some of the arguments
            calls.append(_picking(impl.function, [spec.index(a) for a in impl.argnames]))
    return tuple(calls)


def _picking(fn, positions: list):
    return lambda *args: fn(*[args[i] for i in positions])


def register(plugin, name: str | None = None) -> None:
    """Register a hookimpl module/object once (re-registration is a no-op)."""
    pm = get_plugin_manager()
    if name is None:
        name = getattr(plugin, "__name__", None) or repr(plugin)
    if pm.get_plugin(name) is None and not pm.is_registered(plugin):
        pm.register(plugin, name=name)


def unregister(name: str) -> None:
    pm = get_plugin_manager()
    if pm.get_plugin(name) is not None:
        pm.unregister(name=name)


def on_change(listener: Callable[[], None]) -> Callable[[], None]:
    """Call ``listener()`` after every registration change; returns the undo."""
    listeners = get_plugin_manager()._kvguard_listeners
    if listener not in listeners:
        listeners.append(listener)

    def undo() -> None:
        if listener in listeners:
            listeners.remove(listener)

    return undo
