"""kvguard-ab end to end on real engines: a short two-scenario A/B (baseline + alloc-faults),
run as the user runs it (``python -m vllm_kvguard.tools.ab``), checked through its JSON file."""
import importlib.util
import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.engine]


@pytest.fixture(scope="module")
def ab_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("ab")
    env = {**os.environ, "VLLM_CACHE_ROOT": str(out / "vllm-cache")}
    cmd = [sys.executable, "-m", "vllm_kvguard.tools.ab", "--scenario", "baseline", "alloc-faults",
           "--repeat", "1", "--rounds", "1", "--warmup", "1", "--no-microbench",
           # a single pair on a shared CI machine says nothing about a few percent:
           # this test checks the plumbing, the throughput gate has its unit tests
           "--tolerance", "0.05", "--timeout", "300",
           "--json", str(out / "ab.json"), "--png", str(out / "ab.png")]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=840)
    data = json.loads((out / "ab.json").read_text())
    return proc, data, out


@pytest.mark.timeout(900)
def test_two_scenario_ab_writes_table_json_and_png(ab_run):
    proc, data, out = ab_run
    assert [sc["name"] for sc in data["scenarios"]] == ["baseline", "alloc-faults"]
    assert data["environment"]["platform"] == "cpu"
    assert "verdict:" in proc.stdout and "baseline" in proc.stdout
    if importlib.util.find_spec("matplotlib"):      # the optional chart extra
        assert (out / "ab.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        assert "no PNG: matplotlib is not installed" in proc.stdout
    for sc in data["scenarios"]:
        for key in ("A", "B"):
            side = sc["sides"][key]
            for field in ("startup_s", "totals", "engine_died", "tok_s", "counters",
                          "outputs", "held_blocks", "faults_injected"):
                assert field in side, (sc["name"], key, field)
        assert {c["name"] for c in sc["checks"]} >= {
            "B completes every request", "greedy parity", "throughput ratio"}


@pytest.mark.timeout(900)
def test_baseline_both_sides_complete_with_identical_greedy_outputs(ab_run):
    _, data, _ = ab_run
    sc = data["scenarios"][0]
    a, b = sc["sides"]["A"], sc["sides"]["B"]
    assert a["patches"] is None and b["patches"]          # A really off, B really on
    for side in (a, b):
        assert side["totals"]["completed"] == side["totals"]["submitted"] > 0
        assert side["held_blocks"] == 0
    assert sc["parity"]["status"] == "pass" and sc["parity"]["against"] == "A"
    assert sc["parity"]["compared"] == len(a["outputs"]) == 8
    assert sc["throughput"]["ratio_median"] is not None


@pytest.mark.timeout(900)
def test_alloc_faults_kill_a_and_b_completes_every_request_like_a_clean_run(ab_run):
    proc, data, _ = ab_run
    sc = data["scenarios"][1]
    a, b = sc["sides"]["A"], sc["sides"]["B"]
    assert a["engine_died"] and a["faults_injected"] >= 1
    assert not b["engine_died"], b["error"]
    assert b["faults_injected"] >= 1
    assert b["totals"]["completed"] == b["totals"]["submitted"] > 0
    # A produced nothing: B is compared with baseline's plugin-off run of the same workload
    assert sc["parity"]["status"] == "pass" and sc["parity"]["against"] == "reference"
    assert sc["parity"]["compared"] == 8
    assert proc.returncode == 0, proc.stdout[-3000:]
