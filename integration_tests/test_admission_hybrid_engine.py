"""The admission certificate against a real vLLM engine on hybrid and sliding-window tiny
models (issue 42, Deliver 6): what the door allows must be what vLLM's own scheduler runs.

Each case builds the engine on a pool at (or near) the smallest one vLLM's startup check
accepts, in a fresh child (in-process engine, hard timeout), once with the plugin off
(vLLM alone) and once with ``KVGUARD=1``. The child reads the prompt limit ``P`` and the
old decode model's limit (``Certificate.decode_limit``) from the engine's real
``Scheduler``, then sends prompts through ``LLM.generate`` one at a time, each in a
thread joined against a deadline (a request still running then is recorded ``pending``:
it never ran to completion; no sleeps).

What vLLM 0.32 does on these engines (measured, and asserted below):

* vLLM >= 0.29 sizes its startup check with the very numbers its admission gate counts
  (``max_memory_usage_bytes`` per group: full attention ``cdiv(max_model_len, block)``,
  sliding window ``max_admission_blocks_per_request``, Mamba ``none`` one page: its block
  is ``max_model_len`` without prefix caching; null block reserved), and
  ``allocate_slots(full_sequence_must_fit=True)`` counts ``min(num_tokens,
  max_model_len)`` with those caps. So on any pool the engine starts with, a lone prompt
  up to ``max_model_len`` passes the gate: ``P + 1 == decode_limit == max_model_len`` and
  there is no prompt between the old limit and the true one to hang. The gap of issue 42
  (Mamba ``none`` with blocks smaller than ``max_model_len``) needs
  ``--mamba-block-size`` without prefix caching, which vLLM 0.32 refuses
  (``validate_mamba_block_size``), and the pools of the unit layouts, which its startup
  check refuses. The first two cases pin that down: one block less and vLLM refuses to
  start; at the smallest pool, a prompt of ``max_model_len - 4`` (+ 4 tokens) completes
  with and without the plugin, and the door's startup line says ``prompt <= 1023``.
* Mamba ``align`` (prefix caching on) with ``max_num_batched_tokens`` below the block
  size (on CPU vLLM raises the hybrid block size to 256 tokens): vLLM keeps the Mamba
  state private across chunks shorter than a block (``Scheduler._mamba_block_aligned_split``)
  and completes every prompt up to ``max_model_len - 1``. This case found a false
  refusal in an earlier certificate, which rounded each chunk down to a block (0 tokens);
  the certificate now asks vLLM's own split for each chunk. The third case asserts no
  false refusal through ``LLM.generate`` and through ``vllm serve`` (no HTTP 400).

Runtime on 2 shared CPU cores, vLLM 0.32.0: about 5 min for the file (the serve test,
marked ``slow``, about 2.5 min); not in the smoke suite.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest

RESULT_TAG = "KVGUARD_WORKLOAD_RESULT "      # the harness's result line (workload.py)
CHILD_TIMEOUT_S = 300                        # one child: import, engines, prompts
WAIT_S = 60                                  # one prompt (a tiny model takes < 2 s)
STARTUP_REFUSED = "To serve at least one request"

CASES = {
    # Full attention + 2 Mamba2 layers, prefix caching off: mamba_cache_mode 'none' (how
    # most people run Nemotron-H / Qwen3-Next). Attention blocks of 256 on CPU; the
    # smallest pool vLLM starts with: 1024/256 + 1 + 1 usable blocks + the null block.
    "nemotron_h-none": {
        "model": "nemotron_h", "mode": "none", "too_small": 6, "prompts": [[1020, 4]],
        "engine": {"enable_prefix_caching": False, "max_model_len": 1024,
                   "num_gpu_blocks_override": 7}},
    # Gemma-3 style: sliding window 32 + full attention, blocks of 32 (CPU), budget 64:
    # 512/32 full + 4 window blocks (window - 1 + 64 in flight) usable + the null block.
    "gemma3_sw": {
        "model": "gemma3_sw", "mode": None, "too_small": 20, "prompts": [[508, 4]],
        "engine": {"max_model_len": 512, "block_size": 16, "num_gpu_blocks_override": 21,
                   "max_num_batched_tokens": 64}},
    # Mamba 'align' (prefix caching on), token budget 128 below the 256-token block.
    "nemotron_h-align-budget": {
        "model": "nemotron_h", "mode": "align", "too_small": None,
        "prompts": [[128, 4], [200, 4], [1020, 4]],
        "engine": {"enable_prefix_caching": True, "max_model_len": 1024,
                   "num_gpu_blocks_override": 11, "max_num_batched_tokens": 128}},
}


# ----------------------------------------------------------------------------- the child
def _generate(llm, n: int, max_tokens: int, wait_s: float) -> dict:
    """One prompt of ``n`` tokens through ``LLM.generate`` in a thread, joined against a
    deadline: finished (its finish reason), refused (the exception), or pending."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                            detokenize=False)
    box: dict = {}

    def run():
        try:
            out = llm.generate([{"prompt_token_ids": [3 + i % 997 for i in range(n)]}],
                               params, use_tqdm=False)[0].outputs[0]
            box.update(outcome="finished", finish_reason=out.finish_reason,
                       tokens=len(out.token_ids))
        except Exception as exc:            # the door's refusal, or vLLM's own validation
            box.update(outcome="refused", error=f"{type(exc).__name__}: {exc}"[:1500])

    t0 = time.monotonic()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(wait_s)
    return {"len": n, "max_tokens": max_tokens, "seconds": round(time.monotonic() - t0, 3),
            **(box or {"outcome": "pending"})}


