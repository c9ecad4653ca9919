"""Prometheus export of vllm-kvguard's counters through vLLM's own metrics path.

vLLM's OpenAI server serves prometheus_client's default registry on ``/metrics``
(``vllm.v1.metrics.prometheus.get_prometheus_registry``), and ``LLM.get_metrics()`` reads
the same registry. :func:`setup` registers one collector there (no HTTP server of ours):

``kvguard_cudagraph_fallbacks_total{reason=...}``
    every reason the fallback accounting declares (``report.declare``), at 0 from startup
``kvguard_events_total{category=..., reason=...}``
    every other :func:`vllm_kvguard.report.count` category
``kvguard_waiting_requests{cause=...}`` (a gauge; likewise any :func:`report.set_gauge`)
    requests the liveness guard sees waiting, not failed, by cause
``kvguard_active_processes{role=...}`` (a gauge)
    processes with the plugin active, by role (``worker``: one per TP/PP rank)

Counts happen where vLLM runs the code (EngineCore, workers); ``/metrics`` is served by the
API server process. Each process that counts writes its :func:`report.snapshot` to
``<KVGUARD_METRICS_DIR>/<pid>.json`` (gauges: ``<pid>.gauges``; atomically, at most once a second via a one-shot
timer, and at exit); the directory is created by the first process that activates the
plugin and inherited by the processes it starts (an internal variable, like vLLM's own
``PROMETHEUS_MULTIPROC_DIR``). At scrape time the collector adds the other processes'
files to its own live counters; a gauge file of a process that is gone is left out.

The creator removes the directory at exit. A creator that is killed (SIGKILL, a Ray
worker ended without exit handlers) cannot: the next process that creates one removes
every ``kvguard-metrics-<pid>-*`` directory of the temp dir whose ``<pid>`` is gone.

Limit: with ``--api-server-count`` > 1 vLLM serves only prometheus_client's multiprocess
files, which this collector does not write; the counters are then in the logs only.
"""
from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile
import threading
import time
from collections import defaultdict

ENV_DIR = "KVGUARD_METRICS_DIR"
FLUSH_INTERVAL_S = 1.0
FALLBACK_METRIC = "kvguard_cudagraph_fallbacks"
EVENTS_METRIC = "kvguard_events"
GAUGE_SUFFIX = ".gauges"
PREFIX = "kvguard-metrics-"

_lock = threading.Lock()
_state: dict = {"dir": None, "created": False, "collector": None, "registry": None,
                "last_flush": 0.0, "timer": None, "atexit": False}


FALLBACK_CATEGORY = "cudagraph_fallback"


def _fallback_reasons() -> tuple[str, tuple[str, ...]]:
    from vllm_kvguard import report

    return FALLBACK_CATEGORY, report.declared().get(FALLBACK_CATEGORY, ())


class KvguardCollector:
    """A prometheus_client collector over every process's vllm-kvguard counters."""

    def describe(self):
        return self._families({})

    def collect(self):
        return self._families(totals(), gauge_totals())

    @staticmethod
    def _families(counts: dict, gauges: dict | None = None):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        category, reasons = _fallback_reasons()
        fallbacks = CounterMetricFamily(
            FALLBACK_METRIC, "Batches the CUDA-graph configuration meant to graph that ran "
            "eager or PIECEWISE, by reason (vllm-kvguard)", labels=["reason"])
        seen = counts.get(category, {})
        for reason in sorted(set(reasons) | set(seen)):
            fallbacks.add_metric([reason], float(seen.get(reason, 0)))
        events = CounterMetricFamily(EVENTS_METRIC, "vllm-kvguard events by category and "
                                     "reason", labels=["category", "reason"])
        for cat in sorted(counts):
            if cat != category:
                for reason, n in sorted(counts[cat].items()):
                    events.add_metric([cat, reason], float(n))
        families = [fallbacks, events]
        for name, values in sorted((gauges or {}).items()):
            family = GaugeMetricFamily(f"kvguard_{name}", f"vllm-kvguard {name} (gauge)",
                                       labels=[GAUGE_LABELS.get(name, "label")])
            for label, n in sorted(values.items()):
                family.add_metric([label], float(n))
            families.append(family)
        return families


GAUGE_LABELS = {"waiting_requests": "cause", "active_processes": "role"}


def setup(registry=None) -> None:
    """Create/inherit the snapshot directory and register the collector. Idempotent."""
    with _lock:
        if _state["collector"] is not None:
            return
        directory = os.environ.get(ENV_DIR)
        if not directory or not os.path.isdir(directory):
            sweep_stale()
            directory = tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-")
            os.environ[ENV_DIR] = directory
            _state["created"] = True
        _state["dir"] = directory
        if not _state["atexit"]:
            atexit.register(_at_exit)
            _state["atexit"] = True
        try:
            if registry is None:
                from prometheus_client import REGISTRY as registry
        except ImportError:
            return
        collector = KvguardCollector()
        registry.register(collector)
        _state["collector"], _state["registry"] = collector, registry
    from vllm_kvguard import report

    report.on_change(changed)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:              # another user's process: alive
        return True
    except OSError:
        return False
    return True


