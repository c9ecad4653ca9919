"""The entry point on a real multiprocess engine: active in every process with KVGUARD=1,
nothing wrapped anywhere without it, bad flags logged while vLLM keeps running."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_kvguard.flags import read_flags
from vllm_kvguard.patches import select_patches
from vllm_kvguard.tools.ab.harness import run_in_subprocess
from vllm_kvguard.tools.serve import REPORT_RE

PROBE = Path(__file__).parent / "scripts" / "plugin_probe.py"
ALLOCATOR_TARGETS = {"vllm.v1.core.kv_cache_manager.KVCacheManager.allocate_slots",
                     "vllm.v1.core.sched.scheduler.Scheduler.schedule"}


def _probe(env_extra: dict, engine: dict | None = None, timeout: float = 240, *, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVGUARD")}
    env.update(VLLM_ENABLE_V1_MULTIPROCESSING="1", VLLM_CPU_KVCACHE_SPACE="1",
               VLLM_ALLOW_INSECURE_SERIALIZATION="1", **env_extra)
    answer = tmp_path / "probe.json"
    out = subprocess.run([sys.executable, str(PROBE), json.dumps(engine or {}), str(answer)],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                         timeout=timeout)     # vLLM logs to stdout, our early lines to stderr
    assert answer.exists(), f"engine did not start (rc {out.returncode}):\n{out.stdout[-3000:]}"
    return json.loads(answer.read_text()), out.stdout


def _report_lines(log: str) -> dict[str, str]:
    """{process name: startup report line} from the combined log."""
    found = {}
    for line in log.splitlines():
        m = REPORT_RE.search(line)
        if m:
            found[m.group(1)] = line
    return found


def _wrapped_in_log(log: str, process_prefix: str) -> set[str]:
    """Targets a process logged (at DEBUG) as wrapped."""
    found = set()
    for line in log.splitlines():
        m = re.search(r"\((\S+) pid=\d+\).*vllm-kvguard: patch '\w+' wrapped (\S+)", line)
        if m and m.group(1).startswith(process_prefix):
            found.add(m.group(2))
    return found


RUNNER = "vllm.v1.worker.gpu_model_runner.GPUModelRunner."


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_every_process_reports_and_wraps_with_flag_on(tmp_path):
    probe, log = _probe({"KVGUARD": "1", "VLLM_LOGGING_LEVEL": "DEBUG"}, tmp_path=tmp_path)
    lines = _report_lines(log)
    engine_core = [p for p in lines if p.startswith("EngineCore")]
    workers = [p for p in lines if "Worker" in p]
    assert "MainProcess" in lines and engine_core and workers, lines
    every = ", ".join(p.name for p in select_patches(read_flags({"KVGUARD": "1"})))
    assert {"allocator", "containment", "distributed"} <= set(every.split(", ")), every
    fixes = ", ".join(n for n in every.split(", ") if n != "distributed")
    for line in lines.values():
        ours = line[line.index("vllm-kvguard "):]       # without vLLM's own log prefix
        assert f"on: {fixes}; distributed always on" in ours and len(ours) < 200, line
    # Each process wraps the targets it loads: the scheduler's in EngineCore, the model
    # runner's in the worker; the front end loads neither.
    assert ALLOCATOR_TARGETS <= _wrapped_in_log(log, "EngineCore")
    assert probe["front_end_unwrapped"] == []
    for worker in probe["workers"]:
        assert worker["unwrapped_loaded"] == [], worker
        assert any(t.startswith(RUNNER) for t in worker["wrapped"]), worker


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_nothing_is_wrapped_in_any_process_with_flag_unset(tmp_path):
    probe, log = _probe({}, tmp_path=tmp_path)
    assert _report_lines(log) == {}
    assert probe["front_end"] == []
    assert probe["workers"] and all(w["wrapped"] == [] and not w["imported"]
                                    for w in probe["workers"])


@pytest.mark.engine
@pytest.mark.timeout(240)
def test_bad_flags_are_named_and_vllm_still_serves():
    res = run_in_subprocess({"num_requests": 2, "max_tokens": 4},
                            {"KVGUARD": "maybe", "KVGUARD_PATCHES": "allocator,bogus",
                             "KVGUARD_FAULTS": "often"}, timeout=200)
    assert res["ok"] and res["completed"] == 2, res.get("error")
    assert res["kvguard"]["results"] is None           # stayed off
    err = "\n".join(res["kvguard_log"])
    assert "KVGUARD='maybe' is not valid; use one of 1, on, 0, off" in err
    assert "unknown patch name(s) bogus; valid: allocator, warmup, cudagraph, admission" in err
    assert "KVGUARD_FAULTS='often' does nothing while KVGUARD is off" in err


@pytest.mark.multiproc
@pytest.mark.slow          # TP=2 serving under faults is the --full run's too
@pytest.mark.timeout(400)
def test_active_in_both_tensor_parallel_workers(tmp_path):
    # vllm-cpu binds each worker's OpenMP threads to a NUMA node; this machine has one, so
    # bind the two workers to one core each by hand.
    probe, log = _probe({"KVGUARD": "1", "VLLM_CPU_OMP_THREADS_BIND": "0|1"},
                        {"tensor_parallel_size": 2}, timeout=380, tmp_path=tmp_path)
    workers = probe["workers"]
    assert len(workers) == 2 and len({w["pid"] for w in workers}) == 2
    for worker in workers:
        assert worker["unwrapped_loaded"] == [], worker
        assert any(t.startswith(RUNNER) for t in worker["wrapped"]), worker
    reported = [p for p in _report_lines(log) if "Worker" in p]
    assert len(reported) == 2, reported
