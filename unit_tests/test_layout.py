"""The layout rules, checked on the source: no import circles, fixes never import
activation or the patches, the core imports no tool, the shipped tools import no test
scaffolding, the self-tests import no tool, no source file over 500 lines."""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIX_GROUPS = ("transaction", "estimation", "cudagraph", "containment", "health")
#: Every folder of tools/ that is a package (one per command of several files).
TOOL_GROUPS = sorted(p.parent.name for p in (ROOT / "plugin/tools").glob("*/__init__.py"))
FOLDERS = {"plugin": "vllm_kvguard", "plugin/fixes": "vllm_kvguard.fixes",
           **{f"plugin/fixes/{g}": f"vllm_kvguard.fixes.{g}" for g in FIX_GROUPS},
           "plugin/tools": "vllm_kvguard.tools",
           **{f"plugin/tools/{g}": f"vllm_kvguard.tools.{g}" for g in TOOL_GROUPS},
           "plugin/testing": "vllm_kvguard.testing", "patches": "vllm_kvguard.patches"}


def modules() -> dict[str, Path]:
    found = {}
    for folder, package in FOLDERS.items():
        for path in sorted((ROOT / folder).glob("*.py")):
            name = package if path.stem == "__init__" else f"{package}.{path.stem}"
            found[name] = path
    return found


def imports(path: Path, name: str) -> set[str]:
    """Every vllm_kvguard module ``path`` imports, at any depth of its code."""
    package = name if path.stem == "__init__" else name.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)
    return {m for m in out if m.startswith("vllm_kvguard")}


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: {m for m in imports(path, name) if m in mods and m != name}
            for name, path in mods.items()}


def test_no_import_circles():
    g = graph()
    # A package __init__ importing its own submodules is not a circle.
    edges = {a: {b for b in bs if not (a.count(".") < b.count(".") and b.startswith(a + "."))}
             for a, bs in g.items()}
    state: dict[str, int] = {}
    cycles = []

    def visit(node, stack):
        state[node] = 1
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node, [node])
    assert not cycles, "import circles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_fixes_import_neither_activation_nor_patches():
    for name, deps in graph().items():
        if name.startswith("vllm_kvguard.fixes"):
            bad = {d for d in deps if d == "vllm_kvguard.activation"
                   or d.startswith("vllm_kvguard.patches") or d.startswith("vllm_kvguard.tools")}
            assert not bad, f"{name} imports {sorted(bad)}"


def test_the_core_imports_no_tool():
    for name, deps in graph().items():
        if not name.startswith(("vllm_kvguard.tools", "vllm_kvguard.testing")):
            bad = {d for d in deps if d.startswith(("vllm_kvguard.tools",
                                                    "vllm_kvguard.testing"))}
            assert not bad, f"{name} imports {sorted(bad)}"


def _module_strings(path: Path) -> set[str]:
    """String constants that name a vllm_kvguard module (``importlib.import_module``, the
    ``module:function`` tables, ``python -m`` arguments)."""
    return {n.value.split(":")[0] for n in ast.walk(ast.parse(path.read_text()))
            if isinstance(n, ast.Constant) and isinstance(n.value, str)
            and re.fullmatch(r"vllm_kvguard(\.\w+)+(:\w+)?", n.value)}


def _imports_under(folder: str, package: str, prefix: str,
                   root: Path = ROOT) -> dict[str, set[str]]:
    """For every .py under ``folder`` (any depth): the modules under ``prefix`` it imports,
    by any import statement at any depth of its code, or names in a string."""
    found = {}
    for path in sorted((root / folder).rglob("*.py")):
        rel = path.relative_to(root / folder).with_suffix("").parts
        name = ".".join((package, *rel[:-1]) if rel[-1] == "__init__" else (package, *rel))
        bad = {m for m in imports(path, name) | _module_strings(path)
               if m == prefix or m.startswith(prefix + ".")}
        if bad:
            found[str(path.relative_to(root))] = bad
    return found


def test_the_tools_import_no_test_scaffolding():
    """The shipped commands (``kvguard demo``, ``kvguard ab``...) run from a wheel without
    the test scaffolding: nothing under tools/ imports vllm_kvguard.testing, even inside a
    function."""
    assert not _imports_under("plugin/tools", "vllm_kvguard.tools", "vllm_kvguard.testing")


def test_the_self_tests_import_no_tool():
    """verify/ runs inside the engine's processes; the operator tools are not its
    dependency."""
    assert not _imports_under("plugin/verify", "vllm_kvguard.verify", "vllm_kvguard.tools")


def test_the_scan_sees_an_import_inside_a_function(tmp_path):
    tool = tmp_path / "plugin" / "tools" / "x"
    tool.mkdir(parents=True)
    (tool / "__init__.py").write_text("")
    (tool / "door.py").write_text(
        "def child():\n    from vllm_kvguard.testing.kv_fixtures import make_scheduler\n")
    (tool / "table.py").write_text('RUN = {"x": "vllm_kvguard.testing.scripts:main"}\n')
    (tool / "rel.py").write_text("def f():\n    from ...testing import kv_fixtures\n")
    found = _imports_under("plugin/tools", "vllm_kvguard.tools", "vllm_kvguard.testing",
                           root=tmp_path)
    assert set(found) == {"plugin/tools/x/door.py", "plugin/tools/x/table.py",
                          "plugin/tools/x/rel.py"}, found


def test_no_source_file_over_500_lines():
    long = {str(p.relative_to(ROOT)): n for p in modules().values()
            if (n := len(p.read_text().splitlines())) > 500}
    assert not long, long


def test_the_check_sees_a_circle(tmp_path):
    a = tmp_path / "a.py"
    a.write_text("from vllm_kvguard import b\n")
    assert imports(a, "vllm_kvguard.a") == {"vllm_kvguard", "vllm_kvguard.b"}
