"""`kvguard plan`: blocks per KV-cache group from a config.json alone match what the real
engine objects compute; the GPU-shaped coverage gap; argument errors name the argument."""
from __future__ import annotations

import json

import pytest

from vllm_kvguard.tools.plan import preflight

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
    """A config.json written here (Llama-shaped; NemotronH-shaped hybrid), planned for a CUDA
    GPU: the planner's per-group blocks equal capacity.compute on a KVCacheConfig vLLM's own
    get_kv_cache_configs builds from the specs vLLM's layers report, and its vLLM figure is
    vLLM's own; the GPU-shaped coverage gap is the worked example."""
    pytest.importorskip("vllm")
    from vllm.v1.core.kv_cache_utils import get_max_concurrency_for_kv_cache_config

    from vllm_kvguard.fixes.estimation import capacity
    from vllm_kvguard.tools.plan import layer_specs
    from vllm_kvguard.tools.plan.cudagraph import engine_args
    from vllm_kvguard.tools.tiny_models import write_model

    model = write_model(kind, tmp_path / kind)
    r = preflight.plan(model, max_num_seqs=256, max_model_len=2048, num_gpu_blocks=4096,
                       speculative_config=NGRAM3, max_num_batched_tokens=2048)
    # the engine's own objects, built independently of the planner's KV path
    built = layer_specs.build(engine_args(model, max_num_seqs=256, max_model_len=2048,
                                          max_num_batched_tokens=2048,
                                          speculative_config=dict(NGRAM3)),
                              within=lambda vc, specs: preflight.kv_cache_config(
                                  vc, specs, num_gpu_blocks=4096, kv_bytes=None))
    vc, kvc = built.vllm_config, built.result
    cap = capacity.compute(vc, kvc)
    assert [(g["blocks_per_request_plain"], g["blocks_per_request_spec"], g["decode_blocks"])
            for g in r["groups"]] == [(g.plain, g.spec, g.decode) for g in cap.groups]
    assert r["num_blocks"] == kvc.num_blocks == 4096
    assert r["vllm_concurrency"] == pytest.approx(
        get_max_concurrency_for_kv_cache_config(vc, kvc), rel=1e-9)
    if kind == "llama":
        assert [g["kind"] for g in r["groups"]] == ["FullAttentionSpec"]
        assert [x["kind"] for x in r["layers"]] == ["full"]
    else:
        # "M*M-": groups numbered as vLLM numbers them, in the order their layers appear
        kinds = [g["kind"] for g in r["groups"]]
        assert kinds[2] == "FullAttentionSpec" and len(kinds) == 3
        assert {x["kind"] for x in r["layers"]} == {"Mamba2", "full"}
        # the attention page grew to hold a Mamba state, in multiples of 16 tokens; the
        # conv state in the model's dtype as on CUDA (the CPU platform makes it float32)
        assert r["groups"][2]["block_size"] > 16 and r["groups"][2]["block_size"] % 16 == 0
        import torch

        mamba = next(s for s in built.specs.values() if hasattr(s, "mamba_type"))
        assert mamba.dtypes[0] == torch.bfloat16
        mode = vc.cache_config.mamba_cache_mode
        assert all(k.startswith(f"MambaSpec({mode}, nsb=3)") for k in kinds[:2]), kinds
        assert r["blocks_per_request_spec"] > sum(g["blocks_per_request_plain"]
                                                  for g in r["groups"])
    row = next(c for c in r["coverage"] if c["drafts"] == 3 and not c["zero_draft"])
    assert row["requests"] == [1, 256] and row["covered"] == 128
    assert row["first_uncovered"] == 129
    # the setting in the installed vLLM's own terms: decode request sizes from 0.34
    split = "decode_cudagraph_capture_request_sizes" in type(
        vc.compilation_config).__dataclass_fields__
    assert row["fix_setting"] == ({"max_decode_cudagraph_capture_requests": 256} if split
                                  else {"max_cudagraph_capture_size": 1024})
    assert r["verdict"] == "ACTION NEEDED"
    json.dumps(r)                                # --json writes it


