"""How many generated cases a unit test runs on this pin: all, or the core set.

``scripts/matrix.py`` sets ``KVGUARD_CASES=core`` on the pins ``pins.txt`` marks
``cases=core`` (the older ones), so CI stays inside its time budget; those pins still run
every test, each on its core cases (one per layer kind and setting) against their vLLM.
Unset (a developer's run, the default and newest pins): every case.
"""
from __future__ import annotations

import os

ENV = "KVGUARD_CASES"


def core_only() -> bool:
    """Whether this run takes only the core cases."""
    return os.environ.get(ENV, "all") == "core"


def pick(every: list, core: list) -> list:
    """``core`` on a core-cases pin, else ``every``."""
    return core if core_only() else every
