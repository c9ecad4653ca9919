"""``kvguard plan``: what an operator needs to know before deploying, from a model's
``config.json`` alone (no weights, no GPU).

    kvguard plan --model DIR --max-num-seqs 256 --max-model-len 8192 \\
        --speculative-config '{"method": "ngram", "num_speculative_tokens": 3, \\
                               "prompt_lookup_max": 3}' --num-gpu-blocks 20000

* per KV-cache group: the spec-aware blocks one request holds at ``max_model_len`` and the
  true maximum concurrency beside vLLM's own figure (:mod:`vllm_kvguard.fixes.estimation.capacity` on a
  ``KVCacheConfig`` built by vLLM's own ``get_kv_cache_configs``);
* the largest admissible request (:mod:`vllm_kvguard.fixes.estimation.admission`), and a problem
  when a ``max_model_len`` request can never fit;
* CUDA-graph coverage per draft length, the first uncovered shape and the setting that
  covers it (:mod:`vllm_kvguard.fixes.cudagraph.coverage`, sized as on a CUDA GPU by
  :func:`vllm_kvguard.tools.plan.plan_config`);
* warmup feasibility: the V2 warmup shapes the pool would leave unwarmed
  (:mod:`vllm_kvguard.tools.warmup_check`);
* one verdict line. ``--json PATH`` (``-`` for stdout) writes the same as JSON.

Sized for ``--device`` (default cuda) as the installed vLLM would size it there, from its
own code: FlashAttention's block size, ``max_model_len`` from the config, and the default
token budget for ``--usage`` (``vllm serve`` or the ``LLM`` class) on that GPU tier.
vLLM's own log lines go to stderr. KV specs are derived from the config as vLLM's layers
derive them: full attention (or sliding window where the model has one) and Mamba layers.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path


class PlanError(Exception):
    """A bad argument: the message names it and its valid form."""


def _json_arg(name: str, text: str | None) -> dict:
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise PlanError(f"{name}: not valid JSON ({exc.msg} at char {exc.pos}); expected an "
                        f"object, e.g. {name} '{{\"key\": value}}'") from None
    if not isinstance(value, dict):
        raise PlanError(f"{name}: expected a JSON object, got {type(value).__name__}")
    return value


def _model_dir(path: str) -> str:
    p = Path(path)
    if not (p / "config.json").is_file():
        raise PlanError(f"--model {path}: no config.json there; expected a local model "
                        f"directory containing config.json (weights are not needed)")
    try:
        json.loads((p / "config.json").read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise PlanError(f"--model {path}: config.json is not valid JSON ({exc})") from None
    return str(p)


# --------------------------------------------------------------------------- KV specs
_ATTENTION_TYPES = {"attention", "full_attention", "sliding_attention", "hybrid"}
_MAMBA_TYPES = {"mamba", "mamba2", "linear_attention"}


def kv_cache_specs(vllm_config) -> dict:
    """``{layer name: KVCacheSpec}`` as the model's attention / Mamba layers would report
    them for this config (the same fields vLLM's layers fill in)."""
    import torch
    from vllm.v1 import kv_cache_interface as kci

    mc, cc, pc = vllm_config.model_config, vllm_config.cache_config, vllm_config.parallel_config
    dtype = mc.dtype if cc.cache_dtype in (None, "auto") else getattr(
        torch, str(cc.cache_dtype).replace("fp8", "float8_e4m3fn"), mc.dtype)
    n_attn = mc.get_num_layers_by_block_type(pc, "attention")
    n_mamba = mc.get_num_layers_by_block_type(pc, "mamba") if mc.is_hybrid else 0
    types = (getattr(mc.hf_text_config, "layers_block_type", None)
             or getattr(mc.hf_text_config, "layer_types", None))
    if mc.is_hybrid and types and not n_mamba:     # names vLLM's count does not know
        n_attn = sum(t in _ATTENTION_TYPES for t in types)
        n_mamba = sum(t in _MAMBA_TYPES for t in types)
    # In the model's layer order where the config gives it: vLLM numbers the KV-cache
    # groups in the order their layers first appear.
    order = [("attn" if t in _ATTENTION_TYPES else "mamba") for t in types or ()
             if t in _ATTENTION_TYPES or t in _MAMBA_TYPES]
    if not mc.is_hybrid or (order.count("attn"), order.count("mamba")) != (n_attn, n_mamba):
        order = ["attn"] * n_attn + ["mamba"] * n_mamba
    head = dict(block_size=cc.block_size, num_kv_heads=mc.get_num_kv_heads(pc),
                head_size=mc.get_head_size(), dtype=dtype)
    window = mc.get_sliding_window()
    kinds = {"attn": kci.SlidingWindowSpec(**head, sliding_window=window) if window
             else kci.FullAttentionSpec(**head)}
    if n_mamba:
        import inspect

        from vllm.model_executor.models import ModelRegistry

        cls, _ = ModelRegistry.resolve_model_cls(mc.architectures, model_config=mc)
        shapes = tuple(cls.get_mamba_state_shape_from_config(vllm_config))
        dtypes = tuple(cls.get_mamba_state_dtype_from_config(vllm_config))
        params = inspect.signature(kci.MambaSpec).parameters
        extra = dict(page_size_padded=cc.mamba_page_size_padded,
                     mamba_cache_mode=cc.mamba_cache_mode,
                     num_speculative_blocks=int(getattr(vllm_config, "num_speculative_tokens",
                                                        0) or 0),
                     mamba_type=getattr(cls, "mamba_type", None) or "mamba2")
        extra = {k: v for k, v in extra.items() if k in params and v is not None}
        kinds["mamba"] = kci.MambaSpec(shapes=shapes, dtypes=dtypes,
                                       block_size=cc.mamba_block_size, **extra)
    return {f"layers.{i}.{kind}": kinds[kind] for i, kind in enumerate(order)}


def kv_cache_config(vllm_config, *, num_gpu_blocks: int | None, kv_bytes: int | None):
    """The ``KVCacheConfig`` EngineCore would build over :func:`kv_cache_specs`: the same
    calls in the same order, through the names ``vllm.v1.engine.core`` binds on each pin
    (vLLM 0.29+ resolves a KV cache layout first; 0.33 moved ``get_kv_cache_configs`` to
    ``kv_cache_planning`` and groups the layers before it)."""
    from vllm.v1.engine import core

    specs = kv_cache_specs(vllm_config)
    if not specs:
        raise PlanError("no attention or Mamba layers found in this config.json")
    if hasattr(core, "resolve_kv_cache_layout"):
        from vllm.v1.kv_cache_layout import KVCacheLayout

        core.resolve_kv_cache_layout(vllm_config, [[x.name for x in KVCacheLayout]],
                                     list(specs.values()))
    if num_gpu_blocks is not None:
        vllm_config.cache_config.num_gpu_blocks_override = num_gpu_blocks
        page = max(s.page_size_bytes for s in specs.values())
        kv_bytes = (num_gpu_blocks + 1) * page * len(specs)   # enough; the override decides
    args: list = [vllm_config, [specs], [int(kv_bytes)]]
    if hasattr(core, "get_global_kv_cache_groups"):
        groups = core.get_global_kv_cache_groups(vllm_config, [specs])
        vllm_config.adjust_dcp_kv_cache_interleave_size(groups)
        args.append(groups)
    try:
        return core.get_kv_cache_configs(*args)[0]
    except ValueError as exc:            # vLLM's own startup check: max_model_len won't fit
        first = str(exc).strip().split(". Try")[0]
        raise PlanError(f"vLLM would refuse to start with this KV cache: {first}. Lower "
                        f"--max-model-len, or raise --num-gpu-blocks / --gpu-memory-gib"
                        ) from None


def align_block_size(vllm_config, attention_backend: str) -> None:
    """What the executor does once the model's layers exist (``Platform.
    update_block_size_for_backend``): a hybrid model's attention block size grows, in the
    backend's kernel block multiples, until one page holds a Mamba state, and the Mamba
    page is padded to it. ``attention_backend``: an ``AttentionBackendEnum`` name."""
    if not vllm_config.model_config.is_hybrid:
        return
    from vllm.platforms.interface import Platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    try:
        backend = AttentionBackendEnum[attention_backend].get_class()
    except (KeyError, ImportError) as exc:
        raise PlanError(f"--attention-backend {attention_backend}: {type(exc).__name__} "
                        f"{exc}; expected an attention backend vLLM knows, e.g. FLASH_ATTN "
                        f"(CUDA) or CPU_ATTN") from None
    Platform._align_hybrid_block_size(vllm_config, backend)


def attention_block_size(vllm_config, device: str, block_size: int | None) -> str:
    """Set the attention block size vLLM would pick on ``device`` (before any hybrid
    alignment) and return the attention backend to align with. ``cuda``: FlashAttention's
    preferred size from ``CacheConfig.DEFAULT_BLOCK_SIZE``, vLLM's own CUDA platform path
    (``Platform.update_block_size_for_backend``); ``cpu``: the CPU platform's choice, as
    the config was built. ``block_size``: the user's ``--block-size``, kept as vLLM keeps it."""
    cc = vllm_config.cache_config
    backend = "FLASH_ATTN" if device == "cuda" else "CPU_ATTN"
    if block_size is not None:
        cc.block_size = block_size
        if hasattr(cc, "user_specified_block_size"):
            cc.user_specified_block_size = True
        return backend
    if device == "cuda":
        cc.block_size = cuda_block_size(vllm_config)
    return backend


def cuda_block_size(vllm_config) -> int:
    """FlashAttention's block size on a CUDA GPU, by the installed vLLM's own platform code
    (``Platform.update_block_size_for_backend``'s first phase: 16 up to 0.33; 0.34 raised
    ``CacheConfig.DEFAULT_BLOCK_SIZE`` to 64)."""
    from vllm.config import set_current_vllm_config
    from vllm.config.cache import CacheConfig
    from vllm.platforms.interface import Platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    default = int(CacheConfig.DEFAULT_BLOCK_SIZE)
    try:
        cls = AttentionBackendEnum["FLASH_ATTN"].get_class()
    except ImportError:              # no FlashAttention class here: vLLM's default
        return default
    pick = getattr(Platform, "_preferred_block_size_for_backends", None)     # 0.32+
    if pick is not None:
        return int(pick([cls], default, vllm_config))
    with set_current_vllm_config(vllm_config):                               # 0.27.1
        return int(cls.get_preferred_block_size(default))


class _CudaGpu:
    """What ``EngineArgs.get_batch_defaults`` asks of a CUDA platform: the device's memory
    (``--gpu-memory-gib``; unknown raises, and vLLM falls back as when it cannot query)."""

    def __init__(self, gib: float | None):
        self.gib = gib

    def get_device_total_memory(self, device_id: int = 0) -> int:
        if self.gib is None:
            raise RuntimeError("GPU memory not given")
        return int(self.gib * 2**30)

    def get_device_name(self, device_id: int = 0) -> str:
        return "cuda"

    def is_device_capability(self, *_a, **_k) -> bool:
        return False

    def is_tpu(self) -> bool:
        return False

    def is_cpu(self) -> bool:
        return False


USAGE = {"serve": "OPENAI_API_SERVER", "llm": "LLM_CLASS"}
USAGE_TEXT = {"serve": "vllm serve", "llm": "the LLM class"}


def cuda_token_budget(usage: str, gpu_memory_gib: float | None, max_num_seqs: int,
                      max_model_len: int | None) -> int:
    """vLLM's default ``max_num_batched_tokens`` on a CUDA GPU for ``usage`` (``serve``:
    ``vllm serve``; ``llm``: the ``LLM`` class), by the installed vLLM's own
    ``EngineArgs.get_batch_defaults`` asked on a stand-in GPU, capped as vLLM caps it."""
    from vllm.config import SchedulerConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.usage.usage_lib import UsageContext

    from vllm_kvguard.patches.cudagraph import PLATFORM_BINDINGS

    binding = next(d for d in PLATFORM_BINDINGS if d.module == "vllm.engine.arg_utils")
    if not binding.replace(_CudaGpu(gpu_memory_gib)):
        raise PlanError("this vLLM's EngineArgs reads no platform; give "
                        "--max-num-batched-tokens")
    try:
        defaults, _ = EngineArgs.get_batch_defaults(1)
    finally:
        binding.restore()
    tokens = defaults.get(UsageContext[USAGE[usage]],
                          SchedulerConfig.DEFAULT_MAX_NUM_BATCHED_TOKENS)
    return min(tokens, max_num_seqs * max_model_len) if max_model_len else tokens


# ------------------------------------------------------------------------------- plan
def plan(model: str, *, max_num_seqs: int = 256, max_model_len: int | None = None,
         max_num_batched_tokens: int | None = None, speculative_config: dict | None = None,
         compilation_config: dict | None = None, num_gpu_blocks: int | None = None,
         gpu_memory_gib: float | None = None, gpu_memory_utilization: float = 0.9,
         weights_gib: float = 0.0, runner: str | None = None, device: str = "cuda",
         block_size: int | None = None, usage: str = "serve",
         cudagraph_mode: str = "FULL_AND_PIECEWISE",
         enable_prefix_caching: bool | None = None,
         attention_backend: str | None = None) -> dict:
    from vllm_kvguard.fixes.estimation import admission, capacity
    from vllm_kvguard.fixes.cudagraph.coverage import format_table
    from vllm_kvguard.fixes.cudagraph.planner import audit
    from vllm_kvguard.tools import warmup_check
    from vllm_kvguard.tools.plan import default_runner, plan_config, plan_owner

    runner = runner or default_runner()

    kw: dict = dict(max_num_seqs=max_num_seqs)
    if max_model_len:
        kw["max_model_len"] = max_model_len
    if not max_num_batched_tokens and device == "cuda":
        max_num_batched_tokens = cuda_token_budget(usage, gpu_memory_gib, max_num_seqs,
                                                   max_model_len)
    if max_num_batched_tokens:
        kw["max_num_batched_tokens"] = max_num_batched_tokens
    if enable_prefix_caching is not None:
        kw["enable_prefix_caching"] = enable_prefix_caching
    if speculative_config:
        kw["speculative_config"] = dict(speculative_config)
    kw["compilation_config"] = dict(compilation_config or {})
    try:
        vc = plan_config(model, cudagraph_mode=cudagraph_mode, runner=runner, **kw)
    except Exception as exc:
        raise PlanError(f"vLLM rejected these settings: {type(exc).__name__}: "
                        f"{str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
                        ) from None
    kv_bytes = None
    if num_gpu_blocks is None:
        if gpu_memory_gib is None:
            raise PlanError("give --num-gpu-blocks N, or --gpu-memory-gib GiB (with "
                            "--gpu-memory-utilization, --weights-gib)")
        kv_bytes = int((gpu_memory_gib * gpu_memory_utilization - weights_gib) * 2**30)
        if kv_bytes <= 0:
            raise PlanError("--gpu-memory-gib x --gpu-memory-utilization - --weights-gib "
                            "leaves no KV cache memory")
    backend = attention_block_size(vc, device, block_size)
    align_block_size(vc, attention_backend or backend)
    kvc = kv_cache_config(vc, num_gpu_blocks=num_gpu_blocks, kv_bytes=kv_bytes)
    cap = capacity.compute(vc, kvc)
    cov = audit(plan_owner(vc, runner), cap.decodes_that_fit if cap.has_mamba else None)
    gaps = [r for r in cov.rows if r.first_gap is not None and not r.family.no_draft]
    cert = admission.from_configs(vc, kvc)
    largest = cert.largest
    problems = [w.rstrip(".") for w in cap.warnings]
    if cap.vllm_concurrency is not None and \
            round(cap.vllm_concurrency, 2) == round(cap.true_concurrency, 2):
        problems = [p for p in problems if "concurrency" not in p]   # same figure twice
    if cert.max_total < cert.max_model_len:
        group, blocks = cert.bounding_group(cert.max_model_len)
        problems.append(f"a max_model_len request can never fit: at {cert.max_model_len} "
                        f"tokens it holds at least {cert.need(cert.max_model_len)} blocks "
                        f"(group {group}: {blocks}) of {cert.usable} usable; requests "
                        f"reaching more than {largest} tokens are failed. Lower "
                        f"--max-model-len to {cert.max_total} or give the KV cache more memory")
    for r in gaps:
        problems.append(f"CUDA graphs: {r.family.q - 1} drafts, {r.first_gap} requests run "
                        f"{r.gap_mode}; fix: {r.fix}")
    try:
        warmup = warmup_check.feasibility(vc, kvc, runner)
        problems += [p for p in [warmup_check.problem(warmup)] if p]
        warmup_lines = warmup_check.format_lines(warmup)
    except Exception as exc:        # this vLLM's warmup is not modelled: say so, go on
        warmup = None
        warmup_lines = [f"warmup feasibility: not checked on this vLLM "
                        f"({type(exc).__name__}: {exc})"]
    verdict = "OK" if not problems else "ACTION NEEDED"
    return {
        "model": model, "architecture": list(vc.model_config.architectures),
        "device": device, "usage": usage,
        "max_num_batched_tokens": int(vc.scheduler_config.max_num_batched_tokens),
        "max_num_seqs": cap.max_num_seqs, "max_model_len": cap.max_model_len,
        "num_speculative_tokens": cap.num_spec_tokens, "lookahead": cap.lookahead,
        "num_blocks": cap.num_blocks, "usable_blocks": cap.usable,
        "groups": [dict(index=g.index, kind=g.kind, block_size=g.block_size,
                        layers=len(kvc.kv_cache_groups[g.index].layer_names),
                        blocks_per_request_plain=g.plain, blocks_per_request_spec=g.spec,
                        decode_blocks=g.decode) for g in cap.groups],
        "blocks_per_request_spec": cap.per_request_spec,
        "true_concurrency": round(cap.true_concurrency, 4),
        "vllm_concurrency": None if cap.vllm_concurrency is None
        else round(cap.vllm_concurrency, 4),
        "decodes_that_fit": cap.decodes_that_fit if cap.has_mamba else None,
        "largest_admissible_tokens": largest,
        "capacity_lines": capacity.format_report(cap) + ["  " + cert.statement()],
        "coverage": [dict(drafts=r.family.q - 1, zero_draft=r.family.no_draft,
                          requests=[r.family.lo, r.family.hi], covered=r.covered,
                          first_uncovered=r.first_gap, mode_there=r.gap_mode or None,
                          fix=r.fix or None, fix_setting=r.fix_setting or None)
                     for r in cov.rows],
        "coverage_table": format_table(cov),
        "warmup": warmup, "warmup_lines": warmup_lines,
        "problems": problems, "verdict": verdict,
    }


def format_plan(result: dict) -> str:
    out = [f"planned for: --device {result['device']} ({USAGE_TEXT[result['usage']]}), "
           f"max_num_seqs={result['max_num_seqs']}, max_num_batched_tokens="
           f"{result['max_num_batched_tokens']}", *result["capacity_lines"], "",
           result["coverage_table"], "", *result["warmup_lines"], ""]
    out.append(f"verdict: {result['verdict']}" + (
        "" if not result["problems"] else " - " + "; ".join(result["problems"])))
    return "\n".join(out)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvguard plan", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Pre-flight planner: per-group KV capacity (spec-aware) and CUDA-graph "
                    "coverage\nfrom a model's config.json, sized as on a CUDA GPU "
                    "(no weights, no GPU).",
        epilog="example: kvguard plan --model ./my-model --max-num-seqs 256 "
               "--num-gpu-blocks 20000 \\\n  --speculative-config "
               "'{\"method\": \"ngram\", \"num_speculative_tokens\": 3, "
               "\"prompt_lookup_max\": 3}'")
    p.add_argument("--model", required=True, help="local model directory with config.json")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--speculative-config", default=None, help="JSON, as vLLM's flag")
    p.add_argument("--compilation-config", default=None, help="JSON, as vLLM's flag")
    mem = p.add_mutually_exclusive_group()
    mem.add_argument("--num-gpu-blocks", type=int, default=None,
                     help="KV blocks (as vLLM's --num-gpu-blocks-override)")
    mem.add_argument("--gpu-memory-gib", type=float, default=None, help="GPU memory, GiB")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--weights-gib", type=float, default=0.0,
                   help="with --gpu-memory-gib: memory not for KV (weights, activations)")
    p.add_argument("--runner", choices=("v1", "v2"), default=None,
                   help="model runner (default: v1 where vLLM has it; v2 from vLLM 0.34)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="size as vLLM would on this device (default cuda: FlashAttention's "
                        "block size; cpu: vLLM-CPU's)")
    p.add_argument("--block-size", type=int, default=None,
                   help="KV block size in tokens, as vLLM's --block-size (default: vLLM's "
                        "choice on --device)")
    p.add_argument("--usage", choices=tuple(USAGE), default="serve",
                   help="how vLLM is started, for its default --max-num-batched-tokens on "
                        "CUDA: serve = vllm serve (default), llm = the LLM class; the GPU "
                        "tier comes from --gpu-memory-gib (unknown: vLLM's fallback)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=None, help="as vLLM's flag (default: vLLM's choice)")
    p.add_argument("--cudagraph-mode", default="FULL_AND_PIECEWISE",
                   choices=("FULL_DECODE_ONLY", "FULL_AND_PIECEWISE", "PIECEWISE", "FULL",
                            "NONE"), help="NONE: what an eager engine (and vLLM on CPU) "
                                          "runs; default FULL_AND_PIECEWISE")
    p.add_argument("--attention-backend", default=None, metavar="NAME",
                   help="the attention backend whose kernel block sizes a hybrid model's "
                        "block size aligns to (default: FLASH_ATTN with --device cuda, "
                        "CPU_ATTN with --device cpu)")
    p.add_argument("--json", metavar="PATH", default=None, help="write JSON here (- = stdout)")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    a = parser.parse_args(argv)
    stdout = sys.stdout
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # vLLM's lines: stderr
    try:
        model = _model_dir(a.model)
        spec = _json_arg("--speculative-config", a.speculative_config)
        comp = _json_arg("--compilation-config", a.compilation_config)
        for name in ("max_num_seqs", "max_model_len", "num_gpu_blocks", "block_size"):
            v = getattr(a, name)
            if v is not None and v <= 0:
                raise PlanError(f"--{name.replace('_', '-')} {v}: expected a positive integer")
        if not 0 < a.gpu_memory_utilization <= 1:
            raise PlanError(f"--gpu-memory-utilization {a.gpu_memory_utilization}: expected "
                            f"a fraction in (0, 1]")
        sys.stdout = sys.stderr          # anything vLLM prints while building: stderr
        try:
            result = plan(model, max_num_seqs=a.max_num_seqs, max_model_len=a.max_model_len,
                          max_num_batched_tokens=a.max_num_batched_tokens,
                          speculative_config=spec, compilation_config=comp,
                          num_gpu_blocks=a.num_gpu_blocks, gpu_memory_gib=a.gpu_memory_gib,
                          gpu_memory_utilization=a.gpu_memory_utilization,
                          weights_gib=a.weights_gib, runner=a.runner, device=a.device,
                          block_size=a.block_size, usage=a.usage,
                          cudagraph_mode=a.cudagraph_mode,
                          enable_prefix_caching=a.enable_prefix_caching,
                          attention_backend=a.attention_backend)
        finally:
            sys.stdout = stdout
    except PlanError as exc:
        print(f"kvguard plan: {exc}", file=sys.stderr)
        return 2
    if a.json == "-":
        json.dump({k: v for k, v in result.items()}, stdout, indent=1)
        stdout.write("\n")
    else:
        print(format_plan(result), file=stdout)
        if a.json:
            Path(a.json).write_text(json.dumps(result, indent=1) + "\n")
            print(f"wrote {a.json}", file=stdout)
    return 0 if result["verdict"] == "OK" else 1


if __name__ == "__main__":
    sys.exit(main())
