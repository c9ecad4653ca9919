"""Finding vLLM's objects by name, without changing them (the registry's lookups)."""
from __future__ import annotations

import importlib
from typing import Any

_MISSING = object()


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


def resolve_object(module: str, qualname: str):
    """The object ``module:qualname`` names (a class, function or module), or None."""
    obj = _import(module)
    for part in filter(None, qualname.split(".")):
        obj = getattr(obj, part, None) if obj is not None else None
    return obj


def code_names(obj) -> set[str]:
    """Attribute and local names used in the code of ``obj`` (a function, or every
    function of a class and its vLLM bases), nested code included."""
    codes = []
    if isinstance(obj, type):
        for klass in obj.__mro__:
            for value in vars(klass).values():
                fn = getattr(value, "__func__", value)
                fn = getattr(fn, "fget", fn)
                code = getattr(getattr(fn, "__wrapped__", fn), "__code__", None)
                if code is not None:
                    codes.append(code)
    else:
        code = getattr(getattr(obj, "__wrapped__", obj), "__code__", None)
        if code is not None:
            codes.append(code)
    names: set[str] = set()
    while codes:
        code = codes.pop()
        names.update(code.co_names, code.co_varnames)
        codes.extend(c for c in code.co_consts if hasattr(c, "co_names"))
    return names


def has_own(obj, name: str) -> bool:
    """Whether ``obj`` has an instance value ``name``, without reading ``obj.__dict__``.

    (On CPython 3.11 reading an object's ``__dict__`` materialises it for good and slows
    every later attribute load and method call on it; vLLM's KV objects are hot.) A
    descriptor binds a fresh object on every access; an instance value is the same one.
    """
    value = getattr(obj, name, _MISSING)
    if value is _MISSING:
        return False
    cls = type(obj)
    for klass in cls.__mro__:
        if name in vars(klass):
            cls_attr = vars(klass)[name]
            break
    else:
        return True
    get = getattr(type(cls_attr), "__get__", None)
    if get is None:
        return value is not cls_attr
    if value is not getattr(obj, name, _MISSING):
        return False
    return value is not get(cls_attr, obj, cls)