def test_plan_states_the_admission_limits(tmp_path):
    """The certificate is stated; a KV cache too small for one max_model_len request is
    named as vLLM itself would refuse it, with the flags to change (no traceback)."""
    pytest.importorskip("vllm")
    from vllm_kvguard.tools.tiny_models import write_model

    model = write_model("llama", tmp_path / "llama")
    roomy = preflight.plan(model, max_num_seqs=4, max_model_len=2048, num_gpu_blocks=4096)
    assert (roomy["admission"]["prompt_limit"], roomy["admission"]["total_limit"]) == \
        (2047, 2048)
    assert any("admission limits: prompt <= 2047 tokens, prompt + max_tokens <= 2048 tokens"
               in line for line in roomy["capacity_lines"])
    assert not any("never" in p for p in roomy["problems"])
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
        assert tight["admission"]["total_limit"] == 2048 - bsz + 1
        assert any("a max_model_len request can never complete" in p
                   for p in tight["problems"])


def test_plan_names_the_warmup_shapes_a_pool_leaves_unwarmed(tmp_path):
    """V2 warmup: vLLM's own warmup function, run over the planner's configs, warms as many
    dummy requests as the pool holds; the plan names the batch sizes left unwarmed and the
    pool that warms them all, and that pool (not one block less) leaves none."""
    pytest.importorskip("vllm")
    pytest.importorskip("vllm.v1.worker.gpu.warmup")
    import dataclasses

    from vllm_kvguard.testing.kv_fixtures import kv_cache_config
    from vllm_kvguard.tools.plan import warmup_check
    from vllm_kvguard.tools.plan.cudagraph import plan_config
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
    from vllm_kvguard.tools.plan import layer_specs
    from vllm_kvguard.tools.plan.cudagraph import engine_args

    built = layer_specs.build(engine_args(model, max_num_seqs=64, max_model_len=256))
    vc = plan_config(model, max_num_seqs=64, max_model_len=256)
    kvc = kv_cache_config(list(dict.fromkeys(built.specs.values())), 40)
    enough = dataclasses.replace(kvc, num_blocks=w["blocks_for_all"])
    assert warmup_check.feasibility(vc, enough)["skipped_shapes"] == []
    short = dataclasses.replace(kvc, num_blocks=w["blocks_for_all"] - 1)
    assert warmup_check.feasibility(vc, short)["skipped_shapes"] == [64, 64]
    v1 = warmup_check.feasibility(vc, kvc, "v1")
    assert warmup_check.problem(v1) is None and "no warmup shape is skipped" in \
        warmup_check.format_lines(v1)[0]


LLAMA_31_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 131072,
    "rope_theta": 500000.0, "vocab_size": 128256, "torch_dtype": "bfloat16",
    "rms_norm_eps": 1e-05, "tie_word_embeddings": False,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"}}


