"""``kvguard ab --serve`` end to end, as the user runs it: baseline + alloc-faults on real
``vllm serve`` pairs (two servers at a time, loopback), 16 streamed requests per side,
checked through its JSON file and table. Four server starts: the slowest A/B test."""
import json
import os
import subprocess
import sys
import time

import pytest

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

CLIENT_ERRORS = {"http 500", "connection refused", "connection error", "stream error"}


@pytest.fixture(scope="module")
def ab_serve(tmp_path_factory):
    out = tmp_path_factory.mktemp("ab-serve")
    env = {**os.environ, "VLLM_CACHE_ROOT": str(out / "vllm-cache"),
           "VLLM_HOST_IP": "127.0.0.1"}
    cmd = [sys.executable, "-m", "vllm_kvguard.tools.cli", "ab", "--serve",
           "--scenario", "baseline,alloc-faults", "--repeat", "1", "--num-requests", "16",
           "--no-microbench", "--request-timeout", "120", "--timeout", "900",
           # one stream per side on a shared machine says nothing about a few percent:
           # this test checks the plumbing, the ratios have their unit tests
           "--tolerance", "0.05", "--json", str(out / "ab.json"), "--png", str(out / "ab.png")]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=2300)
    seconds = time.monotonic() - t0
    print(f"\n[ab --serve] {seconds:.0f} s\n{proc.stdout}")
    data = json.loads((out / "ab.json").read_text())
    return proc, data


@pytest.mark.timeout(2400)
def test_ab_serve_baseline_and_alloc_faults(ab_serve):
    proc, data = ab_serve
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "TTFT p50/p99 ms" in proc.stdout and "verdict: PASS" in proc.stdout
    base, faults = data["scenarios"]
    assert (base["name"], faults["name"]) == ("baseline", "alloc-faults")

    a, b = base["sides"]["A"], base["sides"]["B"]
    for side in (a, b):
        assert side["totals"] == {"submitted": 16, "completed": 16, "failed": 0, "aborted": 0}
        assert side["latency"]["ttft"]["n"] == 16 and side["latency"]["itl"]["n"] > 0
        assert side["tok_s"][0] > 0
    assert a["processes"] == []                                   # plugin off: nothing active
    assert "EngineCore" in b["processes"], b["processes"]
    assert base["parity"] == {**base["parity"], "status": "pass", "against": "A",
                              "compared": 16, "identical": 16}
    assert base["latency_ratios"]["ttft_p50"] is not None

    a, b = faults["sides"]["A"], faults["sides"]["B"]
    # fixes off: EngineCore dies at the first fault, the clients see it
    assert a["engine_died"] and a["faults_injected"] >= 1
    assert a["totals"]["failed"] > 0 and a["totals"]["completed"] < 16
    assert a["errors"] and set(a["errors"]) <= CLIENT_ERRORS, a["errors"]
    # plugin on: every request completes, token-identical to the fault-free run
    assert not b["engine_died"]
    assert b["totals"] == {"submitted": 16, "completed": 16, "failed": 0, "aborted": 0}
    assert faults["parity"]["status"] == "pass" and faults["parity"]["identical"] == 16
    assert faults["parity"]["against"] == "reference"
    assert faults["reference"]["source"] == "baseline A"
    # counted in EngineCore, read from the server's /metrics
    assert sum(b["counters"]["rollback"].values()) > 0, b["counters"]
    assert b["counters"]["fault"]["injected"] >= 1