def sweep_stale(parent: str | None = None) -> list[str]:
    """Remove snapshot directories whose creator is gone; return their paths."""
    parent = parent or tempfile.gettempdir()
    removed = []
    try:
        names = os.listdir(parent)
    except OSError:
        return removed
    for name in names:
        pid = name[len(PREFIX):].partition("-")[0]
        if not name.startswith(PREFIX) or not pid.isdigit() or int(pid) == os.getpid():
            continue
        path = os.path.join(parent, name)
        try:
            if os.stat(path).st_uid != os.getuid() or _alive(int(pid)):
                continue
        except OSError:
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def directory() -> str | None:
    """The snapshot directory of this process tree (None before :func:`setup`)."""
    return _state["dir"] or os.environ.get(ENV_DIR) or None


def teardown() -> None:
    """Unregister the collector, stop the timer, remove a directory this process made."""
    from vllm_kvguard import report

    report.remove_listener(changed)
    with _lock:
        if _state["collector"] is not None:
            try:
                _state["registry"].unregister(_state["collector"])
            except KeyError:
                pass
        timer = _state["timer"]
        if timer is not None:
            timer.cancel()
    if timer is not None and timer is not threading.current_thread():
        timer.join(timeout=5)              # a flush already running finishes first
    with _lock:
        if _state["created"] and _state["dir"]:
            shutil.rmtree(_state["dir"], ignore_errors=True)
            if os.environ.get(ENV_DIR) == _state["dir"]:
                del os.environ[ENV_DIR]
        _state.update(dir=None, created=False, collector=None, registry=None, timer=None,
                      last_flush=0.0)


def changed() -> None:
    """A counter changed: publish this process's snapshot within ``FLUSH_INTERVAL_S``."""
    if _state["dir"] is None:
        return
    wait = FLUSH_INTERVAL_S - (time.monotonic() - _state["last_flush"])
    if wait <= 0:
        flush()
        return
    with _lock:
        if _state["timer"] is None:
            timer = threading.Timer(wait, _timer_flush)
            timer.daemon = True
            _state["timer"] = timer
            timer.start()


def _timer_flush() -> None:
    with _lock:
        _state["timer"] = None
    flush()


def flush() -> None:
    """Write this process's counters to ``<dir>/<pid>.json`` (atomic replace)."""
    from vllm_kvguard import report

    directory = _state["dir"]
    _state["last_flush"] = time.monotonic()
    if directory is None:
        return
    for data, suffix in ((report.snapshot(), ".json"), (report.gauges(), GAUGE_SUFFIX)):
        if data:
            _write(os.path.join(directory, f"{os.getpid()}{suffix}"), data)


def _write(path: str, data: dict) -> None:
    try:
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f)
        os.replace(tmp, path)
    except OSError:
        pass                       # the directory went away (shutdown): nothing to publish


def totals() -> dict[str, dict[str, int]]:
    """Counters of every process: the other processes' files plus this one's live state."""
    from vllm_kvguard import report

    return _merged(".json", report.snapshot())


def gauge_totals() -> dict[str, dict[str, int]]:
    """Gauges summed over every process (each EngineCore's waiting requests add up)."""
    from vllm_kvguard import report

    return _merged(GAUGE_SUFFIX, report.gauges())


def _merged(suffix: str, own_data: dict) -> dict[str, dict[str, int]]:
    merged: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    directory = _state["dir"]
    own = f"{os.getpid()}{suffix}"
    if directory:
        try:
            names = os.listdir(directory)
        except OSError:
            names = []
        for name in names:
            if not name.endswith(suffix) or name == own:
                continue
            pid = name[:-len(suffix)]
            if suffix == GAUGE_SUFFIX and pid.isdigit() and not _alive(int(pid)):
                continue                 # a current value of a process that is gone
            try:
                with open(os.path.join(directory, name)) as f:
                    snap = json.load(f)
            except (OSError, ValueError):
                continue
            for cat, reasons in snap.items():
                for reason, n in reasons.items():
                    merged[cat][reason] += int(n)
    for cat, reasons in own_data.items():
        for reason, n in reasons.items():
            merged[cat][reason] += n
    return {cat: dict(r) for cat, r in merged.items()}


def _at_exit() -> None:
    flush()
    if _state["created"] and _state["dir"]:
        shutil.rmtree(_state["dir"], ignore_errors=True)
