"""Scenario results as ``kvguard-ab`` builds them, for the writer, stats and CLI tests.

Plain dicts in the shape :mod:`vllm_kvguard.tools.ab.run` produces, so the checks, the
table, the JSON and the chart are tested without starting an engine.
"""
from __future__ import annotations

from vllm_kvguard.tools.ab import stats as abstats

OUT = [[5, 6, 7], [8, 9, 10]]


def side(label="off", *, died=False, tok_s=(100.0, 102.0, 98.0), outputs=OUT, held=0,
         counters=None, patches=None, faults=0, platform="cpu", consistent=True):
    n = 8 * (1 + len(tok_s))
    return {
        "label": label, "env": {}, "startup_s": 7.5, "startup_failed": False,
        "engine_died": died, "hung": False, "error": "InjectedFault: boom" if died else None,
        "totals": ({"submitted": 8, "completed": 0, "failed": 8, "aborted": 0} if died else
                   {"submitted": n, "completed": n, "failed": 0, "aborted": 0}),
        "held_blocks": None if died else held, "audit_violations": None if died else [],
        "tok_s": [] if died else list(tok_s), "tokens_per_round": 256,
        "outputs": None if died else outputs,
        "finish_reasons": None if died else ["length"] * len(outputs),
        "outputs_consistent": consistent, "counters": counters or {}, "patches": patches,
        "faults_injected": faults, "platform": platform,
    }


def scenario(name="baseline", a=None, b=None, reference=None, tolerance=0.97):
    a = a or side()
    b = b or side("on", patches={"allocator": "applied"})
    par = abstats.parity(a, b, reference)
    thr = abstats.throughput_summary(a["tok_s"], b["tok_s"])
    checks = abstats.checks(a, b, par, thr, tolerance)
    return {"name": name, "description": f"{name} scenario", "rounds_per_sample": 4,
            "sides": {"A": a, "B": b}, "parity": par, "throughput": thr, "checks": checks,
            "ok": abstats.verdict(checks)}


def report(*scenarios, interrupted=False):
    scs = list(scenarios) or [scenario()]
    return {"tool": "kvguard-ab", "kvguard_version": "0.1.0",
            "environment": {"vllm": "0.32.0", "platform": "cpu", "cpus": 2},
            "settings": {"repeat": 3, "tolerance": 0.97}, "scenarios": scs,
            "microbench": {"allocator": {"ratio": None, "detail": "not present"}},
            "interrupted": interrupted, "ok": all(s["ok"] for s in scs)}
