"""`kvguard plan`: blocks per KV-cache group from a config.json alone match what the real
engine objects compute; the GPU-shaped coverage gap; argument errors name the argument."""
from __future__ import annotations

import json

import pytest

from vllm_kvguard.tools import preflight

NGRAM3 = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}


def test_bad_model_path_names_the_argument(tmp_path, capsys):
    assert preflight.main(["--model", str(tmp_path / "nope"), "--num-gpu-blocks", "9"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kvguard plan: --model ") and \
        "config.json" in err[0] and "Traceback" not in err[0]


def test_bad_json_names_the_argument(tmp_path, capsys):
    (tmp_path / "config.json").write_text("{}")
    assert preflight.main(["--model", str(tmp_path), "--num-gpu-blocks", "9",
                           "--compilation-config", "{max_cudagraph_capture_size: 1}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kvguard plan: --compilation-config: not valid JSON") and \
        "\n" not in err


@pytest.mark.parametrize("kind", ["llama", "nemotron_h"])
def test_plan_matches_the_engine_objects(kind, tmp_path):
    """A config.json written here (Llama-shaped; NemotronH-shaped hybrid): the planner's
    per-group blocks equal capacity.compute on a KVCacheConfig of the same specs, and its
    vLLM figure is vLLM's own; the GPU-shaped coverage gap is the worked example."""
    pytest.importorskip("vllm")
    from vllm.v1.core.kv_cache_utils import get_max_concurrency_for_kv_cache_config

    from vllm_kvguard.fixes.estimation import capacity
    from vllm_kvguard.testing.kv_fixtures import kv_cache_config
    from vllm_kvguard.tools.plan import plan_config
    from vllm_kvguard.tools.tiny_models import write_model

    model = write_model(kind, tmp_path / kind)
    r = preflight.plan(model, max_num_seqs=256, max_model_len=2048, num_gpu_blocks=4096,
                       speculative_config=NGRAM3)
    # the engine's own objects, built independently of the planner's KV path
    vc = plan_config(model, max_num_seqs=256, max_model_len=2048,
                     speculative_config=dict(NGRAM3))
    block_size = vc.cache_config.block_size
    preflight.align_block_size(vc, "FLASH_ATTN")     # what the executor does on a GPU
    specs = preflight.kv_cache_specs(vc)
    uniq = list(dict.fromkeys(specs.values()))   # one group per distinct spec here
    kvc = kv_cache_config(uniq * 1, 4096)
    cap = capacity.compute(vc, kvc)
    by_kind = {}
    for g in cap.groups:
        by_kind[g.kind] = (g.plain, g.spec, g.decode)
    for g in r["groups"]:
        assert (g["blocks_per_request_plain"], g["blocks_per_request_spec"],
                g["decode_blocks"]) == by_kind[g["kind"]]
    if kind == "llama":
        assert [g["kind"] for g in r["groups"]] == ["FullAttentionSpec"]
        assert r["vllm_concurrency"] == pytest.approx(
            get_max_concurrency_for_kv_cache_config(vc, kvc), rel=1e-3)
    else:
        # "M*M-": groups numbered as vLLM numbers them, in the order their layers appear
        kinds = [g["kind"] for g in r["groups"]]
        assert kinds[2] == "FullAttentionSpec" and len(kinds) == 3
        # the attention page grew to hold a Mamba state, in FLASH_ATTN's multiples of 16
        assert r["groups"][2]["block_size"] > block_size
        assert r["groups"][2]["block_size"] % 16 == 0
        # the cache mode vLLM picks with drafts: align (0.29+), none (0.27.1)
        mode = vc.cache_config.mamba_cache_mode
        assert all(k.startswith(f"MambaSpec({mode}, nsb=3)") for k in kinds[:2]), kinds
        assert r["blocks_per_request_spec"] > sum(g["blocks_per_request_plain"]
                                                  for g in r["groups"])
    row = next(c for c in r["coverage"] if c["drafts"] == 3 and not c["zero_draft"])
    assert row["requests"] == [1, 256] and row["covered"] == 128
    assert row["first_uncovered"] == 129
    assert row["fix_setting"] == {"max_cudagraph_capture_size": 1024}
    assert r["verdict"] == "ACTION NEEDED"
    json.dumps(r)                                # --json writes it


def test_plan_states_the_largest_admissible_request(tmp_path):
    """The certificate is stated; a KV cache too small for one max_model_len request is
    named as vLLM itself would refuse it, with the flags to change (no traceback)."""
    pytest.importorskip("vllm")
    from vllm_kvguard.tools.tiny_models import write_model

    model = write_model("llama", tmp_path / "llama")
    roomy = preflight.plan(model, max_num_seqs=4, max_model_len=2048, num_gpu_blocks=4096)
    assert roomy["largest_admissible_tokens"] == 2048
    assert any("largest admissible request: prompt + max_tokens <= 2048 tokens" in line
               for line in roomy["capacity_lines"])
    assert not any("never fit" in p for p in roomy["problems"])
    bsz = roomy["groups"][0]["block_size"]
    with pytest.raises(preflight.PlanError) as err:
        preflight.plan(model, max_num_seqs=4, max_model_len=2048, num_gpu_blocks=2048 // bsz - 1)
    assert "vLLM would refuse to start" in str(err.value)
    assert "--max-model-len" in str(err.value) and "--num-gpu-blocks" in str(err.value)
    # exactly one max_model_len request with the null block counted as usable: vLLM 0.29+
    # refuse it at startup; 0.27.1 starts, and the plan names what can never fit
    from packaging.version import Version

    from vllm_kvguard.versions import vllm_version

    if vllm_version() >= Version("0.29"):
        with pytest.raises(preflight.PlanError, match="vLLM would refuse to start"):
            preflight.plan(model, max_num_seqs=4, max_model_len=2048,
                           num_gpu_blocks=2048 // bsz)
    else:
        tight = preflight.plan(model, max_num_seqs=4, max_model_len=2048,
                               num_gpu_blocks=2048 // bsz)
        assert tight["largest_admissible_tokens"] == 2048 - bsz
        assert any("a max_model_len request can never fit" in p for p in tight["problems"])


def test_plan_names_the_warmup_shapes_a_pool_leaves_unwarmed(tmp_path):
    """V2 warmup: vLLM's own warmup function, run over the planner's configs, warms as many
    dummy requests as the pool holds; the plan names the batch sizes left unwarmed and the
    pool that warms them all, and that pool (not one block less) leaves none."""
    pytest.importorskip("vllm")
    pytest.importorskip("vllm.v1.worker.gpu.warmup")
    import dataclasses

    from vllm_kvguard.testing.kv_fixtures import kv_cache_config
    from vllm_kvguard.tools import warmup_check
    from vllm_kvguard.tools.plan import plan_config
    from vllm_kvguard.tools.tiny_models import write_model

    model = write_model("llama", tmp_path / "llama")
    r = preflight.plan(model, max_num_seqs=64, max_model_len=256, num_gpu_blocks=40,
                       runner="v2")
    w = r["warmup"]
    # one block per dummy request (5 tokens, blocks of 16 or more): 39 beside the null block
    assert (w["vllm_requests"], w["vllm_in_bounds"], w["kvguard_requests"]) == (39, True, 39)
    assert w["skipped_shapes"] == [40, 64] and w["requests_for_all"] == 64
    assert any("batches of 40-64 requests are not warmed" in x for x in r["warmup_lines"])
    assert any(p.startswith("V2 warmup: batches of 40-64") and
               f"--num-gpu-blocks >= {w['blocks_for_all']}" in p for p in r["problems"])
    vc = plan_config(model, max_num_seqs=64, max_model_len=256)
    kvc = kv_cache_config(list(dict.fromkeys(preflight.kv_cache_specs(vc).values())), 40)
    enough = dataclasses.replace(kvc, num_blocks=w["blocks_for_all"])
    assert warmup_check.feasibility(vc, enough)["skipped_shapes"] == []
    short = dataclasses.replace(kvc, num_blocks=w["blocks_for_all"] - 1)
    assert warmup_check.feasibility(vc, short)["skipped_shapes"] == [64, 64]
    v1 = warmup_check.feasibility(vc, kvc, "v1")
    assert warmup_check.problem(v1) is None and "no warmup shape is skipped" in \
        warmup_check.format_lines(v1)[0]
