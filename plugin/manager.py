"""The plugin manager: our hookspecs, our fixes, and third-party hookimpls."""
from __future__ import annotations

import pluggy

from vllm_kvguard import hookspecs

ENTRY_POINT_GROUP = "vllm_kvguard.hooks"

_pm: pluggy.PluginManager | None = None


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


def unregister(name: str) -> None:
    pm = get_plugin_manager()
    if pm.get_plugin(name) is not None:
        pm.unregister(name=name)
