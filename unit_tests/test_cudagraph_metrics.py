"""Prometheus export: the collector in a prometheus_client registry, across processes."""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys

import pytest

prometheus_client = pytest.importorskip("prometheus_client")

from vllm_kvguard import metrics, report  # noqa: E402
from vllm_kvguard.fixes import fallbacks  # noqa: E402
from vllm_kvguard.tools.truth_table import record_defect  # noqa: E402


@pytest.fixture
def registry():
    reg = prometheus_client.CollectorRegistry()
    metrics.setup(registry=reg)
    yield reg
    metrics.teardown()


def text(reg) -> str:
    return prometheus_client.generate_latest(reg).decode()


def test_every_reason_is_exported_at_zero(registry):
    out = text(registry)
    for reason in fallbacks.REASONS:
        assert f'kvguard_cudagraph_fallbacks_total{{reason="{reason}"}} 0.0' in out
    assert "# TYPE kvguard_cudagraph_fallbacks_total counter" in out or \
           "# TYPE kvguard_cudagraph_fallbacks counter" in out


def test_counts_and_other_categories(registry):
    report.count(fallbacks.CATEGORY, "over_max_capture_size", 3)
    report.count("rollback", "ValueError")
    out = text(registry)
    assert 'kvguard_cudagraph_fallbacks_total{reason="over_max_capture_size"} 3.0' in out
    assert 'kvguard_events_total{category="rollback",reason="ValueError"} 1.0' in out


def in_another_process(directory: str, *lines: str) -> None:
    """Run ``lines`` in a child that inherits the snapshot directory (a worker)."""
    code = "\n".join(("from vllm_kvguard import metrics, report",
                      "metrics.setup(registry=__import__('prometheus_client').CollectorRegistry())",
                      *lines))
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60,
                   env={**os.environ, metrics.ENV_DIR: directory})


@contextlib.contextmanager
def alive_in_another_process(directory: str, *lines: str):
    """Like :func:`in_another_process`, the child staying alive inside the ``with``."""
    code = "\n".join(("from vllm_kvguard import metrics, report",
                      "metrics.setup(registry=__import__('prometheus_client').CollectorRegistry())",
                      *lines, "print('ready', flush=True)", "input()"))
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True,
                             env={**os.environ, metrics.ENV_DIR: directory})
    try:
        assert child.stdout.readline().strip() == "ready"
        yield child
    finally:
        child.communicate(input="\n", timeout=60)


def test_other_processes_are_added(registry):
    """A worker process (inherits KVGUARD_METRICS_DIR) counts; this process exports it."""
    directory = os.environ[metrics.ENV_DIR]
    in_another_process(directory, "report.count('cudagraph_fallback', 'non_uniform_drafts', 5)",
                       "metrics.changed()")
    files = [f for f in os.listdir(directory) if f.endswith(".json")]
    assert len(files) == 1 and json.load(open(os.path.join(directory, files[0]))) == {
        "cudagraph_fallback": {"non_uniform_drafts": 5}}
    report.count(fallbacks.CATEGORY, "non_uniform_drafts", 1)
    out = text(registry)
    assert 'kvguard_cudagraph_fallbacks_total{reason="non_uniform_drafts"} 6.0' in out


def test_gauges_are_replaced_not_added_and_summed_over_processes(registry):
    """``kvguard_waiting_requests{cause}``: each process's current value (an EngineCore
    writes ``<pid>.gauges``); the front end serves the sum."""
    with alive_in_another_process(
            os.environ[metrics.ENV_DIR],
            "report.set_gauge('waiting_requests', {'kv_connector': 2, 'grammar': 0})",
            "metrics.flush()"):
        report.set_gauge("waiting_requests", {"kv_connector": 5})
        report.set_gauge("waiting_requests", {"kv_connector": 1})      # replaced
        out = text(registry)
    assert "# TYPE kvguard_waiting_requests gauge" in out
    assert 'kvguard_waiting_requests{cause="kv_connector"} 3.0' in out
    assert 'kvguard_waiting_requests{cause="grammar"} 0.0' in out
    assert "waiting_requests" not in metrics.totals()                  # not a counter


def test_flush_is_rate_limited_and_completed_by_a_timer(registry):
    directory = os.environ[metrics.ENV_DIR]
    own = os.path.join(directory, f"{os.getpid()}.json")
    report.count(fallbacks.CATEGORY, "lora")
    metrics.changed()                                      # first change: written at once
    assert json.load(open(own))["cudagraph_fallback"]["lora"] == 1
    report.count(fallbacks.CATEGORY, "lora")
    metrics.changed()                                      # within the interval: deferred
    timer = metrics._state["timer"]
    assert timer is not None
    timer.join(timeout=10)
    assert json.load(open(own))["cudagraph_fallback"]["lora"] == 2


