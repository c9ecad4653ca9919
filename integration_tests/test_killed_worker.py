"""Counters and leftovers of a real tensor-parallel engine whose processes are killed.

A TP=2 engine (front end, EngineCore, two workers) answers ``kvguard_snapshot`` through
vLLM's ``collective_rpc`` with every process's entry (EngineCore's with its admission
limits); no process writes a file. Then a worker and the rest of the tree are SIGKILLed
(no exit handler runs anywhere), which leaves nothing behind; nor does the next engine
once it exits.
"""
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent / "scripts" / "engine_up.py"
pytestmark = [pytest.mark.multiproc, pytest.mark.slow]


def start(tmp: Path, extra: dict) -> tuple[subprocess.Popen, dict]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVGUARD")}
    env.update(KVGUARD="1", TMPDIR=str(tmp), VLLM_ENABLE_V1_MULTIPROCESSING="1",
               VLLM_CPU_KVCACHE_SPACE="1", VLLM_HOST_IP="127.0.0.1")
    if extra.get("tensor_parallel_size"):
        env["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"      # one core per worker
    proc = subprocess.Popen([sys.executable, str(SCRIPT), json.dumps(extra)], env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    log = []
    try:
        for line in proc.stdout:            # bounded by the test's timeout
            log.append(line)
            if line.startswith("ENGINE "):
                return proc, json.loads(line[len("ENGINE "):])
        proc.wait(timeout=60)
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    raise AssertionError(f"engine did not start (rc {proc.returncode}):\n"
                         + "".join(log)[-3000:])


def leftovers(tmp: Path) -> list[str]:
    return sorted(p.name for p in tmp.iterdir() if p.name.startswith("kvguard-"))


@pytest.mark.timeout(600)
def test_tp2_counters_come_from_both_workers_and_a_killed_tree_leaves_nothing_behind(
        tmp_path):
    proc, up = start(tmp_path, {"tensor_parallel_size": 2})
    try:
        roles = sorted(e["role"] for e in up["entries"])
        assert roles == ["EngineCore", "worker", "worker"], up["entries"]
        assert up["gauges"]["active_processes"] == {"front end": 1, "EngineCore": 1,
                                                    "worker": 2}, up["gauges"]
        core = next(e for e in up["entries"] if e["role"] == "EngineCore")
        assert core["offers"]["admission"]["total_limit"] > 0, core
        assert leftovers(tmp_path) == []
        worker = next(e["pid"] for e in up["entries"] if e["role"] == "worker")
        os.kill(worker, signal.SIGKILL)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)      # the rest of the tree: no exit handlers
        proc.wait(timeout=60)
    assert leftovers(tmp_path) == []                                # nothing to leave

    proc, _ = start(tmp_path, {})
    try:
        assert leftovers(tmp_path) == []
    finally:
        proc.communicate(input="\n", timeout=120)
    assert proc.returncode == 0
    assert leftovers(tmp_path) == []
