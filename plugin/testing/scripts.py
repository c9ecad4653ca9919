"""The checkout's ``scripts/`` files loaded as modules for tests (they are not installed):
``load("ab")`` is ``scripts/ab.py``, its sibling imports (``import venvs``) resolved."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent.parent.parent / "scripts"


def load(name: str):
    key = f"kvguard_scripts_{name}"
    if key in sys.modules:
        return sys.modules[key]
    spec = importlib.util.spec_from_file_location(key, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[key] = module             # dataclasses look their module up
    if str(SCRIPTS) not in sys.path:
        sys.path.append(str(SCRIPTS))
    spec.loader.exec_module(module)
    return module