def test_teardown_removes_what_it_created():
    reg = prometheus_client.CollectorRegistry()
    metrics.setup(registry=reg)
    directory = os.environ[metrics.ENV_DIR]
    metrics.teardown()
    assert not os.path.exists(directory) and metrics.ENV_DIR not in os.environ
    assert "kvguard_cudagraph_fallbacks" not in text(reg)


# ----------------------------------------------------------------------------- vLLM's own
def test_vllm_prometheus_logger_has_no_cudagraph_mode_counter():
    """vllm#37576 (open): a Prometheus counter of iterations by CUDA-graph runtime mode.
    vLLM's real ``PrometheusStatLogger``, built on a planned config with
    ``cudagraph_metrics`` on, registers no collector about CUDA graphs."""
    pytest.importorskip("vllm")
    from vllm.v1.metrics import loggers

    from vllm_kvguard.tools.plan import plan_config

    vc = plan_config(cudagraph_mode="FULL_DECODE_ONLY", max_num_seqs=8)
    vc.observability_config.cudagraph_metrics = True
    reg = prometheus_client.REGISTRY
    before = dict(reg._names_to_collectors)
    try:
        loggers.PrometheusStatLogger(vc, [0])
    finally:
        added = {n: c for n, c in reg._names_to_collectors.items() if before.get(n) is not c}
        for collector in {id(c): c for c in added.values()}.values():
            reg.unregister(collector)                # only what this logger registered
    graph_metrics = sorted(n for n in added if "graph" in n.lower())
    record_defect("cudagraph", "vllm#37576", present=bool(added) and not graph_metrics,
                  detail=f"PrometheusStatLogger registers {len(added)} series, "
                         f"{len(graph_metrics)} about CUDA graphs"
                         + (f" ({', '.join(graph_metrics[:3])})" if graph_metrics else ""))
    assert added                                  # the logger did register its metrics


def test_model_runner_v2_carries_cudagraph_stats():
    """vllm#52728: ``--cudagraph-metrics`` printed nothing on model runner V2 (the default
    for dense models), which never carried a ``CUDAGraphStat`` from ``execute_model`` to
    ``ModelRunnerOutput`` (fixed by vllm#52358: a ``cudagraph_stats`` field on V2's
    ``ExecuteModelState``). V1's state has carried it all along."""
    pytest.importorskip("vllm")
    from vllm.v1.worker import gpu_model_runner as v1
    v2 = pytest.importorskip("vllm.v1.worker.gpu.model_runner")

    v2_fields = tuple(v2.ExecuteModelState._fields)
    record_defect("cudagraph", "vllm#52728", present="cudagraph_stats" not in v2_fields,
                  detail="MRV2 ExecuteModelState fields: " + ", ".join(v2_fields))
    assert "cudagraph_stats" in v1.ExecuteModelState._fields


def test_a_killed_creators_directory_is_removed_at_the_next_start(tmp_path, monkeypatch):
    """A creator ended by SIGKILL (a Ray worker: no exit handlers) leaves its directory;
    the next process that creates one removes it. Live creators' directories stay."""
    import signal
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.delenv(metrics.ENV_DIR, raising=False)
    code = ("from vllm_kvguard import metrics, report\n"
            "metrics.setup(registry=__import__('prometheus_client').CollectorRegistry())\n"
            "report.count('rollback', 'ValueError'); metrics.flush()\n"
            "print(metrics.directory(), flush=True); input()\n")
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True,
                             env={**{k: v for k, v in os.environ.items() if k != metrics.ENV_DIR},
                                  "TMPDIR": str(tmp_path)})
    try:
        stale = child.stdout.readline().strip()
        live = tempfile.mkdtemp(prefix=f"{metrics.PREFIX}{os.getppid()}-")  # alive: our parent
        assert os.path.isdir(stale) and os.listdir(stale)
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        child.kill()
    assert os.path.isdir(stale)                    # no exit handler ran
    reg = prometheus_client.CollectorRegistry()
    metrics.setup(registry=reg)
    try:
        assert not os.path.exists(stale) and os.path.isdir(live)
        assert os.path.dirname(metrics.directory()) == str(tmp_path)
    finally:
        metrics.teardown()
    assert sorted(os.listdir(tmp_path)) == [os.path.basename(live)]


def test_gauges_of_a_process_that_is_gone_are_left_out(registry):
    directory = os.environ[metrics.ENV_DIR]
    with alive_in_another_process(directory, "report.set_gauge('active_processes', "
                                  "{'worker': 1})", "metrics.flush()"):
        assert metrics.gauge_totals() == {"active_processes": {"worker": 1}}
    assert metrics.gauge_totals() == {}            # its writer is gone: not current
    report.set_gauge("active_processes", {"EngineCore": 1})
    assert metrics.gauge_totals() == {"active_processes": {"EngineCore": 1}}
