"""Tiny dummy-weight models embedded in the package (no download): a config.json is all
vLLM needs with ``load_format="dummy"`` and ``skip_tokenizer_init=True``. Tests, the A/B
tool and the CUDA-graph coverage planner build real engines and configs from them on any
machine, offline, in seconds. :func:`make_vllm_config` / :func:`make_scheduler`: vLLM's
own ``VllmConfig`` and ``Scheduler`` over the tiny Llama with a hand-sized pool, no engine
(``kvguard demo``'s admission check; the test scaffolding imports them from here). Standard
library only at import: vLLM and torch are imported by the functions that need them."""
from __future__ import annotations

import hashlib
import inspect
import json
import os
import tempfile
from pathlib import Path

LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
    "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
    "num_hidden_layers": 2, "vocab_size": 1024, "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2,
    "tie_word_embeddings": False, "rope_theta": 10000.0,
}

# 2 Mamba2 layers, 1 attention, 1 MLP ("M*M-").
NEMOTRON_H = {
    "architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h", "vocab_size": 1024,
    "hidden_size": 128, "hybrid_override_pattern": "M*M-", "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 32, "intermediate_size": 256,
    "mlp_hidden_act": "relu2", "mamba_num_heads": 8, "mamba_head_dim": 32, "n_groups": 1,
    "ssm_state_size": 32, "conv_kernel": 4, "expand": 2, "chunk_size": 64,
    "mamba_hidden_act": "silu", "use_conv_bias": True, "mamba_proj_bias": False,
    "use_bias": False, "layer_norm_epsilon": 1e-5, "max_position_embeddings": 2048,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 1,
    "eos_token_id": 2, "pad_token_id": 0,
}

# Gemma-3-style: 1 sliding-window layer (window 32), 1 full-attention layer; no logit
# softcapping (vLLM's CPU attention runs it).
GEMMA3_SW = {
    "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": 1024,
    "hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 32, "num_hidden_layers": 2, "sliding_window": 32,
    "layer_types": ["sliding_attention", "full_attention"], "sliding_window_pattern": 2,
    "max_position_embeddings": 2048, "rope_theta": 10000.0, "rope_local_base_freq": 10000.0,
    "query_pre_attn_scalar": 32, "hidden_activation": "gelu_pytorch_tanh",
    "rms_norm_eps": 1e-6, "attn_logit_softcapping": None, "final_logit_softcapping": None,
    "tie_word_embeddings": True, "torch_dtype": "bfloat16", "bos_token_id": 1,
    "eos_token_id": 2, "pad_token_id": 0,
}

MODELS = {"llama": LLAMA, "nemotron_h": NEMOTRON_H, "gemma3_sw": GEMMA3_SW}


def write_model(kind: str, directory: str | os.PathLike | None = None) -> str:
    """Write ``kind``'s config.json into ``directory`` and return it. Without a directory:
    one shared directory per model content under the user's cache, written atomically, so
    repeated runs (``kvguard plan``, the benchmarks) reuse it and leave nothing in /tmp."""
    if kind not in MODELS:
        raise ValueError(f"unknown tiny model {kind!r}; valid: {', '.join(MODELS)}")
    text = json.dumps(MODELS[kind], indent=1)
    if directory is None:
        return _shared(kind, text)
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(text)
    return str(path)


def _shared(kind: str, text: str) -> str:
    digest = hashlib.sha256(text.encode()).hexdigest()[:12]
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    path = root / "vllm-kvguard" / "tiny-models" / f"{kind}-{digest}"
    try:
        config = path / "config.json"
        if not (config.is_file() and config.read_text() == text):
            path.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path, prefix=".config-")
            try:
                with os.fdopen(fd, "w") as fh:
                    fh.write(text)
                os.replace(tmp, config)         # atomic: a concurrent reader sees old or new
            except OSError:
                os.unlink(tmp)                  # no half-written file left in the cache
                raise
        return str(path)
    except OSError:                             # no writable cache: a temp dir, as before
        return write_model(kind, tempfile.mkdtemp(prefix=f"kvguard-{kind}-"))


