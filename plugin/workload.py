"""Run one tiny, deterministic workload on a real vLLM engine and report what happened.

Used by the A/B tool and the integration tests, so both measure the same thing::

    python -m vllm_kvguard.workload '{"model": "llama", "num_requests": 8}'

prints one line ``KVGUARD_WORKLOAD_RESULT {json}``. :func:`run_in_subprocess` starts that
in a fresh interpreter (vLLM loads our entry point there, so the environment decides
whether the plugin is on) and returns the parsed result, or a ``hung`` result after its
timeout. The engine runs in-process inside that interpreter unless ``multiprocess`` is set.
"""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from typing import Any

RESULT_TAG = "KVGUARD_WORKLOAD_RESULT "

DEFAULTS: dict[str, Any] = {
    "model": "llama",          # "llama", "nemotron_h" (embedded) or a model directory
    "engine": {},              # extra LLM(...) keyword arguments
    "num_requests": 8,
    "prompt_len": 48,
    "max_tokens": 32,
    "seed": 0,
    "repetitive": True,        # prompts repeat a short pattern, so ngram drafting proposes
    "rounds": 1,               # generate() calls on the same engine (throughput samples)
    "multiprocess": False,
}


def make_prompts(spec: dict) -> list[list[int]]:
    rng = random.Random(spec["seed"])
    prompts = []
    for i in range(spec["num_requests"]):
        n = spec["prompt_len"] + (i % 4)
        if spec["repetitive"]:
            period = [rng.randrange(3, 1000) for _ in range(5)]
            ids = (period * (n // 5 + 1))[:n]
        else:
            ids = [rng.randrange(3, 1000) for _ in range(n)]
        prompts.append(ids)
    return prompts


def _scheduler(llm):
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    core = getattr(core, "engine_core", None)        # InprocClient -> EngineCore
    return getattr(core, "scheduler", None)


def _pool_state(llm) -> dict:
    sched = _scheduler(llm)
    if sched is None:
        return {}
    pool = sched.kv_cache_manager.block_pool
    state = {"pool_blocks": pool.num_gpu_blocks,
             "held_blocks": pool.num_gpu_blocks - 1 - pool.get_num_free_blocks()}
    try:
        from vllm_kvguard.fixes import audit

        violations = audit.audit_kv_cache_manager(sched.kv_cache_manager, sched)
        state["audit_violations"] = [str(v) for v in violations]
    except (ImportError, AttributeError):
        pass
    return state


def run(spec: dict) -> dict:
    """Build the engine, run the workload, return the result dict (never raises)."""
    spec = {**DEFAULTS, **spec}
    out: dict[str, Any] = {"spec": spec, "ok": False, "engine_died": False, "error": None}
    t0 = time.perf_counter()
    try:
        from vllm import LLM, SamplingParams

        from vllm_kvguard.tiny_models import MODELS, engine_kwargs, write_model

        model = spec["model"]
        model_dir = write_model(model) if model in MODELS else model
        llm = LLM(**engine_kwargs(model_dir, **spec["engine"]))
    except Exception as exc:
        out.update(error=f"startup failed: {type(exc).__name__}: {exc}", startup_failed=True)
        return _finish(out)
    out["startup_s"] = time.perf_counter() - t0

    params = SamplingParams(temperature=0, ignore_eos=True, detokenize=False,
                            max_tokens=spec["max_tokens"])
    prompts = [{"prompt_token_ids": p} for p in make_prompts(spec)]
    round_s: list[float] = []
    try:
        for _ in range(spec["rounds"]):
            t = time.perf_counter()
            results = llm.generate(prompts, params, use_tqdm=False)
            round_s.append(time.perf_counter() - t)
            if len(round_s) == 1:
                outputs = [list(r.outputs[0].token_ids) for r in results]
                reasons = [r.outputs[0].finish_reason for r in results]
    except Exception as exc:
        out.update(error=f"{type(exc).__name__}: {exc}", engine_died=True, round_s=round_s)
        return _finish(out)

    done = sum(1 for r in reasons if r in ("length", "stop"))
    out.update(
        ok=True, round_s=round_s, outputs=outputs, finish_reasons=reasons,
        completed=done, aborted=sum(1 for r in reasons if r == "abort"),
        failed=len(reasons) - done - sum(1 for r in reasons if r == "abort"),
        tokens_per_round=sum(len(o) for o in outputs),
    )
    out.update(_pool_state(llm))
    return _finish(out)


def _finish(out: dict) -> dict:
    try:
        from vllm_kvguard import activation, report

        out["kvguard"] = {"results": activation.results(), "counters": report.snapshot()}
    except Exception as exc:  # the workload result matters more than our own report
        out["kvguard"] = {"error": repr(exc)}
    return out


def run_in_subprocess(spec: dict, env: dict[str, str] | None = None,
                      timeout: float = 300.0) -> dict:
    """Run :func:`run` in a fresh interpreter with ``env`` added to this environment."""
    full_env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    for key in [k for k in full_env if k.startswith("KVGUARD")]:
        del full_env[key]                       # only the caller's env decides A vs B
    full_env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if spec.get("multiprocess") else "0"
    full_env.update(env or {})
    cmd = [sys.executable, "-m", "vllm_kvguard.workload", json.dumps(spec)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=full_env, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        return {"spec": spec, "ok": False, "hung": True, "engine_died": False,
                "error": f"no result within {timeout:.0f} s", "stderr": stderr[-4000:]}
    for line in reversed(stdout.splitlines()):
        if line.startswith(RESULT_TAG):
            result = json.loads(line[len(RESULT_TAG):])
            result["stderr"] = stderr[-4000:]
            return result
    return {"spec": spec, "ok": False, "engine_died": True, "returncode": proc.returncode,
            "error": f"process exited {proc.returncode} without a result",
            "stderr": stderr[-4000:]}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    spec = json.loads(argv[0]) if argv else {}
    result = run(spec)
    sys.stdout.flush()
    print(RESULT_TAG + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
