"""The conformance passes' pytest plugin (``-p conformance_plugin``; runs inside the pin's venv).

``scripts/conformance_runner.py`` loads it in every pass (plain, patched, audit), after
``conformance_platform.py``. It writes config-only local models with a stand-in tokenizer
under the Hugging Face ids vLLM's tests name (into the run's offline Hugging Face cache, so
nothing downloads), in the patched passes loads the plugin as vLLM does
(``vllm.plugins.load_general_plugins()``), counts the ``allocate_slots`` calls that go
through the transaction and the audit's violations per test, gives every test vLLM's own
``skip_global_cleanup`` marker, and writes each test's outcome and the session's statistics
where the runner reads them. Standard library at the top level; vLLM only inside the hooks.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

#: The test-only platform choice (``conformance_platform.py``), loaded in every pass.
PLATFORM_PLUGIN = "conformance_platform"
MODE_ENV = "KVGUARD_CONFORMANCE"
STATS_ENV = "KVGUARD_CONFORMANCE_STATS"
CLEANUP_ENV = "KVGUARD_CONFORMANCE_GLOBAL_CLEANUP"

#: Config-only models under the Hugging Face ids the tests name (their real configs'
#: shapes; weights are never read: the tests build schedulers and KV managers only).
_OPT = {"activation_dropout": 0.0, "activation_function": "relu",
        "architectures": ["OPTForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 2,
        "do_layer_norm_before": True, "dropout": 0.1, "enable_bias": True, "eos_token_id": 2,
        "init_std": 0.02, "layer_norm_elementwise_affine": True, "layerdrop": 0.0,
        "max_position_embeddings": 2048, "model_type": "opt", "pad_token_id": 1,
        "prefix": "</s>", "torch_dtype": "float16", "use_cache": True, "vocab_size": 50272}
_LLAMA_7B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
             "intermediate_size": 11008, "num_attention_heads": 32, "num_hidden_layers": 32,
             "num_key_value_heads": 32, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
             "vocab_size": 32064, "torch_dtype": "float16", "rope_theta": 10000.0}
MODELS = {
    "facebook/opt-125m": {**_OPT, "ffn_dim": 3072, "hidden_size": 768, "num_attention_heads": 12,
                          "num_hidden_layers": 12, "word_embed_proj_dim": 768},
    "facebook/opt-350m": {**_OPT, "do_layer_norm_before": False, "ffn_dim": 4096,
                          "hidden_size": 1024, "num_attention_heads": 16,
                          "num_hidden_layers": 24, "word_embed_proj_dim": 512},
    # ModelConfig()'s default model.
    "Qwen/Qwen3-0.6B": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
                        "hidden_size": 1024, "intermediate_size": 3072, "head_dim": 128,
                        "num_attention_heads": 16, "num_key_value_heads": 8,
                        "num_hidden_layers": 28, "max_position_embeddings": 40960,
                        "max_window_layers": 28, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
                        "sliding_window": None, "use_sliding_window": False,
                        "attention_bias": False, "tie_word_embeddings": True,
                        "torch_dtype": "bfloat16", "vocab_size": 151936, "bos_token_id": 151643,
                        "eos_token_id": 151645, "hidden_act": "silu"},
    "Qwen/Qwen1.5-7B": {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
                        "hidden_size": 4096, "intermediate_size": 11008,
                        "num_attention_heads": 32, "num_key_value_heads": 32,
                        "num_hidden_layers": 32, "max_position_embeddings": 32768,
                        "max_window_layers": 28, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
                        "sliding_window": 32768, "use_sliding_window": False,
                        "tie_word_embeddings": False, "torch_dtype": "bfloat16",
                        "vocab_size": 151936, "bos_token_id": 151643, "eos_token_id": 151643,
                        "hidden_act": "silu"},
    # A hybrid (Gated DeltaNet + attention) MoE with an MTP draft (0.34's test_scheduler.py).
    "Qwen/Qwen3-Next-80B-A3B-Instruct": {
        "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
        "hidden_size": 2048, "intermediate_size": 5120, "num_attention_heads": 16,
        "num_key_value_heads": 2, "head_dim": 256, "num_hidden_layers": 48,
        "full_attention_interval": 4, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "linear_num_key_heads": 16,
        "linear_num_value_heads": 32, "num_experts": 512, "num_experts_per_tok": 10,
        "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
        "decoder_sparse_step": 1, "norm_topk_prob": True, "mlp_only_layers": [],
        "max_position_embeddings": 262144, "rope_theta": 10000000,
        "partial_rotary_factor": 0.25, "rms_norm_eps": 1e-6, "vocab_size": 151936,
        "torch_dtype": "bfloat16", "tie_word_embeddings": False, "attention_bias": False,
        "hidden_act": "silu", "bos_token_id": 151643, "eos_token_id": 151645},
    "llava-hf/llava-1.5-7b-hf": {
        "architectures": ["LlavaForConditionalGeneration"], "model_type": "llava",
        "ignore_index": -100, "image_token_index": 32000, "pad_token_id": 32001,
        "projector_hidden_act": "gelu", "vision_feature_layer": -2,
        "vision_feature_select_strategy": "default", "image_seq_length": 576,
        "torch_dtype": "float16", "tie_word_embeddings": False,
        "text_config": {**_LLAMA_7B, "architectures": None},
        "vision_config": {"model_type": "clip_vision_model", "hidden_size": 1024,
                          "image_size": 336, "intermediate_size": 4096,
                          "num_attention_heads": 16, "num_hidden_layers": 24,
                          "patch_size": 14, "projection_dim": 768, "hidden_act": "quick_gelu",
                          "layer_norm_eps": 1e-5}},
    "Qwen/Qwen2.5-VL-3B-Instruct": {
        "architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl",
        "hidden_size": 2048, "intermediate_size": 11008, "num_attention_heads": 16,
        "num_key_value_heads": 2, "num_hidden_layers": 36, "max_position_embeddings": 128000,
        "max_window_layers": 70, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "sliding_window": 32768, "use_sliding_window": False, "tie_word_embeddings": True,
        "torch_dtype": "bfloat16", "vocab_size": 151936, "bos_token_id": 151643,
        "eos_token_id": 151645, "hidden_act": "silu", "image_token_id": 151655,
        "video_token_id": 151656, "vision_start_token_id": 151652,
        "vision_end_token_id": 151653, "vision_token_id": 151654,
        "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
        "vision_config": {"depth": 32, "hidden_act": "silu", "hidden_size": 1280,
                          "intermediate_size": 3420, "num_heads": 16, "in_chans": 3,
                          "out_hidden_size": 2048, "patch_size": 14,
                          "spatial_merge_size": 2, "spatial_patch_size": 14,
                          "window_size": 112, "fullatt_block_indexes": [7, 15, 23, 31],
                          "tokens_per_second": 2, "temporal_patch_size": 2}},
}
_SNAPSHOT = "c0f0c0f0c0f0c0f0c0f0c0f0c0f0c0f0c0f0c0f0"      # any 40-hex commit id
_STATE: dict = {"txn_calls": 0, "tests_with_txn": 0, "violations": {}, "current": None,
                "outcomes": {}, "fh": None}


def write_models(hub: Path) -> None:
    """Each of :data:`MODELS` as an offline Hugging Face cache entry (config.json and a
    stand-in word-level tokenizer), so ``ModelConfig("facebook/opt-125m")`` resolves it."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    specials = ["<unk>", "<s>", "</s>", "<pad>"]
    vocab = {tok: i for i, tok in enumerate(specials + [f"w{i}" for i in range(252)])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(specials)
    tok_json = tok.to_str()
    tok_cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
               "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>",
               "model_max_length": 1 << 20, "clean_up_tokenization_spaces": False}
    for repo_id, config in MODELS.items():
        entry = hub / ("models--" + repo_id.replace("/", "--"))
        snap = entry / "snapshots" / _SNAPSHOT
        snap.mkdir(parents=True, exist_ok=True)
        (snap / "config.json").write_text(json.dumps({"_name_or_path": repo_id, **config},
                                                     indent=1))
        (snap / "tokenizer.json").write_text(tok_json)
        (snap / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=1))
        (entry / "refs").mkdir(exist_ok=True)
        (entry / "refs" / "main").write_text(_SNAPSHOT)