def engine_kwargs(model_dir: str, **overrides) -> dict:
    """The ``LLM(...)`` keyword arguments for a tiny dummy-weight engine on CPU."""
    kw = dict(model=model_dir, load_format="dummy", skip_tokenizer_init=True,
              dtype="bfloat16", enforce_eager=True, max_model_len=512, max_num_seqs=8,
              seed=0)
    kw.update(overrides)
    return kw


# ------------------------------------------------------------- a real Scheduler, no engine
BLOCK_SIZE = 16


def accepted(fn, kwargs: dict) -> dict:
    """``kwargs`` restricted to the parameters ``fn`` accepts (version tolerance)."""
    params = inspect.signature(fn).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in params}


def attention_spec(block_size: int = BLOCK_SIZE, kind: str = "FullAttentionSpec", **extra):
    import torch
    from vllm.v1 import kv_cache_interface as kci

    cls = getattr(kci, kind)
    return cls(block_size=block_size, num_kv_heads=2, head_size=16, dtype=torch.bfloat16,
               **extra)


def kv_cache_config(specs, num_blocks: int, retention: int | None = None):
    """One KV-cache group per spec; ``retention``: ``prefix_cache_retention_interval``
    (None: dense, vLLM's ``KVCacheConfig`` default; 0: sparse, its engine default)."""
    from vllm.v1 import kv_cache_interface as kci

    groups = [kci.KVCacheGroupSpec([f"layer{i}"], s) for i, s in enumerate(specs)]
    return kci.KVCacheConfig(**accepted(kci.KVCacheConfig, dict(
        num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups,
        prefix_cache_retention_interval=retention)))


_configs: dict = {}


def make_vllm_config(*, num_gpu_blocks: int, block_size: int = BLOCK_SIZE,
                     max_model_len: int = 512, max_num_seqs: int = 8,
                     max_num_batched_tokens: int = 512, enable_prefix_caching: bool = True):
    """A ``VllmConfig`` for the embedded tiny Llama (no download, no tokenizer)."""
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig

    key = ("model", max_model_len)
    if key not in _configs:
        _configs[key] = ModelConfig(**accepted(ModelConfig, dict(
            model=write_model("llama"), skip_tokenizer_init=True,
            max_model_len=max_model_len, dtype="bfloat16")))
    model_config = _configs[key]
    sched = SchedulerConfig(**accepted(SchedulerConfig, dict(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len, is_encoder_decoder=False)))
    cache = CacheConfig(**accepted(CacheConfig, dict(
        block_size=block_size, enable_prefix_caching=enable_prefix_caching)))
    config = VllmConfig(**accepted(VllmConfig, dict(
        model_config=model_config, scheduler_config=sched, cache_config=cache,
        device_config=_cpu_device())))
    config.cache_config.num_gpu_blocks = num_gpu_blocks
    return config


def _cpu_device():
    """The CPU device explicitly: a CUDA build of vLLM on this machine cannot infer one."""
    from vllm.config import DeviceConfig

    return DeviceConfig(device="cpu")


def make_scheduler(*, num_gpu_blocks: int, block_size: int = BLOCK_SIZE, **config_kw):
    """A real ``Scheduler`` with a full-attention pool of ``num_gpu_blocks`` (incl. null)."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    config = make_vllm_config(num_gpu_blocks=num_gpu_blocks, block_size=block_size,
                              **config_kw)
    kcc = kv_cache_config([attention_spec(block_size)], num_gpu_blocks)
    return Scheduler(**accepted(Scheduler.__init__, dict(
        vllm_config=config, kv_cache_config=kcc,
        structured_output_manager=StructuredOutputManager(config), block_size=block_size,
        log_stats=False)))
