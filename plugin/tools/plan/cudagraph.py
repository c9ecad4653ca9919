"""The offline CUDA-graph coverage planner: the table a GPU engine would log, on any machine.

    python -m vllm_kvguard.tools.plan.cudagraph --max-num-seqs 256 --num-speculative-tokens 3

:func:`plan_config` builds a real ``VllmConfig`` sized as vLLM sizes it on a (non-Blackwell)
CUDA GPU; :func:`plan_owner` builds the runner's graph owner for it (keys, no capture) and
:func:`plan_v1_runner` a V1 runner that runs vLLM's own per-step dispatch. The tests and the
dispatch benchmark use the same stand-ins. Where vLLM detects no platform, the config is
built with vLLM's CPU platform, swapped in through the cudagraph patch's declared changes.
"""
from __future__ import annotations

import inspect
import sys

from vllm_kvguard.fixes.cudagraph.coverage import format_table
from vllm_kvguard.fixes.estimation.estimate import num_spec
from vllm_kvguard.fixes.cudagraph.graph_owners import GraphOwner, modes, v1_probe, v2_probe
from vllm_kvguard.fixes.cudagraph.planner import audit, complete, short

_TINY: dict[str, str] = {}        # one tiny model config per process


def plan_config(model: str | None = None, *, cudagraph_mode: str = "FULL_DECODE_ONLY",
                runner: str | None = None, min_cg_support: str = "ALWAYS", **engine_kwargs):
    """A real ``VllmConfig`` sized as vLLM sizes it on a (non-Blackwell) CUDA GPU, built on
    any machine: ``EngineArgs(...).create_engine_config()``, then the CUDA-graph sizing the
    CPU platform skips (:func:`finish_config`). ``engine_kwargs`` are ``EngineArgs`` fields
    (``max_num_seqs``, ``speculative_config``, ``compilation_config`` with capture sizes...)."""
    runner = runner or default_runner()
    user_cc = dict(engine_kwargs.get("compilation_config") or {})
    args = engine_args(model, **engine_kwargs)
    with _some_platform():
        vc = args.create_engine_config()
    finish_config(vc, cudagraph_mode=cudagraph_mode, runner=runner, user_cc=user_cc,
                  min_cg_support=min_cg_support)
    return vc


