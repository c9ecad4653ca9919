"""The patch registry: every change vllm-kvguard makes to vLLM, declared and undoable.

A :class:`Patch` declares (vllm-ascend style) what it changes, why, the vLLM range it
supports, the upstream issue and when to remove it:

* :class:`Target`: a class attribute or module function wrapped with wrapt at apply time;
* :class:`InstanceAttr`: an attribute set on individual vLLM objects at run time;
* :class:`ModuleGlobal`: a module global replaced at run time;
* :class:`ContainerItem`: items inserted into a vLLM container at run time;
* :class:`Private`: private vLLM names a patch or its fixes read or write.

Run-time changes go through the declaration's methods, which keep a ledger on the patch,
so :meth:`Patch.revert` undoes everything, :meth:`Patch.inventory` lists it and
:meth:`Patch.drift` checks every name on the installed vLLM.
"""
from __future__ import annotations

import sys
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import wrapt

from vllm_kvguard.log import logger
from vllm_kvguard.lookup import _MISSING, code_names, has_own, resolve, resolve_object
from vllm_kvguard.versions import in_range, vllm_version

class KvguardWrapper(wrapt.FunctionWrapper):
    """The marker type of every wrapper vllm-kvguard installs."""

    __kvguard_wrapper__ = True


def is_wrapped(obj: Any) -> bool:
    """Whether ``obj`` is a vllm-kvguard wrapper (also from a second copy of this module)."""
    return getattr(type(obj), "__kvguard_wrapper__", False) is True


# ---------------------------------------------------------------------------- declarations
@dataclass(frozen=True)
class Target:
    """A class attribute or module function, wrapped with ``wrapper`` at apply time."""

    module: str
    qualname: str
    wrapper: Callable
    also_at: tuple[str, ...] = ()   # modules that did ``from module import name``
    required: bool = True           # missing optional targets are skipped, with a log line
    versions: str = ""              # the vLLM releases that have it (a packaging specifier)

    @property
    def name(self) -> str:
        return f"{self.module}.{self.qualname}"

    def exists_in(self, version) -> bool:
        """Whether the installed vLLM is one that has this target (by declaration)."""
        return not self.versions or version is None or in_range(version, self.versions)

    def missing(self) -> str | None:
        """Its name when it is required and the installed vLLM lacks it."""
        return self.name if self.required and resolve(self.module, self.qualname) is None \
            else None


@dataclass(frozen=True)
class Private:
    """Private vLLM names (attributes, or locals read from a frame) a patch or its fixes
    rely on, on the class or function ``module:qualname``; ``versions`` limits where they
    are expected (a packaging specifier)."""

    module: str
    qualname: str
    names: tuple[str, ...]
    versions: str = ""

    @property
    def name(self) -> str:
        return f"{self.module}.{self.qualname}"

    def missing(self, version=None) -> list[str]:
        if self.versions and version is not None and not in_range(version, self.versions):
            return []
        obj = resolve_object(self.module, self.qualname)
        if obj is None:
            return [self.name]
        used = code_names(obj)
        return [f"{self.name}.{n}" for n in self.names
                if n not in used and not hasattr(obj, n)]


class _Change:
    """A run-time change declared by a patch; its methods keep the patch's ledger."""

    kind = "change"

    def __init__(self, module: str, qualname: str, attr: str, why: str,
                 required: bool = True, versions: str = ""):
        self.module, self.qualname, self.attr, self.why = module, qualname, attr, why
        self.required = required
        self.versions = versions     # the vLLM releases that have it ("" = all)
        self.patch: Patch | None = None

    def exists_in(self, version) -> bool:
        return not self.versions or version is None or in_range(version, self.versions)

    @property
    def name(self) -> str:
        return f"{self.module}.{self.qualname}.{self.attr}".replace("..", ".")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name})"

    def _ledger(self) -> dict:
        if self.patch is None:
            raise RuntimeError(f"{self!r} is not declared by a patch")
        return self.patch._ledger

    def missing(self) -> str | None:
        owner = resolve_object(self.module, self.qualname)
        if owner is None:
            return f"{self.module}.{self.qualname}"
        if isinstance(owner, type) and not hasattr(owner, self.attr) and \
                self.attr not in code_names(owner):
            return self.name
        if not isinstance(owner, type) and not hasattr(owner, self.attr):
            return self.name
        return None


