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
``kvguard_seconds_since_step{engine=...}``, ``kvguard_engine_wedged{engine=..., cause=...}``,
``kvguard_longest_step_seconds{engine=...}``, ``kvguard_health_unhealthy{reason=...}``
    (gauges; ``health`` patch) per EngineCore (``engine``: its data-parallel rank):
    seconds it has held work without completing a step (0 idle), whether its queue is
    wedged and why, its longest step; whether ``/health`` answers 503 and why
    (:mod:`vllm_kvguard.fixes.health.verdict`)

Counts happen where vLLM runs the code (EngineCore, workers); ``/metrics`` is served by the
front end, which adds the other processes' counters fetched through vLLM's own
``collective_rpc`` (:mod:`vllm_kvguard.remote`) to its own. A process that is gone is
simply not asked: its gauges disappear with it.

No file and no directory: the admission limits travel in the same reply (JSON numbers).

Limit: with ``--api-server-count`` > 1 vLLM serves only prometheus_client's multiprocess
files, which this collector does not write; the counters are then in the logs only.
"""
from __future__ import annotations

import threading
from collections import defaultdict

FALLBACK_METRIC = "kvguard_cudagraph_fallbacks"
EVENTS_METRIC = "kvguard_events"
REFRESH_METRIC = "kvguard_remote_refreshes"

_lock = threading.Lock()
_state: dict = {"collector": None, "registry": None}


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
        families.extend(health_families())
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


def health_families() -> list:
    """The health verdict's gauges, per EngineCore (none while the patch is off)."""
    import sys

    verdict = sys.modules.get("vllm_kvguard.fixes.health.verdict")
    if verdict is None or verdict.live() is None:
        return []
    from prometheus_client.core import GaugeMetricFamily

    since = GaugeMetricFamily("kvguard_seconds_since_step", "Seconds EngineCore has held "
                              "work without completing a step, 0 when idle (vllm-kvguard)",
                              labels=["engine"])
    wedged = GaugeMetricFamily("kvguard_engine_wedged", "1 while EngineCore's queue is "
                               "wedged for this cause (vllm-kvguard)", labels=["engine", "cause"])
    longest = GaugeMetricFamily("kvguard_longest_step_seconds", "EngineCore's longest step "
                                "with work so far (vllm-kvguard)", labels=["engine"])
    unhealthy = GaugeMetricFamily("kvguard_health_unhealthy", "1 while /health answers 503, "
                                  "by reason (vllm-kvguard)", labels=["reason"])
    for row in verdict.rows():
        since.add_metric([row["engine"]], float(row["seconds_since_step"]))
        for cause in verdict.WEDGED_CAUSES:
            wedged.add_metric([row["engine"], cause], float(row["wedged"] == cause))
        longest.add_metric([row["engine"]], float(row["longest_s"] or 0.0))
    bad = verdict.reasons()
    for reason in ("stalled", "wedged"):
        unhealthy.add_metric([reason], float(reason in bad))
    return [since, wedged, longest, unhealthy]


def setup(registry=None) -> None:
    """Register the collector (in prometheus_client's default registry). Idempotent."""
    with _lock:
        if _state["collector"] is not None:
            return
        try:
            if registry is None:
                from prometheus_client import REGISTRY as registry
        except ImportError:
            return
        collector = KvguardCollector()
        registry.register(collector)
        _state["collector"], _state["registry"] = collector, registry


def teardown() -> None:
    """Unregister the collector and forget the engines."""
    from vllm_kvguard import remote

    remote.reset()
    with _lock:
        if _state["collector"] is not None:
            try:
                _state["registry"].unregister(_state["collector"])
            except KeyError:
                pass
        _state.update(collector=None, registry=None)


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
