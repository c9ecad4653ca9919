"""Counters every fix reports into, and the per-process report.

``count("rollback", "ValueError")`` is cheap (a dict update under a lock) and works in
every process; :func:`snapshot` returns ``{"category": {"reason": n}}``. Exporting them
(Prometheus, the A/B tool's JSON) reads :func:`snapshot`. Gauges (``set_gauge``: a
current value per label, replaced as a whole) sit beside them, read by :func:`gauges`.
"""
from __future__ import annotations

import contextlib
import threading
from collections import defaultdict

_lock = threading.Lock()
_counters: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
_listeners: list = []
_declared: dict[str, tuple[str, ...]] = {}
_gauges: dict[str, dict[str, int]] = {}


def count(category: str, reason: str = "total", n: int = 1) -> None:
    with _lock:
        _counters[category][reason] += n
    for listener in _listeners:
        listener()


def set_gauge(name: str, values: dict[str, int]) -> None:
    """Replace gauge ``name``'s values (``{label: n}``); listeners hear of a change."""
    values = {k: int(v) for k, v in values.items()}
    with _lock:
        if _gauges.get(name) == values:
            return
        _gauges[name] = values
    for listener in _listeners:
        listener()


def gauges() -> dict[str, dict[str, int]]:
    with _lock:
        return {name: dict(values) for name, values in _gauges.items()}


def declare(category: str, reasons: tuple[str, ...]) -> None:
    """Name a category's reasons up front, so exports show them at 0 from startup."""
    _declared[category] = tuple(reasons)


def declared() -> dict[str, tuple[str, ...]]:
    return dict(_declared)


def on_change(listener) -> None:
    """Call ``listener()`` after every :func:`count` (the metrics export uses it)."""
    if listener not in _listeners:
        _listeners.append(listener)


def remove_listener(listener) -> None:
    if listener in _listeners:
        _listeners.remove(listener)


def snapshot() -> dict[str, dict[str, int]]:
    with _lock:
        return {cat: dict(reasons) for cat, reasons in _counters.items()}


def reset_counters() -> None:
    with _lock:
        _counters.clear()
        _gauges.clear()


@contextlib.contextmanager
def scratch():
    """Counters and gauges as they were before the block (a self-test's rollbacks and
    contained errors are not the engine's)."""
    with _lock:
        counters = {cat: dict(reasons) for cat, reasons in _counters.items()}
        gauges = {name: dict(values) for name, values in _gauges.items()}
    try:
        yield
    finally:
        with _lock:
            _counters.clear()
            for cat, reasons in counters.items():
                _counters[cat].update(reasons)
            _gauges.clear()
            _gauges.update(gauges)