def _mode() -> str | None:
    return os.environ.get(MODE_ENV)


def pytest_configure(config):
    mode = _mode()
    if mode is None:
        return
    hub = os.environ.get("HF_HUB_CACHE")
    if hub:
        write_models(Path(hub))
    stats = os.environ.get(STATS_ENV)
    if stats:
        _STATE["fh"] = open(Path(stats).with_suffix(".outcomes.jsonl"), "a")
    if mode == "plain":
        return
    import vllm.plugins                                   # as vLLM loads its plugins

    vllm.plugins.load_general_plugins()
    from vllm_kvguard import activation
    from vllm_kvguard.fixes.transaction import audit, rollback

    _STATE["activation"] = activation.results()
    original = rollback.Rollback.transaction

    def transaction(self, manager, fn):                   # count the transaction's calls
        txn = original(self, manager, fn)
        if txn is None:
            return None

        def allocate_slots(*args, **kwargs):
            _STATE["txn_calls"] += 1
            _STATE["test_txn"] = True
            return txn(*args, **kwargs)

        return allocate_slots

    rollback.Rollback.transaction = transaction
    _STATE["fix_module"] = rollback
    report = audit.report_violations

    def report_violations(result, where="after schedule"):
        test = _STATE["current"] or "(outside a test)"
        found = _STATE["violations"].setdefault(test, [])
        if len(found) < 20:
            found.extend(str(v) for v in result.violations[:20 - len(found)])
        return report(result, where)

    audit.report_violations = report_violations


