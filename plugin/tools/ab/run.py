"""How ``kvguard-ab`` runs one scenario: fresh A/B process pairs, interleaved rounds, one
summary per side.

* ``--repeat`` times per scenario, a fresh pair of processes (``python -m
  vllm_kvguard.tools.ab.workload --serve``), A and B: a given pair of processes carries a bias
  of its own (memory layout, hash seed), which only fresh processes average out, as pyperf
  does;
* in a pair, both import vLLM and build their engine at the same time ("startup s" is
  ``LLM(...)`` alone, each under the same load from the other); then both stay alive,
  idle while the other works, pinned to the same CPU(s);
* ``--warmup`` unmeasured rounds on each, then one sample: ``--rounds`` generate rounds of
  the same deterministic greedy workload on each engine, one by one in ABBA order; a
  sample's throughput = generated tokens of a round / its fastest round inside
  ``LLM.generate`` (see :func:`vllm_kvguard.tools.ab.stats.throughput`);
* greedy outputs are compared request by request (against a fault-free, plugin-off
  reference run when A died); a side that died or failed to start is not started again
  for the later pairs.

The ratios and checks over these summaries are :mod:`vllm_kvguard.tools.ab.stats`.
"""
from __future__ import annotations

import contextlib
import math
import sys
import time

from vllm_kvguard.tools.ab import stats as abstats
from vllm_kvguard.tools.ab.scenarios import (MIN_AUTO_ROUNDS, Scenario, scenario_envs,
                                            scenario_spec, workload_key)
from vllm_kvguard.tools.ab.harness import WorkloadProcess, run_in_subprocess


