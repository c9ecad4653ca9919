"""Real engine: the spec-aware startup report agrees with what the scheduler holds.

A fresh process (vLLM loads the plugin through its entry point, ``KVGUARD=1``) starts the
tiny NemotronH hybrid (2 Mamba groups + 1 attention group) with ngram speculative decoding
(k = 2..4, prefix caching off: vLLM's CPU limits), an engine core in that process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so the scheduler's ``KVCacheManager`` can be read,
and a pool small enough to saturate. It submits more long requests than fit, steps the
engine to completion and records, every step, the pool blocks each running request holds
per group and how many requests hold blocks at once. The report must match: per-group
blocks per request at ``max_model_len`` (Mamba: 1 + k with speculation), and the true
maximum concurrency is the number the allocator actually runs at full load.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

SCRIPT = r'''
import json, os, sys

def main():
    from vllm import SamplingParams
    from vllm import LLM
    from vllm_kvguard import activation
    from vllm_kvguard.fixes.estimation import capacity
    from vllm_kvguard.tools.tiny_models import engine_kwargs, write_model

    mml, blocks, nreq = (int(a) for a in sys.argv[1:4])
    model = write_model("nemotron_h", os.path.join(sys.argv[4], "model"))
    # One engine per process: a second LLM in one process trips vLLM's kernel dispatcher.
    run(LLM, SamplingParams, activation, capacity, engine_kwargs, model, int(sys.argv[5]),
        mml, blocks, nreq)


def run(LLM, SamplingParams, activation, capacity, engine_kwargs, model, k, mml, blocks, nreq):
    llm = LLM(**engine_kwargs(model, max_model_len=mml, max_num_seqs=32,
                              enable_prefix_caching=False, num_gpu_blocks_override=blocks,
                              speculative_config={"method": "ngram",
                                                  "num_speculative_tokens": k,
                                                  "prompt_lookup_max": 4,
                                                  "prompt_lookup_min": 1}))
    cap = capacity.last_report()
    engine = llm.llm_engine
    sched = engine.engine_core.engine_core.scheduler
    managers = sched.kv_cache_manager.coordinator.single_type_managers
    prompt = mml - 24            # long from the start: every request near max_model_len
    params = SamplingParams(temperature=0, ignore_eos=True, detokenize=False,
                            max_tokens=mml - prompt)
    for i in range(nreq):
        engine.add_request(f"r{i}", {"prompt_token_ids": [1, 2, 3, 4] * (prompt // 4)},
                           params)
    peak = [0] * len(managers)
    max_running = finished = steps = drafts = 0
    while engine.has_unfinished_requests() and steps < 2000:
        finished += sum(o.finished for o in engine.step())
        steps += 1
        holding = 0
        for req in sched.running:
            per = [sum(not b.is_null for b in m.req_to_blocks.get(req.request_id, ()))
                   for m in managers]
            holding += any(per)
            peak = [max(p, x) for p, x in zip(peak, per)]
            drafts = max(drafts, len(req.spec_token_ids or ()))
        max_running = max(max_running, holding)
    print("RESULT " + json.dumps(dict(
        k=k, activation=activation.results(), finished=finished, peak=peak,
        max_running=max_running, max_drafts=drafts,
        groups=[[g.kind, g.plain, g.spec] for g in cap.groups],
        per_request_plain=cap.per_request_plain, per_request_spec=cap.per_request_spec,
        true=cap.true_concurrency, vllm=cap.vllm_concurrency, admit=cap.admit_blocks,
        hold=cap.hold_blocks)), flush=True)
    del llm, engine, sched, managers

if __name__ == "__main__":
    main()
'''

MAX_MODEL_LEN, POOL, REQUESTS, KS = 512, 40, 8, (2, 3, 4)


@pytest.fixture(scope="module")
def engine_runs(tmp_path_factory) -> tuple[dict, dict]:
    """One fresh process per k, started together (imports dominate: ~20 s each)."""
    tmp_path = tmp_path_factory.mktemp("capacity")
    script = tmp_path / "capacity_probe.py"
    script.write_text(SCRIPT)
    procs = {}
    for k in KS:
        work = tmp_path / f"k{k}"
        work.mkdir()
        env = {n: v for n, v in os.environ.items() if not n.startswith("KVGUARD")}
        env.update(KVGUARD="1", VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1",
                   VLLM_CACHE_ROOT=str(work / "cache"), TMPDIR=str(work),
                   TORCHINDUCTOR_CACHE_DIR=str(work / "inductor"))
        procs[k] = subprocess.Popen(
            [sys.executable, str(script), str(MAX_MODEL_LEN), str(POOL), str(REQUESTS),
             str(work), str(k)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env=env)
    results, logs = {}, {}
    deadline = time.monotonic() + 540       # all of them; loaded 2-core machines take 300+
    try:
        for k, proc in procs.items():
            logs[k], _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            for ln in logs[k].splitlines():
                if ln.startswith("RESULT "):
                    results[k] = json.loads(ln[len("RESULT "):])
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return results, logs


@pytest.mark.engine
@pytest.mark.timeout(600)
def test_report_is_logged_once_with_spec_aware_numbers(engine_runs):
    results, logs = engine_runs
    for k in KS:
        assert k in results, logs[k][-4000:]
        assert logs[k].count("vllm-kvguard KV capacity:") == 1, logs[k][-3000:]
        res = results[k]
        assert f"per request: peak plain={res['per_request_plain']} " \
               f"spec={res['per_request_spec']}" in logs[k]


@pytest.mark.engine
@pytest.mark.timeout(600)
@pytest.mark.parametrize("k", KS)
def test_report_matches_the_scheduler_at_full_load(engine_runs, k):
    results, logs = engine_runs
    assert k in results, logs[k][-4000:]
    res = results[k]
    assert res["activation"]["warmup"].startswith("applied"), res["activation"]
    assert res["finished"] == REQUESTS
    assert res["max_drafts"] == k, "speculative decoding did not run"

    # The report is spec-aware ...
    mamba = [g for g in res["groups"] if g[0].startswith("MambaSpec")]
    assert len(mamba) == 2 and all(g[1] == 1 and g[2] == 1 + k for g in mamba), res["groups"]
    assert res["per_request_spec"] == res["per_request_plain"] + 2 * k

    # ... and is what the scheduler holds: per group, per request, at full load ...
    assert [g[2] for g in res["groups"]] == res["peak"], (res["groups"], res["peak"])
    # ... and how many requests it runs at once when the pool is the limit.
    assert res["max_running"] == int(res["true"]) < REQUESTS
    usable = POOL - 1
    assert res["true"] == 1 + (usable - res["admit"]) // res["hold"]
    # vLLM's own figure counts the null block as usable.
    assert res["vllm"] == pytest.approx(POOL / res["per_request_spec"])
