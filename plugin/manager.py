"""The plugin manager: our hookspecs, our fixes, and third-party hookimpls."""
from __future__ import annotations

import pluggy

from vllm_kvguard import hookspecs

ENTRY_POINT_GROUP = "vllm_kvguard.hooks"

_pm: pluggy.PluginManager | None = None
_listeners: list = []             # called after register()/unregister() change the manager


def get_plugin_manager() -> pluggy.PluginManager:
    """The process-wide manager, built on first use (idempotent)."""
    global _pm
    if _pm is None:
        pm = pluggy.PluginManager(hookspecs.PROJECT)
        pm.add_hookspecs(hookspecs)
        pm.load_setuptools_entrypoints(ENTRY_POINT_GROUP)
        _pm = pm
    return _pm


def hook():
    """``get_plugin_manager().hook``: what the patch wrappers call."""
    return get_plugin_manager().hook


def register(plugin, name: str | None = None) -> None:
    """Register a hookimpl module/object once (re-registration is a no-op)."""
    pm = get_plugin_manager()
    if name is None:
        name = getattr(plugin, "__name__", None) or repr(plugin)
    if pm.get_plugin(name) is None and not pm.is_registered(plugin):
        pm.register(plugin, name=name)
        _changed()


def unregister(name: str) -> None:
    pm = get_plugin_manager()
    if pm.get_plugin(name) is not None:
        pm.unregister(name=name)
        _changed()


def on_registration_change(listener, remove: bool = False) -> None:
    """Call ``listener()`` after :func:`register` or :func:`unregister` changed the
    implementations (idempotent; ``remove=True`` takes it off). Used by hot paths that
    cache the implementation list."""
    if listener in _listeners:
        if remove:
            _listeners.remove(listener)
    elif not remove:
        _listeners.append(listener)


def _changed() -> None:
    for listener in list(_listeners):
        listener()


class DirectHook:
    """Calls one hook's implementations without pluggy's per-call overhead, for hooks on
    a hot path (once per scheduler step or per allocation).

    Same implementations, order (last registered first) and results as
    ``hook().<name>(**kwargs)``: a list of the non-None results, or for a ``firstresult``
    hook the first non-None one. The plan is rebuilt whenever the manager or its
    implementation list changes; while any implementation is a pluggy wrapper the call
    goes through pluggy itself.
    """

    def __init__(self, hook_name: str, firstresult: bool = False):
        self.hook_name = hook_name
        self.firstresult = firstresult
        self._pm = None
        self._caller = None
        self._impls = None
        self._plan = None

    def current(self):
        """pluggy's HookCaller, with :attr:`plan` refreshed: ``[(function, argnames)]``
        in call order, or None while a wrapper implementation is registered."""
        if self._pm is not _pm or self._caller is None:
            self._pm = get_plugin_manager()
            self._caller = getattr(self._pm.hook, self.hook_name)
            self._impls = None
        caller = self._caller
        impls = getattr(caller, "_hookimpls", None)
        if impls is None:
            impls = caller.get_hookimpls()
        if impls != self._impls:
            self._impls = list(impls)
            self._plan = None if any(i.hookwrapper or i.wrapper for i in impls) else [
                (i.function, i.argnames) for i in reversed(impls)]
        return caller

    @property
    def plan(self):
        return self._plan

    def __call__(self, **kwargs):
        caller = self.current()
        plan = self._plan
        if plan is None:
            return caller(**kwargs)
        if self.firstresult:
            for function, argnames in plan:
                result = function(*[kwargs[a] for a in argnames])
                if result is not None:
                    return result
            return None
        results = []
        for function, argnames in plan:
            result = function(*[kwargs[a] for a in argnames])
            if result is not None:
                results.append(result)
        return results
