"""vLLM's own natural trigger (vllm#46892) in a real engine: a KV connector's external hit
on the Mamba-align hybrid NemotronH. vLLM alone dies in EngineCore; with the plugin the
allocation rolls back, the request waits for room and every request completes.

The connector (``HybridHitConnector``, ``SupportsHMA``) reports a synchronous hit of 256
tokens (one block: on CPU the attention block is 256 tokens, aligned to hold a Mamba
state) for the long prompt. Its worker side loads nothing, so that request's KV is
whatever the pool holds: its outputs are never compared, only the short request's are.

Sizing (``max_num_seqs=2``; groups Mamba, Mamba, attention): the short request (40 tokens)
runs first and holds 1 block per group. The long one (256 external + 44 new tokens) is
predicted 4 blocks (attention 2, each Mamba group 1) and takes 6 (each Mamba group one
for the loaded state and one for the running state). A pool of 9 (the null block + 3 + 5
free) passes the capacity check and runs out inside ``allocate_slots``; 10 is enough. A
pool of 8 (free == prediction) fails vLLM's startup check for ``max_model_len=320``.
"""
import pytest

from vllm_kvguard.tools.ab.harness import run_in_subprocess
from vllm_kvguard.tools.truth_table import record_defect

HIT = 256
POOL_SHORT_BY_ONE = 9           # 5 free for a request predicted 4, taking 6


def spec(pool: int) -> dict:
    return {"model": "nemotron_h", "prompt_lens": [40, HIT + 44], "max_tokens": 16,
            "connector": {"kv_connector": "HybridHitConnector",
                          "kv_connector_module_path": "vllm_kvguard.testing.connector_fixtures",
                          "kv_connector_extra_config": {"matched_tokens": HIT}},
            "engine": {"num_gpu_blocks_override": pool, "max_num_seqs": 2,
                       "max_model_len": 320}}


@pytest.mark.engine
@pytest.mark.slow          # three engine runs: 74-86 s on 2 shared cores, near the 90 s line
@pytest.mark.timeout(600)
def test_an_external_hit_on_a_hybrid_kills_vllm_and_the_plugin_rolls_back():
    clean = run_in_subprocess(spec(POOL_SHORT_BY_ONE + 1), {}, timeout=240)
    assert clean["ok"] and clean["completed"] == 2, clean.get("error")

    vllm_alone = run_in_subprocess(spec(POOL_SHORT_BY_ONE), {}, timeout=240)
    error = vllm_alone.get("error") or ""
    died = (vllm_alone["engine_died"] and "Cannot get 1 free blocks from the pool" in error
            and "allocate_slots" in vllm_alone.get("traceback", ""))
    record_defect("allocator", "vllm#46892", present=died,
                  detail=f"real engine, NemotronH + a SupportsHMA connector, {HIT} external "
                         f"+ 44 new tokens on {POOL_SHORT_BY_ONE} blocks: {error or 'no error'}")
    assert not vllm_alone.get("hung"), "vLLM alone should die, not hang"
    assert died, error

    fixed = run_in_subprocess(spec(POOL_SHORT_BY_ONE), {"KVGUARD": "1", "KVGUARD_AUDIT": "1"},
                              timeout=240)
    assert fixed["ok"] and not fixed["engine_died"], fixed.get("error")
    assert fixed["finish_reasons"] == ["length", "length"]
    assert fixed["outputs"][0] == clean["outputs"][0]         # the request with real KV
    counters = fixed["kvguard"]["counters"]
    assert counters["rollback"]["ValueError"] >= 1             # waited, then admitted
    assert fixed.get("audit_violations", []) == [] and "audit_violation" not in counters
    assert fixed["held_blocks"] == 0                           # nothing leaked
