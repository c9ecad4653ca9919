"""``kvguard demo``: the two failures vllm-kvguard prevents, shown on this machine in minutes.

1. Allocator faults. The A/B tool's ``alloc-faults`` load (:mod:`ab.scenarios`: the embedded
   tiny Llama, dummy weights, eight greedy token-id requests, a 64-block pool) runs on three
   engines at once, each in its own process (:func:`ab.harness.run_together`): no fault and no
   plugin (the reference); an allocator fault on every 7th block allocation with vLLM alone
   (the injector is the plugin itself with its fixes off, ``KVGUARD=1 KVGUARD_PATCHES=none
   KVGUARD_FAULTS=every=7``), which must die; the same faults with the fixes on, which must
   complete every request token-identical to the reference and hold no block after.
2. A request that can never fit the KV cache, given to vLLM's own input processor over a
   real scheduler's pool (vLLM >= 0.29 does not start an engine whose pool is that small, so
   the pool is built directly): vLLM alone accepts it (it would wait forever), the plugin
   refuses it at once with its numbers.

Exit status 0 when both showed what they should, 1 otherwise, 2 on a bad argument.
"""
from __future__ import annotations

import argparse
import json
import sys
import textwrap
import time

from vllm_kvguard.tools.ab import stats as abstats
from vllm_kvguard.tools.ab.scenarios import SCENARIOS, scenario_envs, scenario_spec
from vllm_kvguard.tools.ab.harness import run_together
from vllm_kvguard.tools.ab.workload import DEFAULTS, RESULT_TAG

SCENARIO = SCENARIOS["alloc-faults"]
# The door's pool: 17 blocks of 16 tokens (16 usable: 256 tokens); 200 + 57 fits, 200 + 58
# can never fit (the last sampled token is never computed).
POOL_BLOCKS, BLOCK, PROMPT, FITS, OVER = 17, 16, 200, 57, 58


def _settings(faults: str, threads: dict) -> dict:
    """The A/B tool's settings for one run of its ``alloc-faults`` scenario."""
    return {"overrides": {}, "model": None, "workload": {}, "multiprocess": False,
            "cpus": None, "thread_env": threads, "faults": faults}


def jobs(faults: str, fixes_off: bool, threads: dict) -> list[tuple[dict, dict, str]]:
    """(spec, env, module) of the reference, vLLM alone, the fixes, and the door."""
    settings = _settings(faults, threads)
    spec = scenario_spec(SCENARIO, settings)
    env_alone, env_fixed, _, _ = scenario_envs(SCENARIO, settings)
    env_fixed = {**env_fixed, "KVGUARD_AUDIT": "1"}
    door = {"KVGUARD": "1"}
    if fixes_off:                          # the internal check that the demo can fail
        env_fixed["KVGUARD_PATCHES"] = door["KVGUARD_PATCHES"] = "none"
    return [(spec, dict(threads), "vllm_kvguard.tools.ab.workload"),
            (spec, env_alone, "vllm_kvguard.tools.ab.workload"),
            (spec, env_fixed, "vllm_kvguard.tools.ab.workload"),
            ({"with": door}, dict(threads), "vllm_kvguard.tools.demo --door-child")]


