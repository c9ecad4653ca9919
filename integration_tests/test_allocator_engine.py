"""Real engines with allocator faults injected in EngineCore (KVGUARD_FAULTS).

Tiny Llama and tiny NemotronH (hybrid: attention + 2 Mamba groups), each with and without
ngram speculative decoding (k=3; the hybrid needs prefix caching off for that on CPU).
Every engine runs in a fresh interpreter through the shared workload runner
(``vllm_kvguard.workload``, in-process engine inside it), so the plugin loads there via
its entry point exactly as in production. Per scenario:

* reference: the plugin off, no fault;
* unfixed: ``KVGUARD=1 KVGUARD_PATCHES=none KVGUARD_FAULTS=every=N`` -> EngineCore dies
  on the first injected ``BlockPool.get_new_blocks`` failure (vLLM's behaviour);
* fixed: the allocator patch on, the same faults, ``KVGUARD_AUDIT=1`` -> every request
  completes, greedy outputs token-identical to the reference, rollbacks counted, the
  audit clean after every step and at the end.

The twelve engines start three at a time once per module (~2.5 min on 2 cores); each has
its own timeout and every test a hard pytest timeout.
"""
from __future__ import annotations

import concurrent.futures as cf

import pytest

from vllm_kvguard.workload import run_in_subprocess

pytestmark = [pytest.mark.engine, pytest.mark.timeout(600)]

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4,
         "prompt_lookup_min": 2}
# A hybrid admission pops one block per group (3): every=3 would fail every attempt.
SCENARIOS = {
    "llama": ({"model": "llama"}, 3),
    "llama-ngram": ({"model": "llama", "engine": {"speculative_config": NGRAM}}, 3),
    "nemotron_h": ({"model": "nemotron_h"}, 7),
    "nemotron_h-ngram": ({"model": "nemotron_h", "engine": {
        "enable_prefix_caching": False, "speculative_config": NGRAM}}, 7),
}
RUN_TIMEOUT_S = 300


def _envs(every: int) -> dict[str, dict[str, str]]:
    faults = f"every={every}"
    return {
        "reference": {},
        "unfixed": {"KVGUARD": "1", "KVGUARD_PATCHES": "none", "KVGUARD_FAULTS": faults},
        "fixed": {"KVGUARD": "1", "KVGUARD_FAULTS": faults, "KVGUARD_AUDIT": "1"},
    }


@pytest.fixture(scope="module")
def runs():
    jobs = {(name, kind): (spec, env) for name, (spec, every) in SCENARIOS.items()
            for kind, env in _envs(every).items()}
    with cf.ThreadPoolExecutor(max_workers=3) as pool:
        futures = {key: pool.submit(run_in_subprocess, spec, env, RUN_TIMEOUT_S)
                   for key, (spec, env) in jobs.items()}
        return {key: f.result() for key, f in futures.items()}


def _why(result: dict) -> str:
    return f"{result.get('error')}\n{result.get('stderr', '')[-2500:]}"


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_reference_runs_clean(runs, scenario):
    ref = runs[(scenario, "reference")]
    assert ref["ok"] and ref["completed"] == 8, _why(ref)


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_without_the_fix_the_engine_dies(runs, scenario):
    unfixed = runs[(scenario, "unfixed")]
    assert not unfixed.get("hung"), _why(unfixed)
    assert unfixed["engine_died"] and not unfixed["ok"], _why(unfixed)
    assert "injected: Cannot get" in (unfixed.get("error") or "") + unfixed.get("stderr", "")


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_with_the_fix_every_request_completes_identically(runs, scenario):
    ref, fixed = runs[(scenario, "reference")], runs[(scenario, "fixed")]
    assert fixed["ok"] and not fixed["engine_died"], _why(fixed)
    assert fixed["completed"] == 8 and fixed["failed"] == 0
    assert fixed["faults_injected"] >= 2
    counters = fixed["kvguard"]["counters"]
    assert counters["rollback"]["InjectedFault"] == fixed["faults_injected"]
    assert fixed["outputs"] == ref["outputs"], "greedy outputs differ from the fault-free run"
    assert fixed.get("audit_violations") == []          # at the end
    assert counters["audit"]["steps"] > 0 and "audit_violation" not in counters
    assert "rollback_failed" not in counters and "internal_error" not in counters