def child(spec: dict) -> dict:
    from vllm import LLM

    from vllm_kvguard.fixes.estimation import certificate
    from vllm_kvguard.tools.tiny_models import engine_kwargs, write_model
    from vllm_kvguard.tools.ab.workload import _scheduler

    out: dict = {"spec": spec, "ok": False}
    model_dir = write_model(spec["model"])
    engine = dict(spec["engine"])
    if spec.get("too_small"):               # one block less: vLLM's startup check refuses
        try:
            LLM(**engine_kwargs(model_dir, **{**engine,
                                              "num_gpu_blocks_override": spec["too_small"]}))
            out["too_small"] = {"started": True}
        except Exception as exc:
            out["too_small"] = {"started": False, "error": f"{type(exc).__name__}: {exc}"[:600]}
    t0 = time.monotonic()
    llm = LLM(**engine_kwargs(model_dir, **engine))
    out["engine_s"] = round(time.monotonic() - t0, 1)
    sched = _scheduler(llm)
    cert = certificate.from_scheduler(sched)
    out.update(
        mamba_cache_mode=getattr(sched.cache_config, "mamba_cache_mode", None),
        prefix_caching=bool(sched.cache_config.enable_prefix_caching),
        block_size=sched.cache_config.block_size, num_blocks=sched.kv_cache_config.num_blocks,
        budget=sched.scheduler_config.max_num_batched_tokens,
        groups=[certificate.describe(g.kv_cache_spec)
                for g in sched.kv_cache_config.kv_cache_groups],
        max_model_len=cert.max_model_len, prompt_limit=cert.prompt_limit,
        decode_limit=cert.decode_limit, total_limit=cert.total_limit,
        binding=list(cert.binding()))
    out["prompts"] = []
    for n, max_tokens in spec["prompts"]:
        got = _generate(llm, n, max_tokens, spec.get("wait_s", WAIT_S))
        out["prompts"].append(got)
        if got["outcome"] == "pending":     # the engine is busy with it: nothing after runs
            break
    out["ok"] = True
    return out


def _child_main(argv: list[str]) -> None:
    spec = json.loads(argv[0])
    try:
        result = child(spec)
    except Exception as exc:
        import traceback

        result = {"spec": spec, "ok": False, "error": f"{type(exc).__name__}: {exc}",
                  "traceback": traceback.format_exc()[-4000:]}
    sys.stdout.flush()
    sys.stdout.write(RESULT_TAG + json.dumps(result) + "\n")
    sys.stdout.flush()
    os._exit(0)                             # skip vLLM's slow interpreter shutdown