def engine_args(model: str | None = None, **engine_kwargs):
    """``EngineArgs`` for a planned config: dummy weights, no tokenizer, bf16 unless given;
    ``model`` None: the tiny Llama (a short context is enough)."""
    from vllm.engine.arg_utils import EngineArgs

    from vllm_kvguard.tools.tiny_models import write_model

    engine_kwargs.pop("compilation_config", None)
    kw = dict(load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16")
    if model is None:
        model = _TINY.get("llama") or _TINY.setdefault("llama", write_model("llama"))
        kw["max_model_len"] = 2048
    kw.update(engine_kwargs, model=model)
    return EngineArgs(**kw)


def finish_config(vc, *, cudagraph_mode: str, runner: str, user_cc: dict | None = None,
                  min_cg_support: str = "ALWAYS") -> None:
    """The CUDA-graph sizing of a GPU engine on a created config: the mode, the user's own
    capture sizes, vLLM's own ``_set_cudagraph_sizes`` and, as the runner does,
    ``resolve_cudagraph_mode_and_sizes``."""
    from vllm.config import CompilationMode

    if runner == "v1" and not has_v1_runner():
        raise ValueError("model runner V1 is gone from this vLLM (removed in 0.34.0); "
                         "plan for --runner v2")
    user_cc = user_cc or {}
    cc = vc.compilation_config
    mode = getattr(modes(), cudagraph_mode)
    cc.cudagraph_mode = mode
    for name in SIZE_FIELDS:             # the user's own, as before vLLM resolved them
        if hasattr(cc, name):
            setattr(cc, name, user_cc.get(name))
    if "cudagraph_specialize_lora" in user_cc:
        cc.cudagraph_specialize_lora = user_cc["cudagraph_specialize_lora"]
    if mode.requires_piecewise_compilation():
        cc.mode = CompilationMode.VLLM_COMPILE
        cc.splitting_ops = list(type(cc)._attention_ops)
        cc.use_inductor_graph_partition = False
    object.__setattr__(vc.model_config, "enforce_eager", False)
    type(vc)._set_cudagraph_sizes(vc)
    from vllm.v1.attention.backend import AttentionCGSupport

    resolve = cc.resolve_cudagraph_mode_and_sizes
    extra = {}
    if "use_v2_model_runner" in inspect.signature(resolve).parameters:   # up to 0.33
        extra["use_v2_model_runner"] = runner == "v2"
    resolve(getattr(AttentionCGSupport, min_cg_support), "FLASH_ATTN", 1 + num_spec(vc),
            **extra)


#: ``CompilationConfig`` capture-size fields a user may set (the split ones from 0.34).
SIZE_FIELDS = ("cudagraph_capture_sizes", "max_cudagraph_capture_size",
               "prefill_cudagraph_capture_token_sizes", "max_prefill_cudagraph_capture_tokens",
               "decode_cudagraph_capture_request_sizes",
               "max_decode_cudagraph_capture_requests", "max_decode_cudagraph_capture_tokens")


def has_v1_runner() -> bool:
    """Whether the installed vLLM still has model runner V1 (removed in 0.34.0)."""
    import importlib.util

    return importlib.util.find_spec("vllm.v1.worker.gpu_model_runner") is not None


def default_runner() -> str:
    """``v1`` where vLLM still has it (the planner's historical default), else ``v2``."""
    return "v1" if has_v1_runner() else "v2"


class _some_platform:
    """Build configs with vLLM's CPU platform class where vLLM detects no platform (a CUDA
    wheel on a machine without a GPU): only the config's device fields depend on it; the
    CUDA-graph sizing is applied afterwards as on a GPU. vLLM modules import
    ``current_platform`` by name, so each declared binding is swapped too, and restored."""

    def __enter__(self):
        import vllm.platforms as platforms

        from vllm_kvguard.patches.cudagraph import (CONFIG_PLATFORM, PLATFORM,
                                                    PLATFORM_BINDINGS)

        self.swapped = []
        if getattr(platforms.current_platform, "device_type", "cpu"):
            return self
        from vllm.platforms.cpu import CpuPlatform

        old, stand_in = platforms.current_platform, CpuPlatform()
        config_mod = sys.modules.get(CONFIG_PLATFORM.module)
        if getattr(config_mod, CONFIG_PLATFORM.attr, None) is old and CONFIG_PLATFORM.replace(
                type("PlanConfigPlatform", (type(old),),
                     {"support_hybrid_kv_cache": classmethod(lambda cls: True)})()):
            self.swapped.append(CONFIG_PLATFORM)
        for decl in PLATFORM_BINDINGS:      # before _current_platform: reads go through it
            mod = sys.modules.get(decl.module)
            if mod is not None and getattr(mod, decl.attr, None) is old and \
                    decl.replace(stand_in):
                self.swapped.append(decl)
        if PLATFORM.replace(stand_in):
            self.swapped.append(PLATFORM)
        return self

    def __exit__(self, *exc):
        while self.swapped:
            self.swapped.pop().restore()
        return False


def plan_owner(vllm_config, runner: str | None = None) -> GraphOwner:
    """The runner's graph owner for a :func:`plan_config` config (keys built, no capture);
    ``runner`` None: :func:`default_runner`."""
    runner = runner or default_runner()
    mode = vllm_config.compilation_config.cudagraph_mode
    q = 1 + num_spec(vllm_config)
    if runner == "v2":
        return v2_probe(vllm_config, mode, q)
    return v1_probe(vllm_config, mode, q)


def plan_v1_runner(vllm_config, dp_size: int = 1):
    """A V1 ``GPUModelRunner`` built without ``__init__`` (which needs a GPU), carrying what
    ``_determine_batch_execution_and_padding`` reads and a dispatcher with keys for
    ``vllm_config``: lets tests and the dispatch benchmark run vLLM's own per-step dispatch.
    Its attributes are the cudagraph patch's declared ``PLAN_RUNNER`` changes."""
    from types import SimpleNamespace

    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vllm_kvguard.patches.cudagraph import PLAN_RUNNER

    runner = GPUModelRunner.__new__(GPUModelRunner)
    parallel = SimpleNamespace(data_parallel_size=dp_size, data_parallel_rank=0,
                               tensor_parallel_size=1)
    values = dict(
        vllm_config=SimpleNamespace(parallel_config=parallel,
                                    observability_config=vllm_config.observability_config,
                                    compilation_config=vllm_config.compilation_config,
                                    scheduler_config=vllm_config.scheduler_config),
        parallel_config=parallel, compilation_config=vllm_config.compilation_config,
        model_config=vllm_config.model_config,
        uniform_decode_query_len=1 + num_spec(vllm_config),
        input_batch=SimpleNamespace(lora_id_to_lora_request={}, num_reqs=0),
        cudagraph_dispatcher=plan_owner(vllm_config).obj)
    for decl in PLAN_RUNNER:
        decl.set(runner, values[decl.attr])
    return runner


class PlanRunner:
    """Just enough of a model runner for :func:`~vllm_kvguard.fixes.cudagraph.planner.complete`."""

    def __init__(self, vllm_config, runner: str | None = None):
        runner = runner or default_runner()
        self.vllm_config = vllm_config
        self.decode_query_len = 1 + num_spec(vllm_config)
        self.lora_capture_cases = None
        self.kvguard_runner_v2 = runner == "v2"


def main(argv: list[str] | None = None) -> int:
    """Offline planner: print the coverage table a GPU engine with these settings would log.

    python -m vllm_kvguard.tools.plan.cudagraph --max-num-seqs 256 --num-speculative-tokens 3
    """
    import argparse
    import json

    p = argparse.ArgumentParser(prog="python -m vllm_kvguard.tools.plan.cudagraph",
                                description=main.__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model dir (default: a tiny Llama config)")
    p.add_argument("--runner", choices=("v1", "v2"), default=None,
                   help="model runner (default: v1 where vLLM has it, v2 from 0.34)")
    p.add_argument("--cudagraph-mode", default="FULL_AND_PIECEWISE",
                   choices=("FULL_DECODE_ONLY", "FULL_AND_PIECEWISE", "PIECEWISE", "FULL"))
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--num-speculative-tokens", type=int, default=0)
    p.add_argument("--spec-method", default="ngram")
    p.add_argument("--compilation-config", default="{}", help="JSON, as vLLM's flag")
    p.add_argument("--complete", action="store_true", help="show KVGUARD_CUDAGRAPH_COMPLETE")
    a = p.parse_args(argv)
    kw = dict(max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens,
              compilation_config=json.loads(a.compilation_config))
    if a.num_speculative_tokens:
        spec = {"method": a.spec_method, "num_speculative_tokens": a.num_speculative_tokens}
        if a.spec_method == "ngram":
            spec["prompt_lookup_max"] = 3
        kw["speculative_config"] = spec
    a.runner = a.runner or default_runner()
    vc = plan_config(a.model, cudagraph_mode=a.cudagraph_mode, runner=a.runner, **kw)
    owner = plan_owner(vc, a.runner)
    print(format_table(audit(owner)))
    if a.complete:
        runner = PlanRunner(vc, a.runner)
        result = complete(runner, None, force=True)
        if result is not None and not result.skipped:
            print(f"KVGUARD_CUDAGRAPH_COMPLETE=1: +{result.extra_graphs} graphs "
                  f"({short(result.added)})")
        print(format_table(audit(plan_owner(vc, a.runner)), "after capture completion"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