# ---------------------------------------------------------------------------- progress
class Progress:
    """One line per step on stderr (a tqdm bar instead when stderr is a terminal)."""

    def __init__(self, total: int, quiet: bool = False):
        self.t0 = time.monotonic()
        self.quiet = quiet
        self.bar = None
        if not quiet and sys.stderr.isatty():
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, file=sys.stderr, unit="step",
                                bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}]")
            except ImportError:
                pass

    def say(self, msg: str, advance: int = 0) -> None:
        if self.quiet:
            return
        if self.bar is not None:
            self.bar.set_description_str(msg[:60])
            self.bar.update(advance)
            return
        el = int(time.monotonic() - self.t0)
        print(f"[kvguard-ab {el // 60}:{el % 60:02d}] {msg}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def steps_for(settings: dict) -> int:
    warm = bool(settings["warmup"] or settings["rounds"] == "auto")
    per_pair = 2 * (1 + warm + 1 + 1)              # starts, warm-ups, sample, stops
    return (per_pair * settings["repeat"] * len(settings["scenarios"])
            + (2 if settings.get("microbench", True) else 0))


# ---------------------------------------------------------------------------- running
class Side:
    """One engine process of one A/B pair and what it reported."""

    def __init__(self, key: str, label: str, env: dict):
        self.key, self.label, self.env = key, label, env
        self.proc: WorkloadProcess | None = None
        self.ready: dict = {}
        self.warmup_s: list[float] = []
        self.sample: list[float] | None = []           # round times of the measured sample
        self.final: dict = {}
        self.died = self.hung = False
        self.error: str | None = None

    @property
    def usable(self) -> bool:
        return bool(self.ready.get("ok")) and not self.died and not self.hung

    def run_rounds(self, n: int, timeout: float) -> list[float] | None:
        if not self.usable:
            return None
        res = self.proc.rounds(n, timeout)
        self.died |= bool(res.get("engine_died"))
        self.hung |= bool(res.get("hung"))
        self.error = res.get("error") or self.error
        times = res.get("round_s") or []
        return times if res.get("ok") and len(times) == n else None

    @property
    def failed(self) -> bool:
        """Died, hung or never started: not worth starting again in a later pair."""
        return not self.ready.get("ok") or self.died or self.hung or bool(
            self.final.get("engine_died") or self.final.get("hung"))




def _best_s(times: list[float] | None) -> str:
    return f"fastest round {min(times):.3f} s" if times else "no sample"


def calibrate(settings: dict, sides: list[Side], floor: int = MIN_AUTO_ROUNDS) -> int:
    """``--rounds``, or for ``auto`` enough rounds to fill ``--sample-seconds`` (at least
    ``floor``: a scenario whose rounds are slow and noisy asks for more to choose from)."""
    if settings["rounds"] != "auto":
        return settings["rounds"]
    last = [s.warmup_s[-1] for s in sides if s.warmup_s]
    floor = max(floor, MIN_AUTO_ROUNDS)
    if not last:
        return floor
    return max(floor, min(200, math.ceil(settings["sample_seconds"] / max(min(last), 1e-3))))


def run_pair(name: str, index: int, spec: dict, sides: list[Side], settings: dict,
             rounds: int | None, prog: Progress, min_rounds: int = MIN_AUTO_ROUNDS) -> int | None:
    """One fresh A/B pair of processes: start (imports together, engines one by one), warm
    up, one sample of ``rounds`` rounds each in ABBA order, stop. ``rounds`` None: calibrate
    from the warm-up. Returns the rounds used."""
    timeout, tag = settings["timeout"], f"{name} [{index + 1}/{settings['repeat']}]"
    with contextlib.ExitStack() as stack:
        for side in sides:
            side.proc = stack.enter_context(WorkloadProcess(spec, side.env))
        prog.say(f"{tag}: importing vLLM in {' and '.join(s.key for s in sides)}")
        for side in sides:
            side.proc.imported(timeout)
        prog.say(f"{tag}: building the engines "
                 + ", ".join(f"{s.key} (plugin {s.label})" for s in sides))
        for side in sides:                  # built at once: each under the other's load
            if side.proc.imported(timeout).get("ok"):
                side.proc.start()
        for side in sides:
            side.ready = side.proc.ready(timeout)
            prog.say(f"{tag}: engine {side.key} "
                     + (f"up in {side.ready['engine_s']:.1f} s" if side.ready.get("ok")
                        else f"failed to start: {side.ready.get('error')}"), advance=1)
        if settings["warmup"] or rounds is None:
            for side in sides:
                side.warmup_s = side.run_rounds(max(1, settings["warmup"]), timeout) or []
                prog.say(f"{tag}: {side.key} warm-up " + (
                    f"{sum(side.warmup_s):.2f} s" if side.warmup_s
                    else f"FAILED ({side.error})"), advance=1)
        if rounds is None:
            rounds = calibrate(settings, sides, min_rounds)
        order = sides if index % 2 == 0 else sides[::-1]
        for j in range(rounds):                        # ABBA at round granularity
            for side in (order if j % 2 == 0 else order[::-1]):
                times = side.run_rounds(1, timeout)
                side.sample = None if times is None or side.sample is None else (
                    side.sample + times)
        prog.say(f"{tag}: sample of {rounds} rounds each: "
                 + ", ".join(f"{s.key} {_best_s(s.sample)}" for s in sides), advance=2)
        for side in sides:
            side.proc.request_finish()
        for side in sides:
            side.final = side.proc.finish(timeout)
        prog.say(f"{tag}: engines stopped", advance=2)
    return rounds


def _merge_counters(all_counters: list[dict]) -> dict:
    out: dict[str, dict[str, int]] = {}
    for counters in all_counters:
        for cat, reasons in (counters or {}).items():
            for reason, n in reasons.items():
                out.setdefault(cat, {})
                out[cat][reason] = out[cat].get(reason, 0) + n
    return out


def side_summary(runs: list[Side], repeat: int) -> dict:
    """One side over its pairs (see :func:`workload.Session.finish` for each result): sums
    of requests and counters, one throughput sample per pair (None where it had none)."""
    first = runs[0]
    finals = [r.final for r in runs]
    out_run = next((f for f in finals if f.get("outputs") is not None), {})
    kv = [f.get("kvguard") or {} for f in finals]
    totals: dict[str, int] = {}
    for f in finals:
        for k, v in (f.get("totals") or {}).items():
            totals[k] = totals.get(k, 0) + v
    held = [f["held_blocks"] for f in finals if f.get("held_blocks") is not None]
    tok_s = []
    for r in runs:
        tokens = r.final.get("tokens_per_round")
        tok_s.append(abstats.throughput(tokens, r.sample) if r.sample and tokens else None)
    tok_s += [None] * (repeat - len(tok_s))            # pairs this side was not restarted for
    died = any(r.died or f.get("engine_died") for r, f in zip(runs, finals))
    hung = any(r.hung or f.get("hung") for r, f in zip(runs, finals))
    failed = next((r for r in runs if r.failed), None)
    startups = [r.ready.get("engine_s") for r in runs if r.ready.get("engine_s") is not None]
    outputs = out_run.get("outputs")
    consistent = all(f.get("outputs_consistent", True) for f in finals) and all(
        f.get("outputs") in (None, outputs) for f in finals)
    return {
        "label": first.label, "env": first.env, "pairs": len(runs),
        "startup_s": abstats.summarize(startups)["median"],   # LLM(...) only, median
        "startup_s_all": startups,
        "import_s": abstats.summarize([r.ready.get("import_s") or 0 for r in runs])["median"],
        "startup_failed": not any(r.ready.get("ok") for r in runs),
        "engine_died": died and not hung, "hung": hung,
        "error": next((f.get("error") or r.error or r.ready.get("error") for r, f in
                       zip(runs, finals) if f.get("error") or r.error
                       or r.ready.get("error")), None),
        "totals": totals,
        "pool_blocks": out_run.get("pool_blocks"),
        "held_blocks": max(held) if held and not died and not hung else None,
        "died_held_blocks": next((f.get("died_held_blocks") for f in finals
                                  if f.get("died_held_blocks") is not None), None),
        "audit_violations": (None if any(f.get("audit_violations") is None for f in finals)
                             else [v for f in finals for v in f["audit_violations"]]),
        "warmup_round_s": [r.warmup_s for r in runs],
        "sample_round_s": [r.sample for r in runs],
        "tok_s": tok_s,
        "tokens_per_round": out_run.get("tokens_per_round"),
        "outputs": outputs, "finish_reasons": out_run.get("finish_reasons"),
        "outputs_consistent": consistent,
        "counters": _merge_counters([k.get("counters") for k in kv]),
        "patches": (kv[0] or {}).get("results"),
        "faults_injected": sum(f.get("faults_injected") or 0 for f in finals),
        "platform": next((f.get("platform") for f in finals if f.get("platform")), None),
        "preemptions": (None if any(f.get("preemptions") is None for f in finals)
                        else sum(f["preemptions"] for f in finals)),
        "coverage": next((k.get("coverage") for k in kv if k.get("coverage")), None),
        # with --multiprocess the fixes run in EngineCore: their counters arrive through
        # vLLM's collective_rpc (workload.counters_of_every_process), the coverage audit not
        "engine_core_separate": bool(first.proc and first.proc.spec.get("multiprocess")),
        "stderr_tail": failed.final.get("stderr") if failed else None,
    }


def run_scenario(sc: Scenario, settings: dict, prog: Progress,
                 references: dict[str, dict], environment: dict) -> dict:
    """``--repeat`` fresh A/B pairs of one scenario; fills ``environment`` on first use."""
    spec = scenario_spec(sc, settings)
    env_a, env_b, label_a, label_b = scenario_envs(sc, settings)
    runs: dict[str, list[Side]] = {"A": [], "B": []}
    rounds = None if settings["rounds"] == "auto" else settings["rounds"]
    for i in range(settings["repeat"]):
        sides = [Side(k, label, env) for k, label, env in
                 (("A", label_a, env_a), ("B", label_b, env_b))
                 if not (runs[k] and runs[k][-1].failed)]   # a dead side is not restarted
        if not sides:
            break
        rounds = run_pair(sc.name, i, spec, sides, settings, rounds, prog, sc.min_rounds)
        for side in sides:
            runs[side.key].append(side)
            if side.ready.get("ok") and not environment.get("vllm"):
                imported = side.proc.imported(0)
                if imported.get("versions"):
                    environment.update(platform=imported.get("platform"),
                                       **imported["versions"])
    summary = {k: side_summary(v, settings["repeat"]) for k, v in runs.items()}
    a, b = summary["A"], summary["B"]

    key = workload_key(spec)
    if not sc.faults and abstats.completed_all(a) and a.get("outputs") is not None:
        references.setdefault(key, {"outputs": a["outputs"], "finish_reasons":
                                    a["finish_reasons"], "source": f"{sc.name} A"})
    reference = None
    if a.get("outputs") is None and b.get("outputs") is not None:
        reference = references.get(key)
        if reference is None:
            prog.say(f"{sc.name}: A finished nothing; reference run (plugin off, no faults)")
            ref = run_in_subprocess({**spec, "rounds": 1}, settings.get("thread_env"),
                                    settings["timeout"])
            reference = {"outputs": ref.get("outputs"),
                         "finish_reasons": ref.get("finish_reasons"),
                         "source": "reference run", "error": ref.get("error")}
            references[key] = reference
    par = abstats.parity(a, b, reference)
    thr = abstats.throughput_summary(a["tok_s"], b["tok_s"], a["sample_round_s"],
                                     b["sample_round_s"])
    checks = abstats.checks(a, b, par, thr, settings["tolerance"], sc.faulted_fail)
    return {"name": sc.name, "description": sc.description, "spec": spec,
            "rounds_per_sample": rounds, "sides": summary,
            "reference": None if reference is None else {
                k: reference.get(k) for k in ("source", "error")},
            "parity": par, "throughput": thr, "checks": checks,
            "ok": abstats.verdict(checks)}
