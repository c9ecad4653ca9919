"""Allocator faults injected inside a real EngineCore (KVGUARD_FAULTS, the plugin's own
test-only injector): vLLM alone dies; with the allocator fix every request completes,
greedy outputs are token-identical to a fault-free run and the audit stays clean."""
import pytest

from vllm_kvguard.tools.ab.harness import fault_runs, run_in_subprocess

NGRAM_K3 = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
            "prompt_lookup_min": 2}
CASES = {
    # tiny Llama, prefix caching on, a 64-block pool
    "llama": {"model": "llama", "engine": {"num_gpu_blocks_override": 64, "block_size": 32}},
    # NemotronH hybrid: Mamba + attention groups (prefix caching on: Mamba align mode)
    "nemotron_h": {"model": "nemotron_h", "prompt_len": 40},
    # hybrid + ngram k=3 (CPU: spec decoding on hybrids needs prefix caching off)
    "nemotron_h-ngram3": {"model": "nemotron_h", "prompt_len": 40, "engine": {
        "enable_prefix_caching": False, "speculative_config": NGRAM_K3}},
}
FAULTS = "every=5"


@pytest.mark.engine
@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", [pytest.param("llama", marks=pytest.mark.smoke),
                                  pytest.param("nemotron_h", marks=pytest.mark.slow),
                                  "nemotron_h-ngram3"])
def test_faults_kill_vllm_and_the_fix_completes_every_request_identically(case):
    spec = {"num_requests": 8, "max_tokens": 24, **CASES[case]}
    clean = run_in_subprocess(spec, {}, timeout=240)
    assert clean["ok"] and clean["completed"] == 8, clean.get("error")

    vllm_alone, fixed = fault_runs(spec, FAULTS)
    assert not vllm_alone.get("hung"), "vLLM alone should die, not hang"
    assert vllm_alone["engine_died"] and "injected" in vllm_alone["error"]
    assert fixed["ok"] and not fixed["engine_died"], fixed.get("error")
    assert fixed["completed"] == 8 and fixed["failed"] == 0 and fixed["aborted"] == 0
    assert fixed["outputs"] == clean["outputs"]                 # greedy, token-identical
    counters = fixed["kvguard"]["counters"]
    assert sum(counters.get("rollback", {}).values()) > 0       # the faults did fire
    assert fixed.get("audit_violations", []) == []
    assert "audit_violation" not in counters
    assert fixed["held_blocks"] == 0                            # nothing leaked


@pytest.mark.multiproc
@pytest.mark.slow          # the serving tests cover EngineCore's counters in the default run
@pytest.mark.timeout(600)
def test_multiprocess_run_reports_the_faults_and_rollbacks_of_engine_core():
    # The injector and the rollbacks run in EngineCore, another process: the harness reads
    # every process's counters (asked through vLLM's collective_rpc, as /metrics does), not
    # only its own.
    spec = {"num_requests": 8, "max_tokens": 24, "multiprocess": True, **CASES["llama"]}
    fixed = run_in_subprocess(spec, {"KVGUARD": "1", "KVGUARD_FAULTS": FAULTS}, timeout=560)
    assert fixed["ok"] and fixed["completed"] == 8, fixed.get("error")
    rolled_back = fixed["kvguard"]["counters"].get("rollback", {})
    assert rolled_back.get("InjectedFault", 0) > 0, fixed["kvguard"]
    assert fixed["faults_injected"] == rolled_back["InjectedFault"]
