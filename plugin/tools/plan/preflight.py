"""``kvguard plan``: what an operator needs to know before deploying, from a model's
``config.json`` alone (no weights, no GPU).

    kvguard plan --model DIR --max-num-seqs 256 --max-model-len 8192 \\
        --speculative-config '{"method": "ngram", "num_speculative_tokens": 3, \\
                               "prompt_lookup_max": 3}' --num-gpu-blocks 20000

* per KV-cache group: the spec-aware peak blocks of one request (what admitting it takes)
  and what it holds decoding at ``max_model_len``; the max_model_len requests vLLM's
  scheduler runs at once beside vLLM's own figure (:mod:`vllm_kvguard.fixes.estimation.capacity`
  on a ``KVCacheConfig`` built by vLLM's own ``get_kv_cache_configs``, admission counted by
  vLLM's own gate on a scheduler built as EngineCore builds it);
* the admission limits (:mod:`vllm_kvguard.fixes.estimation.certificate`), and a problem
  when a ``max_model_len`` request can never fit;
* CUDA-graph coverage per draft length, the first uncovered shape and the setting that
  covers it (:mod:`vllm_kvguard.fixes.cudagraph.coverage`, sized as on a CUDA GPU by
  :func:`vllm_kvguard.tools.plan.cudagraph.plan_config`);
* warmup feasibility: the V2 warmup shapes the pool would leave unwarmed
  (:mod:`vllm_kvguard.tools.plan.warmup_check`);
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


def _where(exc: BaseException) -> str:
    """An error with no message (a bare ``assert`` in vLLM): where it was raised."""
    import traceback

    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return ""
    last = frames[-1]
    path = last.filename.split("site-packages/")[-1]
    return f"raised at {path}:{last.lineno} in {last.name} ({(last.line or '').strip()})"


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


# --------------------------------------------------------------------------- KV cache
def kv_cache_config(vllm_config, specs: dict, *, num_gpu_blocks: int | None,
                    kv_bytes: int | None):
    """The ``KVCacheConfig`` EngineCore would build over the runner's ``specs``: the same
    calls in the same order, through the names ``vllm.v1.engine.core`` binds on each pin
    (vLLM 0.29+ resolves a KV cache layout first; 0.33 moved ``get_kv_cache_configs`` to
    ``kv_cache_planning`` and groups the layers before it)."""
    from vllm.v1.engine import core

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
         attention_backend: str | None = None, kv_cache_dtype: str | None = None,
         keep: dict | None = None) -> dict:
    """The plan as a JSON-able dict. ``keep``, if given, receives the objects it was
    computed from: ``vllm_config``, ``specs`` (the runner's), ``kv_cache_config``."""
    from vllm_kvguard.fixes.estimation import capacity
    from vllm_kvguard.tools.plan import layer_specs
    from vllm_kvguard.tools.plan.cudagraph import engine_args, finish_config

    kv_bytes = None
    if num_gpu_blocks is None:
        if gpu_memory_gib is None:
            raise PlanError("give --num-gpu-blocks N, or --gpu-memory-gib GiB (with "
                            "--gpu-memory-utilization, --weights-gib)")
        kv_bytes = int((gpu_memory_gib * gpu_memory_utilization - weights_gib) * 2**30)
        if kv_bytes <= 0:
            raise PlanError("--gpu-memory-gib x --gpu-memory-utilization - --weights-gib "
                            "leaves no KV cache memory")
    if kv_cache_dtype is not None:
        from typing import get_args

        from vllm.config.cache import CacheDType

        if kv_cache_dtype not in get_args(CacheDType):
            raise PlanError(f"--kv-cache-dtype {kv_cache_dtype}: expected one of "
                            f"{', '.join(get_args(CacheDType))}")
    kw: dict = dict(max_num_seqs=max_num_seqs)
    if not max_num_batched_tokens and device == "cuda":
        max_num_batched_tokens = cuda_token_budget(usage, gpu_memory_gib, max_num_seqs,
                                                   max_model_len)
    for name, value in (("max_model_len", max_model_len), ("block_size", block_size),
                        ("max_num_batched_tokens", max_num_batched_tokens),
                        ("enable_prefix_caching", enable_prefix_caching),
                        ("attention_backend", attention_backend),
                        ("kv_cache_dtype", kv_cache_dtype)):
        if value is not None:
            kw[name] = value
    if speculative_config:
        kw["speculative_config"] = dict(speculative_config)
    chosen: dict = {}

    def configure(vc):                  # on the platform, before the model is built
        chosen["runner"] = runner or layer_specs.default_runner(vc)
        finish_config(vc, cudagraph_mode=cudagraph_mode, runner=chosen["runner"],
                      user_cc=dict(compilation_config or {}))

    def within(vc, specs):
        return kv_cache_config(vc, specs, num_gpu_blocks=num_gpu_blocks, kv_bytes=kv_bytes)

    try:
        built = layer_specs.build(engine_args(model, **kw), device=device,
                                  gpu_memory_gib=gpu_memory_gib, configure=configure,
                                  within=within)
    except PlanError:
        raise
    except Exception as exc:
        text = str(exc).strip()
        raise PlanError(f"vLLM rejected these settings: {type(exc).__name__}: "
                        f"{text.splitlines()[0] if text else _where(exc)}") from None
    vc, kvc, runner = built.vllm_config, built.result, chosen["runner"]
    if keep is not None:
        keep.update(vllm_config=vc, specs=built.specs, kv_cache_config=kvc)
    cap, cert, why = capacity_of(vc, kvc)
    problems = [w.rstrip(".") for w in cap.warnings]
    if cap.vllm_concurrency is not None and not capacity.overstated(cap):
        problems = [p for p in problems if "concurrency" not in p]   # the same figure
    limits = None
    try:
        limits = cert.limits() if cert is not None else None
    except Exception as exc:    # vLLM's scheduler would not answer for these configs here
        why = f"{type(exc).__name__}: {str(exc)[:120]}"
    if limits is None:
        limits = dict(prompt_limit=None, total_limit=None, start_limit=None, prompt_group="",
                      total_group="", start_group="",
                      statement=f"admission limits: not computed here (vLLM's scheduler: "
                                f"{why})")
    mml = int(vc.model_config.max_model_len)
    if limits["total_limit"] is not None and limits["total_limit"] < mml:
        problems.append(f"a max_model_len request can never complete: prompt + max_tokens "
                        f"<= {limits['total_limit']} tokens can ({limits['total_group']}). "
                        f"Lower --max-model-len to {limits['total_limit']} or give the KV "
                        f"cache more memory")
    if limits["start_limit"] is not None and limits["start_limit"] < limits["prompt_limit"]:
        problems.append(f"prompts over {limits['start_limit']} tokens are preempted as they "
                        f"start decoding ({limits['start_group']}) and complete only with "
                        f"prompt + max_tokens <= {limits['prompt_limit'] + 1}; the door "
                        f"refuses longer ones. Give the KV cache more memory, lower "
                        f"--max-num-batched-tokens, or turn prefix caching on")
    if limits["prompt_limit"] is not None and limits["prompt_limit"] < mml - 1:
        problems.append(f"prompts over {limits['prompt_limit']} tokens can never be admitted "
                        f"({limits['prompt_group']}); the door refuses them. Lower "
                        f"--max-model-len to {limits['prompt_limit'] + 1} or give the KV "
                        f"cache more memory")
    out = _graphs_and_warmup(vc, kvc, cap, runner, problems)
    tokens, vllm_conc = _vllm_capacity(vc, kvc)
    return {
        "model": model, "architecture": list(vc.model_config.architectures),
        "device": device, "usage": usage, "runner": runner,
        "max_num_batched_tokens": int(vc.scheduler_config.max_num_batched_tokens),
        "max_in_flight_tokens": capacity.in_flight_tokens(vc),
        "max_num_seqs": cap.max_num_seqs, "max_model_len": cap.max_model_len,
        "num_speculative_tokens": cap.num_spec_tokens, "lookahead": cap.lookahead,
        "layers": [dict(kind=k, count=n) for k, n in built.kinds()],
        "notes": built.notes + ([
            f"KV memory = --gpu-memory-gib x --gpu-memory-utilization - --weights-gib "
            f"({kv_bytes / 2**30:.2f} GiB): vLLM also subtracts the activation peak and "
            f"CUDA graph memory it profiles at startup (unknown without weights), so blocks "
            f"and concurrency are upper bounds unless --weights-gib includes them"]
            if kv_bytes is not None else []),
        "num_blocks": cap.num_blocks, "usable_blocks": cap.usable,
        "kv_cache_tokens": tokens,
        "groups": [dict(index=g.index, kind=g.kind, block_size=g.block_size,
                        layers=len(kvc.kv_cache_groups[g.index].layer_names),
                        blocks_per_request_plain=g.plain, blocks_per_request_spec=g.spec,
                        decode_blocks=g.decode, held_decoding=g.hold) for g in cap.groups],
        "blocks_per_request_spec": cap.per_request_spec,
        "blocks_to_admit": cap.admit_blocks, "admission_basis": cap.basis,
        "blocks_held_decoding": cap.hold_blocks,
        "true_concurrency": cap.true_concurrency,
        "vllm_concurrency": vllm_conc,
        "decodes_that_fit": cap.decodes_that_fit if cap.has_mamba else None,
        "admission": {k: limits[k] for k in ("prompt_limit", "total_limit", "start_limit",
                                              "prompt_group", "total_group", "start_group")},
        "capacity_lines": capacity.format_report(cap) + ["  " + limits["statement"]],
        **out, "problems": problems, "verdict": "OK" if not problems else "ACTION NEEDED",
    }


def capacity_of(vc, kvc):
    """(capacity, certificate or None, why not): the capacity report with admission counted
    by vLLM's own gate on its scheduler, built from ``vc``/``kvc`` as EngineCore builds it;
    where that scheduler does not build here, the reserved-block model's count."""
    from vllm_kvguard.fixes.estimation import capacity, certificate

    try:
        cert, why = certificate.from_configs(vc, kvc), ""
    except Exception as exc:        # noqa: BLE001 - stated in the limits line
        cert, why = None, f"{type(exc).__name__}: {str(exc)[:120]}"
    return capacity.compute(vc, kvc, cert), cert, why


def _vllm_capacity(vllm_config, kv_cache_config) -> tuple[int | None, float | None]:
    """The tokens and concurrency vLLM itself logs for this KV cache (its own function)."""
    try:
        from vllm.v1.core.kv_cache_utils import get_kv_cache_capacity

        tokens, conc = get_kv_cache_capacity(vllm_config, kv_cache_config)
        return int(tokens), float(conc)
    except ImportError:                          # a vLLM without it: its concurrency alone
        from vllm.v1.core.kv_cache_utils import get_max_concurrency_for_kv_cache_config

        conc = float(get_max_concurrency_for_kv_cache_config(vllm_config, kv_cache_config))
        return int(conc * vllm_config.model_config.max_model_len), conc


def _graphs_and_warmup(vc, kvc, cap, runner: str, problems: list[str]) -> dict:
    """CUDA-graph coverage per draft length and V2 warmup feasibility; their problems are
    appended to ``problems``."""
    from vllm_kvguard.fixes.cudagraph.coverage import format_table
    from vllm_kvguard.fixes.cudagraph.planner import audit
    from vllm_kvguard.tools.plan import warmup_check
    from vllm_kvguard.tools.plan.cudagraph import plan_owner

    cov = audit(plan_owner(vc, runner), cap.decodes_that_fit if cap.has_mamba else None)
    for r in cov.rows:
        if r.first_gap is not None and not r.family.no_draft:
            problems.append(f"CUDA graphs: {r.family.q - 1} drafts, {r.first_gap} requests "
                            f"run {r.gap_mode}; fix: {r.fix}")
    try:
        warmup = warmup_check.feasibility(vc, kvc, runner)
        problems += [p for p in [warmup_check.problem(warmup)] if p]
        warmup_lines = warmup_check.format_lines(warmup)
    except Exception as exc:        # this vLLM's warmup is not modelled: say so, go on
        warmup = None
        warmup_lines = [f"warmup feasibility: not checked on this vLLM "
                        f"({type(exc).__name__}: {exc})"]
    return {"coverage": [dict(drafts=r.family.q - 1, zero_draft=r.family.no_draft,
                              requests=[r.family.lo, r.family.hi], covered=r.covered,
                              first_uncovered=r.first_gap, mode_there=r.gap_mode or None,
                              fix=r.fix or None, fix_setting=r.fix_setting or None)
                         for r in cov.rows],
            "coverage_table": format_table(cov), "warmup": warmup,
            "warmup_lines": warmup_lines}


def format_plan(result: dict) -> str:
    layers = ", ".join(f"{x['count']} x {x['kind']}" for x in result["layers"])
    out = [f"planned for: --device {result['device']} ({USAGE_TEXT[result['usage']]}), "
           f"model runner {result['runner']}, max_num_seqs={result['max_num_seqs']}, "
           f"max_num_batched_tokens={result['max_num_batched_tokens']} (in flight: "
           f"{result['max_in_flight_tokens']})",
           f"layers (vLLM's own KV specs): {layers}"]
    out += [f"  note: {n}" for n in result["notes"]]
    if result["vllm_concurrency"] is not None:
        out.append(f"vLLM would log: KV cache size: {result['kv_cache_tokens']:,} tokens, "
                   f"Maximum concurrency for {result['max_model_len']:,} tokens per request: "
                   f"{result['vllm_concurrency']:.2f}x ({result['num_blocks']:,} blocks)")
    out += [*result["capacity_lines"], "", result["coverage_table"], "",
            *result["warmup_lines"], ""]
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
                   help="model runner (default: the one vLLM picks on CUDA: V2 from 0.32 "
                        "unless a feature needs V1; only V2 from 0.34)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="size as vLLM would on this device (default cuda: vLLM's CUDA "
                        "platform, an sm_90 GPU; cpu: vLLM-CPU's)")
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
                   help="as vLLM's flag (default: vLLM's choice on --device)")
    p.add_argument("--kv-cache-dtype", default=None, metavar="DTYPE",
                   help="as vLLM's flag, e.g. fp8 (default: auto, the model's dtype)")
    p.add_argument("--json", metavar="PATH", default=None, help="write JSON here (- = stdout)")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    a = parser.parse_args(argv)
    stdout = sys.stdout
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # vLLM's lines: stderr
    os.environ.setdefault("HF_HUB_OFFLINE", "1")         # a local config.json: no hub
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
                          attention_backend=a.attention_backend,
                          kv_cache_dtype=a.kv_cache_dtype)
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
