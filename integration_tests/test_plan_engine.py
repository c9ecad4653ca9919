"""``kvguard plan`` against a live engine: from the tiny NemotronH's config.json alone, the
planner prints the same per-group KV tables and the same CUDA-graph coverage table as the
engine logs at startup with the plugin on (``KVGUARD=1``).

One engine (ngram k = 3, prefix caching off: vLLM's CPU limit, a fixed pool and token
budget) and the ``kvguard plan`` command with the same settings run side by side as two
processes; the planner's ``--device cpu --cudagraph-mode NONE`` is what vLLM runs on CPU
(its block size, aligned with CPU_ATTN). The GPU-shaped worked example
(256 sequences, k = 3: 129-256 uncovered) is unit_tests/test_preflight.py.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

NGRAM3 = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
          "prompt_lookup_min": 2}
MAX_MODEL_LEN, MAX_NUM_SEQS, POOL, BUDGET = 512, 8, 64, 2048
CAPACITY, COVERAGE = "vllm-kvguard KV capacity:", "vllm-kvguard CUDA-graph coverage"

ENGINE = r'''
import json, sys
from vllm import LLM
from vllm_kvguard.tools.tiny_models import engine_kwargs
from vllm_kvguard.tools.ab.workload import pad_cpu_conv_weights

pad_cpu_conv_weights()
model, mml, seqs, pool, budget = sys.argv[1], *map(int, sys.argv[2:6])
llm = LLM(**engine_kwargs(model, max_model_len=mml, max_num_seqs=seqs, num_gpu_blocks_override=pool,
                          max_num_batched_tokens=budget, enable_prefix_caching=False,
                          speculative_config=json.loads(sys.argv[6])))
print("ENGINE UP", flush=True)
'''


def table(text: str, title: str) -> list[str]:
    """The multi-line table that starts with ``title``: its first line from the title on,
    then every following line indented by two spaces, without the log prefix that vLLM's
    formatter repeats on each line of a record."""
    lines = text.splitlines()
    start = next((i for i, ln in enumerate(lines) if title in ln), None)
    assert start is not None, f"{title!r} not found in:\n{text[-3000:]}"
    prefix = lines[start][:lines[start].index(title)]
    out = [lines[start][len(prefix):]]
    for ln in lines[start + 1:]:
        ln = ln[len(prefix):] if prefix and ln.startswith(prefix) else ln
        if not ln.startswith("  "):
            break
        out.append(ln)
    return out


@pytest.fixture(scope="module")
def engine_and_plan(tmp_path_factory):
    from vllm_kvguard.tools.tiny_models import write_model

    tmp = tmp_path_factory.mktemp("plan_engine")
    model = write_model("nemotron_h", tmp / "nemotron_h")
    env = {n: v for n, v in os.environ.items() if not n.startswith("KVGUARD")}
    env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1",
               VLLM_CACHE_ROOT=str(tmp / "cache"), TORCHINDUCTOR_CACHE_DIR=str(tmp / "ind"))
    spec = json.dumps(NGRAM3)
    engine = subprocess.Popen(
        [sys.executable, "-c", ENGINE, model, str(MAX_MODEL_LEN), str(MAX_NUM_SEQS),
         str(POOL), str(BUDGET), spec], env={**env, "KVGUARD": "1"}, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, start_new_session=True)
    plan = subprocess.Popen(
        [sys.executable, "-m", "vllm_kvguard.tools.cli", "plan", "--model", model,
         "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", str(MAX_NUM_SEQS),
         "--num-gpu-blocks", str(POOL), "--no-enable-prefix-caching",
         "--max-num-batched-tokens", str(BUDGET), "--speculative-config", spec,
         "--cudagraph-mode", "NONE", "--device", "cpu"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True)
    try:
        engine_log, _ = engine.communicate(timeout=540)
        plan_out, plan_err = plan.communicate(timeout=540)
    finally:
        for proc in (engine, plan):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    (tmp / "engine.log").write_text(engine_log)          # kept for a failure's post-mortem
    (tmp / "plan.out").write_text(plan_out + plan_err)
    return {"engine": engine_log, "plan": plan_out, "plan_err": plan_err,
            "plan_rc": plan.returncode}


@pytest.mark.engine
@pytest.mark.slow          # one engine + the planner: 299 s wall, 159 s CPU on a loaded 2-core VM
@pytest.mark.timeout(600)
def test_plan_prints_the_engines_startup_tables(engine_and_plan):
    run = engine_and_plan
    assert "ENGINE UP" in run["engine"], run["engine"][-4000:]
    assert run["plan_rc"] in (0, 1), run["plan_err"][-3000:]   # 1: ACTION NEEDED
    engine_cap, plan_cap = table(run["engine"], CAPACITY), table(run["plan"], CAPACITY)
    groups = [ln for ln in engine_cap if ln.startswith("  group ")]
    assert len(groups) == 3 and "MambaSpec(none, nsb=3)" in groups[0], run["engine"][-4000:]
    # the certificate: the engine logs it in the same report, before the capacity table
    *same, certificate = plan_cap
    assert certificate.startswith("  admission limits: prompt <= ")
    assert certificate in run["engine"].splitlines() or any(
        ln.endswith(certificate) for ln in run["engine"].splitlines())
    # blocks per group (plain, spec, decode), per request, concurrency, Mamba decodes
    assert same == engine_cap
    assert table(run["plan"], COVERAGE) == table(run["engine"], COVERAGE)
    assert "cudagraph_mode=NONE" in table(run["engine"], COVERAGE)[0]
