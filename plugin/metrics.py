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
front end, which adds the other processes' counters fetched through vLLM's own
``collective_rpc`` (:mod:`vllm_kvguard.remote`) to its own. A process that is gone is
simply not asked: its gauges disappear with it.

The directory ``KVGUARD_METRICS_DIR`` carries only the admission certificate from
EngineCore to the front end on the same node. The first front-end process makes it
(workers never do) and removes it at exit; a creator that was killed cannot, so the next
one removes every ``kvguard-metrics-<pid>-*`` directory of the temp dir whose ``<pid>`` is gone.

Limit: with ``--api-server-count`` > 1 vLLM serves only prometheus_client's multiprocess
files, which this collector does not write; the counters are then in the logs only.
"""
from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import threading
from collections import defaultdict

ENV_DIR = "KVGUARD_METRICS_DIR"
FALLBACK_METRIC = "kvguard_cudagraph_fallbacks"
EVENTS_METRIC = "kvguard_events"
REFRESH_METRIC = "kvguard_remote_refreshes"
PREFIX = "kvguard-metrics-"

_lock = threading.Lock()
_state: dict = {"dir": None, "created": False, "collector": None, "registry": None,
                "atexit": False}


FALLBACK_CATEGORY = "cudagraph_fallback"


def _fallback_reasons() -> tuple[str, tuple[str, ...]]:
    from vllm_kvguard import report

    return FALLBACK_CATEGORY, report.declared().get(FALLBACK_CATEGORY, ())


class KvguardCollector:
    """A prometheus_client collector over every process's vllm-kvguard counters."""

    def describe(self):
        return self._families({})

    def collect(self):
        from vllm_kvguard import remote

        others = remote.entries()
        families = self._families(totals(others), gauge_totals(others))
        refreshes = remote.refreshes()
        if refreshes is not None:
            from prometheus_client.core import CounterMetricFamily

            families.append(CounterMetricFamily(
                REFRESH_METRIC, "Completed fetches of the engine processes' vllm-kvguard "
                "counters (vllm-kvguard)", value=float(refreshes)))
        return families

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


def setup(registry=None, make_dir: bool = True) -> None:
    """Create/inherit the certificate directory (``make_dir``: this process may create
    it; workers may not) and register the collector. Idempotent."""
    with _lock:
        if _state["collector"] is not None:
            return
        directory = os.environ.get(ENV_DIR)
        if (not directory or not os.path.isdir(directory)) and make_dir:
            sweep_stale()
            directory = tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-")
            os.environ[ENV_DIR] = directory
            _state["created"] = True
        elif not directory or not os.path.isdir(directory):
            directory = None
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
    """Unregister the collector, forget the engines, remove a directory this process made."""
    from vllm_kvguard import remote

    remote.reset()
    with _lock:
        if _state["collector"] is not None:
            try:
                _state["registry"].unregister(_state["collector"])
            except KeyError:
                pass
        if _state["created"] and _state["dir"]:
            shutil.rmtree(_state["dir"], ignore_errors=True)
            if os.environ.get(ENV_DIR) == _state["dir"]:
                del os.environ[ENV_DIR]
        _state.update(dir=None, created=False, collector=None, registry=None)


def totals(others: list[dict] | None = None) -> dict[str, dict[str, int]]:
    """Counters of every process: this one's live state plus the others' entries
    (``others``: :func:`vllm_kvguard.remote.entries`, fetched when not given)."""
    from vllm_kvguard import remote, report

    if others is None:
        others = remote.entries()
    return _merged(report.snapshot(), [e.get("counts") or {} for e in others])


def gauge_totals(others: list[dict] | None = None) -> dict[str, dict[str, int]]:
    """Gauges summed over every process that answers (each EngineCore's waiting requests
    add up; a process that is gone no longer answers)."""
    from vllm_kvguard import remote, report

    if others is None:
        others = remote.entries()
    return _merged(report.gauges(), [e.get("gauges") or {} for e in others])


def _merged(own: dict, others: list[dict]) -> dict[str, dict[str, int]]:
    merged: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for snap in [own, *others]:
        for cat, reasons in snap.items():
            for reason, n in reasons.items():
                merged[cat][reason] += int(n)
    return {cat: dict(r) for cat, r in merged.items()}


def _at_exit() -> None:
    if _state["created"] and _state["dir"]:
        shutil.rmtree(_state["dir"], ignore_errors=True)