# ---------------------------------------------------------------------------- the parent
def run_child(spec: dict, env: dict[str, str]) -> dict:
    """This file as a child (a fresh interpreter, in-process engine, its own process
    group), killed with its group after :data:`CHILD_TIMEOUT_S` (then ``hung``). The
    result line, plus the plugin's startup limits line(s) from its log."""
    from vllm_kvguard.tools.ab.harness import child_env, kill_group

    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), json.dumps(spec)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=child_env(spec, env), start_new_session=True)
    t0 = time.monotonic()
    try:
        stdout, stderr = proc.communicate(timeout=CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        stdout, stderr = proc.communicate()
        return {"spec": spec, "ok": False, "hung": True, "stderr": stderr[-4000:],
                "error": f"no result within {CHILD_TIMEOUT_S} s"}
    finally:
        kill_group(proc)
    result = {"spec": spec, "ok": False, "error": f"exited {proc.returncode}, no result"}
    for line in reversed(stdout.splitlines()):
        if line.startswith(RESULT_TAG):
            result = json.loads(line[len(RESULT_TAG):])
            break
    result["child_s"] = round(time.monotonic() - t0, 1)
    result["limits_log"] = [ln.strip() for ln in (stdout + "\n" + stderr).splitlines()
                            if "admission limits:" in ln]
    result["stderr"] = stderr[-4000:]
    return result


def _show(label: str, r: dict) -> str:
    keys = ("mamba_cache_mode", "prefix_caching", "block_size", "num_blocks", "budget",
            "groups", "max_model_len", "prompt_limit", "decode_limit", "total_limit",
            "binding", "too_small", "engine_s", "child_s")
    head = {k: r.get(k) for k in keys if k in r}
    lines = [f"[hybrid admission] {label}: {json.dumps(head)}"]
    lines += [f"    prompt {p['len']} + {p['max_tokens']}: {p['outcome']} in {p['seconds']} s "
              f"{p.get('finish_reason') or (p.get('error') or '')[:300]}"
              for p in r.get("prompts", [])]
    return "\n".join(lines)


def _runs(case: str) -> tuple[dict, dict]:
    c = CASES[case]
    base = {"model": c["model"], "engine": c["engine"], "prompts": c["prompts"]}
    off = run_child({**base, "too_small": c["too_small"]}, {})   # vLLM alone
    print("\n" + _show(f"{case}, vLLM alone", off))
    on = run_child(base, {"KVGUARD": "1"})
    print(_show(f"{case}, KVGUARD=1", on))
    for label, r in (("vLLM alone", off), ("KVGUARD=1", on)):
        assert r.get("ok"), (label, r.get("error"), r.get("traceback"), r.get("stderr"))
    return off, on


def _completed(r: dict) -> list[int]:
    return [p["len"] for p in r["prompts"]
            if p["outcome"] == "finished" and p["finish_reason"] == "length"]


@pytest.mark.engine
@pytest.mark.timeout(900)
@pytest.mark.parametrize("case", ["nemotron_h-none", "gemma3_sw"])
def test_on_the_smallest_pool_vllm_starts_with_every_prompt_up_to_max_model_len_runs(case):
    c = CASES[case]
    off, on = _runs(case)
    mml = c["engine"]["max_model_len"]
    assert off["too_small"]["started"] is False, off["too_small"]
    assert STARTUP_REFUSED in off["too_small"]["error"], off["too_small"]
    for r in (off, on):
        assert r["mamba_cache_mode"] == c["mode"] or c["mode"] is None, r
        # The gate admits what the startup check sized for: no prompt between the old
        # decode model's limit and the true one.
        assert r["prompt_limit"] + 1 == r["decode_limit"] == r["total_limit"] == mml, r
        assert _completed(r) == [n for n, _ in c["prompts"]], r["prompts"]
    statement = f"admission limits: prompt <= {mml - 1} tokens, prompt + max_tokens <= {mml}"
    assert any(statement in line for line in on["limits_log"]), on["limits_log"]
    assert not off["limits_log"], off["limits_log"]            # the plugin was off there


@pytest.mark.engine
@pytest.mark.timeout(900)
def test_mamba_align_with_a_budget_below_the_block_admits_what_vllm_completes():
    c = CASES["nemotron_h-align-budget"]
    off, on = _runs("nemotron_h-align-budget")
    assert off["mamba_cache_mode"] == "align" and off["budget"] < off["block_size"], off
    # vLLM alone runs every prompt to completion, also those above the token budget.
    assert _completed(off) == [n for n, _ in c["prompts"]], off["prompts"]
    # With the plugin the door must not refuse them (no false refusals).
    refused = [p for p in on["prompts"] if p["outcome"] == "refused"]
    assert not refused, (f"the door refuses prompts vLLM completes: certificate prompt "
                         f"limit {on['prompt_limit']} ({on['binding'][0]}); "
                         f"{[(p['len'], p['error'][:200]) for p in refused]}")
    assert _completed(on) == [n for n, _ in c["prompts"]], on["prompts"]


SERVE_ARGS = ("--load-format", "dummy", "--skip-tokenizer-init", "--enforce-eager",
              "--dtype", "bfloat16", "--max-model-len", "1024", "--max-num-seqs", "4",
              "--seed", "0", "--enable-prefix-caching", "--max-num-batched-tokens", "128",
              "--num-gpu-blocks-override", "11")


def _complete(server, n: int, timeout: float):
    """One prompt of ``n`` tokens + 4 through ``/v1/completions``: (seen, text, seconds)."""
    from vllm_kvguard.testing.serve_fixtures import complete_once

    return complete_once(server, timeout, max_tokens=4, prompt=[3 + i % 997 for i in range(n)])


@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_vllm_serve_mamba_align_with_a_budget_below_the_block_serves_what_vllm_completes(
        tmp_path):
    """The align case above under ``vllm serve``: a 200-token prompt completes on vLLM
    alone; with ``KVGUARD=1`` the API server must not answer it with HTTP 400."""
    from vllm_kvguard.tools.serve import Server
    from vllm_kvguard.tools.tiny_models import write_model

    model = write_model("nemotron_h", tmp_path / "nemotron_h")
    seen = {}
    for label, env in (("vLLM alone", {}), ("KVGUARD=1", {"KVGUARD": "1"})):
        with Server(model, list(SERVE_ARGS), env, name=label.replace(" ", "-").lower(),
                    log_dir=str(tmp_path)) as server:
            server.wait_ready(600)
            seen[label] = [(n, *_complete(server, n, WAIT_S)) for n in (128, 200)]
            for n, what, text, secs in seen[label]:
                print(f"\n[hybrid admission] serve, {label}: prompt {n} + 4: {what} in "
                      f"{secs:.2f} s {text[:300]}")
            limits = [ln for ln in server.log().splitlines() if "admission limits:" in ln]
            print(f"[hybrid admission] serve, {label}: {limits[:1]}")
    assert [what for _, what, _, _ in seen["vLLM alone"]] == ["finish length"] * 2, seen
    assert [what for _, what, _, _ in seen["KVGUARD=1"]] == ["finish length"] * 2, seen


if __name__ == "__main__":
    _child_main(sys.argv[1:])