# ------------------------------------------------------------------------ the door child
def _door_child(spec: dict) -> dict:
    """In a child: the never-fitting request through vLLM's InputProcessor, with the
    admission patch left out (vLLM alone), then with ``spec["with"]``'s flags."""
    from vllm import SamplingParams
    from vllm.v1.engine.input_processor import InputProcessor

    from vllm_kvguard import activation
    from vllm_kvguard.fixes.estimation import admission
    from vllm_kvguard.tools.tiny_models import make_scheduler, make_vllm_config

    def submit(rid: str, max_tokens: int) -> str | None:
        proc = InputProcessor(make_vllm_config(num_gpu_blocks=POOL_BLOCKS, block_size=BLOCK))
        try:
            proc.process_inputs(rid, {"prompt_token_ids": list(range(3, 3 + PROMPT))},
                                SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                                supported_tasks=("generate",))
        except ValueError as exc:
            return str(exc)
        return None

    out = {}
    for side, flags in (("alone", {"KVGUARD": "1", "KVGUARD_ADMISSION": "off"}),
                        ("with", spec["with"])):
        activation.activate(flags)
        make_scheduler(num_gpu_blocks=POOL_BLOCKS, block_size=BLOCK)   # EngineCore's startup
        limits = admission.published() or {}
        out[side] = {"refused": submit("over", OVER), "fits_refused": submit("fits", FITS),
                     "total_limit": limits.get("total_limit")}
        activation.deactivate()
        admission.clear_published()
    return out


# ------------------------------------------------------------------------ judging
def _rollbacks(res: dict) -> int:
    return sum(((res.get("kvguard") or {}).get("counters") or {}).get("rollback", {}).values())


def judge(ref: dict, alone: dict, fixed: dict, door: dict) -> list[tuple[bool, str]]:
    """(shown, plain sentence) per thing the demo must show."""
    n = (ref.get("totals") or {}).get("submitted", 0)
    out = [(abstats.completed_all(ref) and ref.get("outputs") is not None,
            f"reference (no faults, no plugin): {_done(ref)}")]
    died = bool(alone.get("engine_died")) and bool(alone.get("faults_injected"))
    out.append((died, "faults, vLLM alone: " + (
        f"the engine DIED at the first injected fault ({_short(alone.get('error'))}); "
        f"{(alone.get('totals') or {}).get('completed', 0)}/{n} requests completed" if died
        else f"did not die as expected: {_done(alone)}")))
    par = abstats.compare_outputs(ref.get("outputs"), ref.get("finish_reasons"),
                                  fixed.get("outputs"), fixed.get("finish_reasons"))
    leaked = abstats.leaked(fixed)
    faults = int(fixed.get("faults_injected") or 0)
    ok = (abstats.completed_all(fixed) and faults > 0 and leaked == 0
          and par["compared"] == n and not par["mismatched"])
    out.append((ok, f"faults, with vllm-kvguard: {_done(fixed)}, "
                    f"{par['identical']}/{n} token-identical to the reference; "
                    f"{faults} faults injected, {_rollbacks(fixed)} rolled back; "
                    f"{'unknown' if leaked is None else leaked} blocks left held"))
    if "error" in door or "with" not in door:
        return out + [(False, f"the door check did not run: {_short(door.get('error'))}")]
    accepted = door["alone"]["refused"] is None
    out.append((accepted, "never-fitting request, vLLM alone: " + (
        "accepted; it can never be scheduled and would wait in the queue forever"
        if accepted else f"refused: {door['alone']['refused']}")))
    w = door["with"]
    refused = w["refused"] is not None and "can never fit" in w["refused"]
    out.append((refused and w["fits_refused"] is None,
                "never-fitting request, with vllm-kvguard: " + (
                    f"refused at once: {w['refused']}" if refused else "accepted")
                + ("" if w["fits_refused"] is None else
                   f"; but one that fits was refused too: {w['fits_refused']}")))
    return out


def _done(res: dict) -> str:
    t = res.get("totals") or {}
    state = ("engine hung" if res.get("hung") else "engine died" if res.get("engine_died")
             else "engine alive")
    return f"{t.get('completed', 0)}/{t.get('submitted', 0)} requests completed, {state}" + (
        f" ({_short(res.get('error'))})" if res.get("error") and not res.get("ok") else "")


def _item(ok: bool, line: str) -> str:
    return textwrap.fill(f"[{'ok' if ok else 'NOT SHOWN'}] {line}", width=100,
                         initial_indent="   ", subsequent_indent="        ")


