"""Small helpers shared by the benchmarks, tolerant of plugin builds with and without the
allocator transaction's C accelerator (``vllm_kvguard._txn``) and ``KVGUARD_PURE_PYTHON``."""
from __future__ import annotations

import importlib.util
import os

_ON = ("1", "on", "true", "yes")


def env_pure_python() -> bool:
    """``KVGUARD_PURE_PYTHON`` set in this process's environment."""
    return os.environ.get("KVGUARD_PURE_PYTHON", "").strip().lower() in _ON


def has_c_accelerator() -> bool:
    try:
        return importlib.util.find_spec("vllm_kvguard._txn") is not None
    except (ImportError, ValueError):
        return False


def knows_pure_python_flag() -> bool:
    try:
        from vllm_kvguard.flags import Flags
    except ImportError:
        return False
    return "pure_python" in getattr(Flags, "__dataclass_fields__", {})


def transaction_form(pure_python: bool) -> str:
    """Which form of the allocator transaction "on" runs."""
    if not has_c_accelerator():
        note = "; --pure-python/KVGUARD_PURE_PYTHON ignored" if pure_python else ""
        return f"Python (no C accelerator in this build{note})"
    if pure_python and knows_pure_python_flag():
        return "pure Python (KVGUARD_PURE_PYTHON=1)"
    if pure_python:
        return "C accelerator (KVGUARD_PURE_PYTHON unknown to this build: ignored)"
    return "C accelerator (vllm_kvguard._txn)"
