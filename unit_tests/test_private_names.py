"""Every private vLLM name our code touches is declared, so the drift guard checks it.

The source of the plugin (core, fixes, patches; not the operator tools) is read as a
syntax tree: each ``obj._name`` and each ``"_name"`` given to getattr/hasattr/setattr that
our own code does not define must appear in some patch's ``uses`` (``Private``) or be the
attribute of a declared run-time change. ``test_drift`` then checks those on every pin.
"""
from __future__ import annotations

import ast
from pathlib import Path

from vllm_kvguard.patches import ALL_PATCHES

ROOT = Path(__file__).resolve().parent.parent
SOURCES = sorted(p for d in ("plugin", "patches") for p in (ROOT / d).rglob("*.py")
                 if not {"tools", "testing"} & set(p.relative_to(ROOT).parts))
#: Private names of Python itself and of libraries other than vLLM.
NOT_VLLM = {"_getframe", "_asdict", "_replace", "_fields", "_self_wrapper", "_exit",
            "_ray_actor_creation_function_descriptor"}    # Ray's: an actor's class name


def _names(tree) -> tuple[set[str], set[str]]:
    """(private names used as attributes or getattr strings, names our code defines)."""
    used, defined = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") \
                and not node.attr.startswith("__"):
            (defined if isinstance(node.ctx, ast.Store) and isinstance(node.value, ast.Name)
             and node.value.id in ("self", "cls") else used).add(node.attr)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            defined.add(node.id)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            defined.add(node.target.id)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                node.func.id in ("getattr", "hasattr", "setattr", "own", "has_own") and \
                len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and \
                isinstance(node.args[1].value, str) and node.args[1].value.startswith("_") \
                and not node.args[1].value.startswith("__"):
            used.add(node.args[1].value)
        elif isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "__slots__" for t in node.targets):
            defined.update(e.value for e in ast.walk(node.value)
                           if isinstance(e, ast.Constant) and isinstance(e.value, str))
    return used, defined


def test_every_private_vllm_name_is_declared():
    used, defined = set(), set()
    for path in SOURCES:
        u, d = _names(ast.parse(path.read_text(), str(path)))
        used |= u
        defined |= d
    declared = {n for p in ALL_PATCHES for private in p.uses for n in private.names}
    declared |= {c.attr for p in ALL_PATCHES for c in p.changes}
    undeclared = sorted(used - defined - declared - NOT_VLLM)
    assert not undeclared, (
        f"private vLLM names used but declared by no patch's uses=(Private(...)): "
        f"{', '.join(undeclared)}")


def test_the_scan_sees_what_it_should():
    used, defined = _names(ast.parse(
        "class A:\n    def f(self, m):\n        self._mine = 1\n"
        "        return m._theirs, getattr(m, '_other', None)\n"))
    assert {"_theirs", "_other"} <= used and "_mine" in defined
