"""Prometheus export: the collector in a prometheus_client registry, across processes."""
from __future__ import annotations

import os

import pytest

prometheus_client = pytest.importorskip("prometheus_client")

from vllm_kvguard import metrics, remote, report  # noqa: E402
from vllm_kvguard.fixes.cudagraph import fallbacks  # noqa: E402
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


class SyncEngine:
    """Stands in for ``LLMEngine``: answers ``collective_rpc("kvguard_snapshot")`` the way
    the patched EngineCore does (its reply, through vLLM's utility call)."""

    def __init__(self, reply=None, error=None):
        self.reply, self.error, self.asked = reply or [], error, 0

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        assert method == remote.METHOD
        self.asked += 1
        if self.error:
            raise type(self.error)(*self.error.args)
        return self.reply


def other(pid, counts=None, gauges=None, role="worker"):
    return {"pid": pid, "role": role, "counts": counts or {}, "gauges": gauges or {}}


def test_other_processes_are_added_and_asked_at_every_collection(registry):
    engine = SyncEngine([other(101, {"cudagraph_fallback": {"non_uniform_drafts": 5}}),
                         other(102, {"cudagraph_fallback": {"non_uniform_drafts": 2}})])
    remote.attach(engine, is_async=False)
    report.count(fallbacks.CATEGORY, "non_uniform_drafts", 1)
    out = text(registry)
    assert 'kvguard_cudagraph_fallbacks_total{reason="non_uniform_drafts"} 8.0' in out
    assert engine.asked == 1 and "kvguard_remote_refreshes" not in out   # no async engine
    engine.reply = engine.reply[:1]                 # 102 is gone: its counts with it
    assert metrics.totals()["cudagraph_fallback"] == {"non_uniform_drafts": 6}


def test_gauges_are_replaced_not_added_and_summed_over_processes(registry):
    """``kvguard_waiting_requests{cause}``: each process's current value; the front end
    serves the sum over the processes that answer."""
    engine = SyncEngine([other(101, gauges={"waiting_requests": {"kv_connector": 2,
                                                                 "grammar": 0}})])
    remote.attach(engine, is_async=False)
    report.set_gauge("waiting_requests", {"kv_connector": 5})
    report.set_gauge("waiting_requests", {"kv_connector": 1})      # replaced
    out = text(registry)
    assert "# TYPE kvguard_waiting_requests gauge" in out
    assert 'kvguard_waiting_requests{cause="kv_connector"} 3.0' in out
    assert 'kvguard_waiting_requests{cause="grammar"} 0.0' in out
    assert "waiting_requests" not in metrics.totals()                  # not a counter
    engine.reply = []                                                # that process is gone
    assert metrics.gauge_totals() == {"waiting_requests": {"kv_connector": 1}}


def test_this_process_is_counted_once_and_a_dead_engine_adds_nothing(registry):
    report.count("rollback", "ValueError")
    live = SyncEngine([other(os.getpid(), {"rollback": {"ValueError": 1}}),
                       other(7, {"rollback": {"ValueError": 2}}),
                       other(7, {"rollback": {"ValueError": 2}})])
    remote.attach(live, is_async=False)
    dead = SyncEngine(error=RuntimeError("EngineDeadError"))
    remote.attach(dead, is_async=False)
    assert metrics.totals() == {"rollback": {"ValueError": 3}} and dead.asked == 1
    del live                                        # an engine that was dropped is not asked
    assert metrics.totals() == {"rollback": {"ValueError": 1}}


class Executor:
    def __init__(self, workers):
        self.workers, self.calls = workers, []

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        self.calls.append((method, timeout))
        if isinstance(self.workers, Exception):
            raise self.workers
        return [method(w) for w in self.workers]


class Core:
    def __init__(self, executor):
        self.model_executor = executor


def test_engine_reply_is_engine_core_and_every_worker_once(monkeypatch):
    entries = iter([other(11, {"a": {"b": 1}}), other(12, {"a": {"b": 2}})])
    executor = Executor(["rank0", "rank1"])
    monkeypatch.setattr(remote, "entry", lambda: next(entries, other(os.getpid())))
    reply = remote.engine_reply(Core(executor))
    assert [e["pid"] for e in reply] == [11, 12]       # EngineCore first, then rank 0
    assert executor.calls == [(remote.worker_entry, remote.RPC_TIMEOUT_S)]


def test_engine_reply_without_workers_keeps_engine_core(kvguard_log):
    reply = remote.engine_reply(Core(Executor(TimeoutError("rank 1 gone"))))
    assert [e["pid"] for e in reply] == [os.getpid()]
    assert any("workers' counters could not be fetched (TimeoutError: rank 1 gone)" in m
               for m in kvguard_log.lines())


def test_an_async_engine_is_refreshed_on_its_loop_and_served_from_the_cache(registry):
    import asyncio

    class AsyncEngine:
        errored = False

        def __init__(self):
            self.asked = 0

        async def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
            self.asked += 1
            return [other(55, {"rollback": {"InjectedFault": self.asked}})]

    async def main():
        engine = AsyncEngine()
        remote.attach(engine, is_async=True)           # inside the loop, like AsyncLLM
        start = remote.refreshes()
        while remote.refreshes() < start + 2:
            await asyncio.sleep(0)                     # let the refresh task run
        out = text(registry)                           # the collector never awaits
        engine.errored = True
        return engine, out

    engine, out = asyncio.run(asyncio.wait_for(main(), 30))
    assert engine.asked >= 2
    assert 'kvguard_events_total{category="rollback",reason="InjectedFault"}' in out
    assert "kvguard_remote_refreshes_total" in out


def test_setup_makes_no_file_and_teardown_unregisters(tmp_path, monkeypatch):
    """Nothing travels through the file system: no directory, no variable."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    reg = prometheus_client.CollectorRegistry()
    metrics.setup(registry=reg)
    assert "kvguard_cudagraph_fallbacks" in text(reg)
    metrics.teardown()
    assert list(tmp_path.iterdir()) == [] and "KVGUARD_METRICS_DIR" not in os.environ
    assert "kvguard_cudagraph_fallbacks" not in text(reg)


# ----------------------------------------------------------------------------- vLLM's own
def test_vllm_prometheus_logger_has_no_cudagraph_mode_counter():
    """vllm#37576 (open): a Prometheus counter of iterations by CUDA-graph runtime mode.
    vLLM's real ``PrometheusStatLogger``, built on a planned config with
    ``cudagraph_metrics`` on, registers no collector about CUDA graphs."""
    pytest.importorskip("vllm")
    from vllm.v1.metrics import loggers

    from vllm_kvguard.tools.plan.cudagraph import plan_config

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
    v2 = pytest.importorskip("vllm.v1.worker.gpu.model_runner")

    v2_fields = tuple(v2.ExecuteModelState._fields)
    record_defect("cudagraph", "vllm#52728", present="cudagraph_stats" not in v2_fields,
                  detail="MRV2 ExecuteModelState fields: " + ", ".join(v2_fields))
    try:                                          # V1 is gone from 0.34.0
        from vllm.v1.worker import gpu_model_runner as v1
    except ImportError:
        assert "cudagraph_stats" in v2_fields
        return
    assert "cudagraph_stats" in v1.ExecuteModelState._fields
