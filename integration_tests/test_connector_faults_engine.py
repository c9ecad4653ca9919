"""KV connector faults injected inside a real EngineCore with a real connector (vLLM's
``ExampleConnector``: KV saved to and loaded from local files; with prefix caching off the
second round loads every prompt's full blocks from them): vLLM alone dies; with the plugin
only the faulted requests fail, each with an error, and every other request is
token-identical to a fault-free run; nothing leaks and the audit stays clean. A KV load the
worker reports failed is recomputed by vLLM's own ``kv_load_failure_policy="recompute"``,
token-identically."""
import pytest

from vllm_kvguard.tools.ab.harness import fault_runs, run_in_subprocess

SPEC = {"model": "llama", "connector": "ExampleConnector", "num_requests": 8,
        "max_tokens": 16, "rounds": 2,
        "engine": {"block_size": 32, "enable_prefix_caching": False}}
FINISHED = ("length", "stop")


@pytest.mark.engine
@pytest.mark.slow          # three engine runs: about 130 s on 2 shared cores
@pytest.mark.timeout(600)
@pytest.mark.parametrize("phase", ["lookup", "update"])
def test_connector_faults_kill_vllm_and_the_plugin_fails_only_the_faulted_requests(phase):
    faults = f"phase={phase},every=5"
    clean = run_in_subprocess(SPEC, {}, timeout=240)
    assert clean["ok"] and clean["totals"]["completed"] == 16, clean.get("error")

    vllm_alone, fixed = fault_runs(SPEC, faults)
    assert not vllm_alone.get("hung"), "vLLM alone should die, not hang"
    assert vllm_alone["engine_died"] and "injected: KV connector" in vllm_alone["error"]
    assert fixed["ok"] and not fixed["engine_died"], fixed.get("error")
    failed = 0
    for got, want in zip(fixed["per_round"], clean["per_round"]):
        for out, why, clean_out in zip(got["outputs"], got["finish_reasons"], want["outputs"]):
            if why in FINISHED:
                assert out == clean_out                         # greedy, token-identical
            else:
                assert why == "error"
                failed += 1
    assert failed == fixed["faults_injected"] > 0
    counters = fixed["kvguard"]["counters"]
    method = {"lookup": "get_num_new_matched_tokens", "update": "update_state_after_alloc"}
    assert counters["contained"] == {method[phase]: failed}
    assert fixed.get("audit_violations", []) == [] and "audit_violation" not in counters
    assert fixed["held_blocks"] == 0                            # nothing leaked
    print(f"{phase}: {failed} faulted requests failed, "
          f"{sum(len(r['outputs']) for r in fixed['per_round']) - failed} identical")


@pytest.mark.engine
@pytest.mark.slow          # two engine runs: about 90 s on 2 shared cores
@pytest.mark.timeout(600)
def test_a_failed_kv_load_is_recomputed_token_identically():
    spec = {**SPEC, "connector": {"kv_connector": "ExampleConnector",
                                  "kv_load_failure_policy": "recompute"}}
    clean = run_in_subprocess(spec, {}, timeout=240)
    assert clean["ok"] and clean["totals"]["completed"] == 16, clean.get("error")
    fixed = run_in_subprocess(spec, {"KVGUARD": "1", "KVGUARD_FAULTS": "phase=load,every=3",
                                     "KVGUARD_AUDIT": "1"}, timeout=240)
    assert fixed["ok"] and fixed["totals"]["completed"] == 16, fixed.get("error")
    assert fixed["faults_injected"] >= 2                       # round 2 loads 8 prompts
    assert fixed["per_round"] == clean["per_round"]             # recomputed, identical
    assert fixed.get("audit_violations", []) == [] and fixed["held_blocks"] == 0