def test_plan_sizes_the_gpu_it_names(tmp_path, capsys):
    """Issue 37: Llama-3.1-8B-Instruct's config, 20000 blocks, 256 sequences, sized as on a
    CUDA GPU from this CPU machine: max_model_len from the config (131072) and the block size
    the installed vLLM's own CUDA code picks for FlashAttention (16 up to 0.33: 8,192 blocks
    per request, 2 full-length requests at once, 2.44x by vLLM; 64 from 0.34, which raised
    its default: 2,048, 9 and 9.77x); ``--block-size 16`` gives 2.44 on every release.
    vLLM's CUDA default token budget for ``vllm serve``; vLLM's log lines stay off stdout;
    columns explained once."""
    pytest.importorskip("vllm")
    from packaging.version import Version
    from vllm.config.cache import CacheConfig
    from vllm.platforms.interface import Platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from vllm_kvguard.tools.plan.cudagraph import plan_config
    from vllm_kvguard.versions import vllm_version

    (tmp_path / "config.json").write_text(json.dumps(LLAMA_31_8B))
    expected = 64 if vllm_version() >= Version("0.34") else 16
    picked = preflight.plan(str(tmp_path), num_gpu_blocks=20000, max_num_seqs=256)
    group = picked["groups"][0]
    assert picked["max_model_len"] == 131072 and group["block_size"] == expected
    assert group["blocks_per_request_plain"] == 131072 // expected      # 8192 / 2048
    # full attention: admitting one takes its whole block table, each running one holds it
    per = 131072 // expected
    assert (picked["blocks_to_admit"], picked["blocks_held_decoding"]) == (per, per)
    assert picked["true_concurrency"] == 1 + (19999 - per) // per      # 9 (bs 64) / 2 (bs 16)
    assert picked["max_num_batched_tokens"] == 2048       # vLLM's serve default, GPU unknown
    pick = getattr(Platform, "_preferred_block_size_for_backends", None)     # vLLM's own path
    if pick is not None:
        vc = plan_config(str(tmp_path), max_num_seqs=256)
        fa = AttentionBackendEnum["FLASH_ATTN"].get_class()
        assert pick([fa], CacheConfig.DEFAULT_BLOCK_SIZE, vc) == expected
    # 16-token blocks asked for: the figures on every release
    assert preflight.main(["--model", str(tmp_path), "--num-gpu-blocks", "20000",
                           "--max-num-seqs", "256", "--block-size", "16"]) == 0
    out = capsys.readouterr().out
    assert "max_model_len=131072" in out and "block_size=16" in out
    assert "plain=8192" in out and "2.44x" in out
    assert " INFO " not in out and " WARNING " not in out        # vLLM's logs: stderr
    assert out.count("columns: drafts =") == 1 and "verdict: OK" in out
    assert "uncovered 1-" not in out


def test_plan_uses_vllms_cuda_token_budget():
    """Without --max-num-batched-tokens, the budget vLLM's own batch defaults give on a CUDA
    GPU for the usage: serve 2048 / LLM 8192 on a small or unknown GPU, serve 8192 on an
    80 GiB one (vLLM's H100 tier), never more than max_num_seqs x max_model_len."""
    pytest.importorskip("vllm")
    budget = preflight.cuda_token_budget
    assert (budget("serve", None, 256, None), budget("llm", None, 256, None)) == (2048, 8192)
    assert (budget("serve", 80, 256, None), budget("llm", 80, 256, None)) == (8192, 16384)
    assert budget("llm", None, 2, 1024) == 2048
    import vllm.engine.arg_utils as arg_utils

    assert not isinstance(arg_utils.current_platform, preflight._CudaGpu)    # restored


def test_plan_names_the_decode_request_sizes_that_cover_a_gap(tmp_path, capsys):
    """Issue 35: ngram k=3, 256 sequences: decode graphs reach 128 requests, 129-256 run
    eager; the plan names them and the setting that covers them in the installed vLLM's
    own terms (0.34: decode request sizes, not the deprecated token fields)."""
    pytest.importorskip("vllm")
    from vllm.config import CompilationConfig

    (tmp_path / "config.json").write_text(json.dumps(LLAMA_31_8B))
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3})
    assert preflight.main(["--model", str(tmp_path), "--num-gpu-blocks", "20000",
                           "--max-num-seqs", "256", "--max-num-batched-tokens", "8192",
                           "--speculative-config", spec]) == 1
    out = capsys.readouterr().out
    assert "uncovered 129-256" in out and "verdict: ACTION NEEDED" in out
    if "decode_cudagraph_capture_request_sizes" in CompilationConfig.__dataclass_fields__:
        assert "max_decode_cudagraph_capture_requests=256" in out
    else:
        assert "max_cudagraph_capture_size=1024" in out