def pytest_collection_modifyitems(config, items):
    """vLLM's own marker for CPU unit tests: no per-test gc + distributed teardown."""
    if _mode() is None or os.environ.get(CLEANUP_ENV):
        return
    for item in items:
        item.add_marker("skip_global_cleanup")


def pytest_runtest_logstart(nodeid, location):
    _STATE["current"] = nodeid
    _STATE["test_txn"] = False
    _STATE["outcomes"][nodeid] = "passed"


def pytest_runtest_logreport(report):
    if _mode() is None:
        return
    was = _STATE["outcomes"].get(report.nodeid, "passed")
    if report.failed:
        now = "failed"
    elif report.skipped:
        now = "xfailed" if hasattr(report, "wasxfail") else "skipped"
    elif report.when == "call" and hasattr(report, "wasxfail"):
        now = "xpassed"
    else:
        now = "passed"
    if was == "failed" or (was in ("skipped", "xfailed") and now == "passed"):
        now = was
    _STATE["outcomes"][report.nodeid] = now


def pytest_runtest_logfinish(nodeid, location):
    if _mode() is None:
        return
    if _STATE.get("test_txn"):
        _STATE["tests_with_txn"] += 1
    _STATE["current"] = None
    fh = _STATE["fh"]
    if fh is not None:
        fh.write(json.dumps({"nodeid": nodeid, "outcome": _STATE["outcomes"][nodeid]}) + "\n")
        fh.flush()


def pytest_sessionfinish(session, exitstatus):
    mode = _mode()
    stats = os.environ.get(STATS_ENV)
    if mode is None or not stats:
        return
    out = {"mode": mode, "exitstatus": int(exitstatus), "txn_calls": _STATE["txn_calls"],
           "tests_with_txn": _STATE["tests_with_txn"], "violations": _STATE["violations"],
           "activation": _STATE.get("activation"), "wrapped": [], "tripped": [],
           "counters": {},
           "platform": getattr(sys.modules.get(PLATFORM_PLUGIN), "CHOICE", None)}
    if "vllm_kvguard" in sys.modules:
        from vllm_kvguard import activation, hostcall, report
        from vllm_kvguard.patches import ALL_PATCHES

        out["wrapped"] = activation.wrapped_targets()
        out["tripped"] = [p.name for p in ALL_PATCHES if hostcall.tripped(p.name)]
        out["counters"] = report.snapshot()
        if mode != "plain":
            from vllm_kvguard.patches import allocator

            fix = allocator._State.fix
            out["rollback_disabled"] = getattr(fix, "disabled", None)
    Path(stats).write_text(json.dumps(out, indent=1) + "\n")