class InstanceAttr(_Change):
    """An attribute of ``module:qualname`` (a class) set on single instances at run time,
    shadowing the class attribute for that object only; with ``overwrite`` a value the
    instance already owns (a config field) is replaced, and restored on revert."""

    kind = "instance attribute"

    def __init__(self, module: str, qualname: str, attr: str, why: str,
                 required: bool = True, overwrite: bool = False, versions: str = ""):
        super().__init__(module, qualname, attr, why, required, versions)
        self.overwrite = overwrite

    def set(self, obj, value) -> bool:
        """Give ``obj`` the instance attribute; False when it already has one not ours
        (unless ``overwrite``)."""
        ledger = self._ledger()
        key = (self, id(obj))
        entry = ledger.get(key)
        prior = _MISSING
        if entry is None and has_own(obj, self.attr):
            if not self.overwrite:
                return False
            prior = getattr(obj, self.attr)
        elif entry is not None:
            prior = entry[2][1]
        (setattr if self.overwrite else object.__setattr__)(obj, self.attr, value)
        ref = entry[1] if entry is not None else weakref.ref(
            obj, lambda _r, k=key: ledger.pop(k, None))
        ledger[key] = (self._undo, ref, (value, prior))
        return True

    def get(self, obj, default=None):
        """The value this declaration set on ``obj`` (default if none is in place)."""
        entry = self._ledger().get((self, id(obj)))
        if entry is None or entry[1]() is not obj:
            return default
        value = entry[2][0]
        return value if getattr(obj, self.attr, _MISSING) is value else default

    def unset(self, obj) -> bool:
        entry = self._ledger().pop((self, id(obj)), None)
        return entry is not None and self._undo(entry[1], entry[2])

    def _undo(self, ref, data) -> bool:
        obj = ref()
        value, prior = data
        if obj is None or getattr(obj, self.attr, _MISSING) is not value:
            return False
        if prior is _MISSING:
            object.__delattr__(obj, self.attr)
        else:
            setattr(obj, self.attr, prior)
        return True

    def objects(self) -> list:
        return [e[1]() for k, e in list(self._ledger().items())
                if k[0] is self and e[1]() is not None]


class ModuleGlobal(_Change):
    """A global of module ``module`` replaced at run time (``qualname`` is empty)."""

    kind = "module global"

    def __init__(self, module: str, attr: str, why: str, required: bool = True,
                 versions: str = ""):
        super().__init__(module, "", attr, why, required, versions)

    def replace(self, value) -> bool:
        mod = sys.modules.get(self.module) or resolve_object(self.module, "")
        if mod is None or not hasattr(mod, self.attr):
            return False
        ledger = self._ledger()
        if (self, None) not in ledger:
            ledger[(self, None)] = (self._undo, getattr(mod, self.attr), value)
        else:
            ledger[(self, None)] = (self._undo, ledger[(self, None)][1], value)
        setattr(mod, self.attr, value)
        return True

    def original(self, default=None):
        entry = self._ledger().get((self, None))
        return default if entry is None else entry[1]

    def restore(self) -> bool:
        entry = self._ledger().pop((self, None), None)
        return entry is not None and self._undo(entry[1], entry[2])

    def _undo(self, original, value) -> bool:
        mod = sys.modules.get(self.module)
        if mod is None or getattr(mod, self.attr, None) is not value:
            return False
        setattr(mod, self.attr, original)
        return True


class ContainerItem(_Change):
    """Items inserted into containers held by instances of ``module:qualname`` under
    ``attr`` (a list, or a dict of lists: ``path`` names the key)."""

    kind = "container item"

    def insert(self, owner, index: int, item, path: tuple = ()) -> None:
        container = self._container(owner, path)
        container.insert(index, item)
        ledger = self._ledger()
        key = (self, id(owner), id(item))
        ref = weakref.ref(owner, lambda _r, k=key: ledger.pop(k, None))
        ledger[key] = (self._undo, ref, (path, item))

    def remove(self, owner, item) -> bool:
        entry = self._ledger().pop((self, id(owner), id(item)), None)
        return entry is not None and self._undo(entry[1], entry[2])

    def _container(self, owner, path):
        container = getattr(owner, self.attr)
        for key in path:
            container = container[key]
        return container

    def _undo(self, ref, data) -> bool:
        owner = ref()
        if owner is None:
            return False
        path, item = data
        try:
            container = self._container(owner, path)
        except (AttributeError, KeyError, IndexError):
            return False
        for i, x in enumerate(container):
            if x is item:
                del container[i]
                return True
        return False