def _short(text: str | None, n: int = 110) -> str:
    text = " ".join(str(text or "no error").split())
    return text if len(text) <= n else text[: n - 3] + "..."


# ------------------------------------------------------------------------ command line
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvguard demo", description="Show, on this machine in a few minutes, the "
        "failures vllm-kvguard prevents: allocator faults that kill vLLM (with the fixes "
        "every request completes, token-identical), and a request that can never fit "
        "(refused at once with its numbers). Exit 0 when both were shown.")
    p.add_argument("--faults", default="every=7", metavar="SPEC",
                   help="KVGUARD_FAULTS schedule (default every=7: every 7th block "
                        "allocation fails)")
    p.add_argument("--timeout", type=float, default=600.0, metavar="S",
                   help="seconds each engine may take (default 600)")
    p.add_argument("--fixes-off", action="store_true", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--door-child"]:
        try:
            result = _door_child(json.loads(argv[1]))
        except Exception as exc:               # reported by the parent, never a traceback
            result = {"error": f"{type(exc).__name__}: {exc}"}
        print(RESULT_TAG + json.dumps(result), flush=True)
        return 0
    args = build_parser().parse_args(argv)
    from vllm_kvguard.flags import parse_faults

    try:
        parse_faults(args.faults)
    except ValueError as exc:
        build_parser().error(f"--faults: {exc}")
    from vllm_kvguard.tools.ab.cli import cpu_build_of_vllm, installed_vllm

    threads = ({"OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
               if cpu_build_of_vllm() else {})
    spec = scenario_spec(SCENARIO, _settings(args.faults, threads))
    dist, version = installed_vllm() or ("vllm", "?")
    print(f"kvguard demo on {dist} {version}: the embedded tiny Llama (dummy weights, no "
        f"download), {spec.get('num_requests', DEFAULTS['num_requests'])} greedy "
        f"requests, a {spec['engine']['num_gpu_blocks_override']}-block KV pool.")
    print(f"Starting four processes at once: a reference engine, vLLM alone and vLLM with "
        f"vllm-kvguard under KVGUARD_FAULTS={args.faults} (a block allocation fails on "
        f"schedule), and the admission check: about 3 minutes of CPU, one to two minutes "
        f"on an idle 2-core machine.",
        flush=True)
    t0 = time.monotonic()
    try:
        ref, alone, fixed, door = run_together(jobs(args.faults, args.fixes_off, threads),
                                               args.timeout)
    except KeyboardInterrupt:                  # run_together killed its children
        print("kvguard demo: interrupted", file=sys.stderr)
        return 130
    results = judge(ref, alone, fixed, door)
    print("")
    print("1. Allocator faults: the same requests on three engines")
    for ok, line in results[:3]:
        print(_item(ok, line))
    print(textwrap.fill(
        f"2. A request that can never fit: prompt {PROMPT} + max_tokens {OVER} tokens, on a "
        f"pool of {POOL_BLOCKS - 1} usable {BLOCK}-token blocks ({BLOCK * (POOL_BLOCKS - 1)} "
        f"tokens), given to vLLM's own scheduler and input processor (vLLM 0.29 and later "
        f"do not start an engine on a pool that small)", 100, subsequent_indent="   "))
    for ok, line in results[3:]:
        print(_item(ok, line))
    shown = all(ok for ok, _ in results)
    print("")
    print(f"demo: {'PASS' if shown else 'FAIL'} in {time.monotonic() - t0:.0f} s: " + (
        "without the fixes vLLM died and accepted a request it can never serve; with them "
        "every request completed unchanged and the impossible one was refused." if shown
        else "not everything above was shown (see NOT SHOWN)."))
    if shown:
        print(f"Try it on your own script: KVGUARD=1 KVGUARD_PATCHES=none "
            f"KVGUARD_FAULTS={args.faults} (vLLM alone), then without KVGUARD_PATCHES.")
    return 0 if shown else 1


if __name__ == "__main__":
    sys.exit(main())