# ---------------------------------------------------------------------------- patches
@dataclass
class Patch:
    name: str
    summary: str
    targets: list[Target]
    vllm_versions: str              # packaging specifier, e.g. ">=0.27.1,<0.34"
    upstream: tuple[str, ...]       # vLLM issues/PRs it mitigates
    remove_when: str
    changes: tuple = ()             # InstanceAttr / ModuleGlobal / ContainerItem
    uses: tuple = ()                # Private
    setup: Callable[[Any], None] | None = None   # at the first wrap, with the flags
    teardown: Callable[[], None] | None = None   # at revert, if setup ran
    _installed: list = field(default_factory=list, repr=False)
    _ledger: dict = field(default_factory=dict, repr=False)
    _active: bool = field(default=False, repr=False)
    _generation: int = field(default=0, repr=False)
    _set_up: bool = field(default=False, repr=False)
    _flags: Any = field(default=None, repr=False)

    def __post_init__(self):
        for change in self.changes:
            if change.patch is not None and change.patch is not self:
                raise ValueError(f"{change!r} is declared by patch {change.patch.name!r}")
            change.patch = self

    @property
    def applied(self) -> bool:
        return self._active

    def supports(self, version) -> bool:
        return in_range(version, self.vllm_versions)

    def targets_in(self, version=None) -> list[Target]:
        """The targets the installed vLLM has by declaration (``Target.versions``)."""
        version = version if version is not None else vllm_version()
        return [t for t in self.targets if t.exists_in(version)]

    def absent_by_declaration(self, version=None) -> list[str]:
        """Targets this patch declares gone from the installed vLLM (never wrapped,
        never claimed)."""
        version = version if version is not None else vllm_version()
        return [t.name for t in self.targets if not t.exists_in(version)]

    def missing_targets(self, version=None) -> list[str]:
        """Required targets absent from the installed vLLM."""
        return [t.name for t in self.targets_in(version) if t.missing()]

    def _checked(self, version=None) -> list:
        """What the drift guard checks, each naming its ``module``: the targets and
        required change sites the installed vLLM has by declaration, the private names."""
        current = version if version is not None else vllm_version()
        return (self.targets_in(version)
                + [c for c in self.changes if c.required and c.exists_in(current)]
                + list(self.uses))

    def modules(self, version=None) -> set[str]:
        """The vLLM modules holding the names :meth:`drift` checks."""
        return {d.module for d in self._checked(version)}

    def drift(self, version=None, modules=None) -> list[str]:
        """Every required name of this patch the installed vLLM lacks (the drift guard):
        wrapped targets, run-time change sites and private names; only those of
        ``modules`` (module names) if given, else all (importing their modules)."""
        missing = []
        for d in self._checked(version):
            if modules is not None and d.module not in modules:
                continue
            if isinstance(d, Private):
                missing += d.missing(version)
            elif (m := d.missing()):        # a Target or a required change site
                missing.append(m)
        return list(dict.fromkeys(missing))     # a missing class is named once

    def inventory(self) -> list[tuple[str, str, Any]]:
        """(kind, declared name, vLLM object) of every change in place right now."""
        rows = [("wrapped", f"{getattr(p, '__name__', p)}.{a}", p)
                for p, a, _orig, _own in self._installed]
        for key, (undo, ref, _value) in list(self._ledger.items()):
            change = key[0]
            obj = ref() if isinstance(ref, weakref.ref) else sys.modules.get(change.module)
            if obj is not None:
                rows.append((change.kind, change.name, obj))
        return rows

    def apply(self, flags=None) -> list[str]:
        """Wrap every target; return notes (optional targets absent, targets deferred).

        Idempotent. Targets whose module vLLM has already imported are wrapped now; the
        others when vLLM imports that module (a wrapt post-import hook), so activation
        never imports vLLM modules a process would not load itself. Raises LookupError
        (naming the target) if a required target of a loaded module is missing; nothing
        is left wrapped then. A required target found missing later, at import, reverts
        the whole patch with one warning.
        """
        if self._active:
            return []
        targets = self.targets_in()
        loaded = [t for t in targets if t.module in sys.modules]
        missing = [t.name for t in loaded
                   if t.required and resolve(t.module, t.qualname) is None]
        if missing:
            raise LookupError(f"target(s) missing in this vLLM: {', '.join(missing)}")
        self._flags = flags
        self._active = True
        self._generation += 1
        notes, deferred = [], 0
        try:
            for t in targets:
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
                self.setup(self._flags)
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

    def undo_runtime(self) -> None:
        """Undo every run-time change (instance attributes, globals, container items)."""
        for _key, (undo, ref, value) in reversed(list(self._ledger.items())):
            undo(ref, value)
        self._ledger.clear()

    def revert(self) -> None:
        self._active = False
        if self._set_up:
            self._set_up = False
            if self.teardown:
                self.teardown()
        self.undo_runtime()
        while self._installed:
            parent, attr, original, had_own = self._installed.pop()
            if had_own:
                setattr(parent, attr, original)
            else:                       # inherited method: drop the subclass attribute
                delattr(parent, attr)
