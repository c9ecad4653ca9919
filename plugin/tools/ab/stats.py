"""The numbers behind ``kvguard-ab``: throughput samples, paired ratios, output parity and
the pass/fail checks. Pure functions over plain dicts (no vLLM), so they are unit-tested.

A *side* is what one engine process reported (see
:func:`vllm_kvguard.tools.ab.run.side_summary`): ``tok_s`` (one throughput per measured
sample), ``totals``, ``outputs``/``finish_reasons`` (the first round), ``held_blocks``,
``audit_violations``, ``counters``...

Ratios are paired: sample *i* of B divided by sample *i* of A, both from the *i*-th fresh
pair of processes, whose rounds ran one by one in ABBA order, so drift of a shared machine
cancels within a pair and the bias of one pair of processes across pairs; with the round
times, every round pair (adjacent rounds of A and B) gives a ratio. The median is reported
with its min-max, and a cost verdict is given only where that range resolves the
tolerance (:func:`cost_status`); otherwise it is ``inconclusive``, never a failure.
"""
from __future__ import annotations

import statistics
from typing import Any, Iterable, Sequence

FINISHED = ("length", "stop")

PASS, FAIL, NA = "pass", "FAIL", "n/a"
INCONCLUSIVE = "inconclusive"      # below tolerance, but the pairs disagree: not a verdict


def summarize(values: Sequence[float]) -> dict[str, Any]:
    """Median, min, max, count and the spread (max-min) in percent of the median."""
    vals = [float(v) for v in values]
    if not vals:
        return {"n": 0, "median": None, "min": None, "max": None, "spread_pct": None}
    med = statistics.median(vals)
    spread = 100.0 * (max(vals) - min(vals)) / med if med else None
    return {"n": len(vals), "median": med, "min": min(vals), "max": max(vals),
            "spread_pct": spread}


def throughput(tokens_per_round: int, sample_round_s: Sequence[float]) -> float | None:
    """Tokens per second of one sample: tokens of a round / the sample's fastest round.
    Other processes on a shared machine only ever slow a round down, so the fastest round
    is the best estimate of what the engine itself costs (timeit's rule); both sides get
    the same treatment and the raw round times stay in the JSON."""
    if not sample_round_s:
        return None
    best = min(sample_round_s)
    return tokens_per_round / best if best > 0 else None


def paired_ratios(a: Sequence[float | None], b: Sequence[float | None]) -> list[float]:
    """B/A for each pair where both samples exist (pairs are aligned by index)."""
    return [y / x for x, y in zip(a, b) if x and y is not None]


def noisy(thr: dict, tolerance: float) -> bool:
    """The pairs disagree by more than twice the tolerance band (e.g. 6% for 0.97)."""
    spread = thr.get("ratio_spread_pct")
    return spread is not None and spread > 200.0 * abs(1.0 - tolerance)


def round_ratios(a_rounds: Sequence[Sequence[float] | None],
                 b_rounds: Sequence[Sequence[float] | None]) -> list[float]:
    """B/A throughput of each round pair: round *j* of A and round *j* of B ran next to
    each other (ABBA) in the same pair of processes, so the machine's drift is shared;
    equal tokens per round, so B/A = A's time / B's time."""
    out = []
    for ra, rb in zip(a_rounds, b_rounds):
        out += [x / y for x, y in zip(ra or (), rb or ()) if x > 0 and y > 0]
    return out


def throughput_summary(a_tok_s: Sequence[float | None], b_tok_s: Sequence[float | None],
                       a_rounds: Sequence | None = None,
                       b_rounds: Sequence | None = None) -> dict[str, Any]:
    """B/A over the paired samples, or with the round times over every round pair (the
    median, and the min-max that decides whether the tolerance is resolved)."""
    ratios = paired_ratios(a_tok_s, b_tok_s)
    if a_rounds is not None and b_rounds is not None:
        ratios = round_ratios(a_rounds, b_rounds) or ratios
    s = summarize(ratios)
    return {"ratio_median": s["median"], "ratio_min": s["min"], "ratio_max": s["max"],
            "ratios": ratios, "ratio_spread_pct": s["spread_pct"],
            "a": summarize([v for v in a_tok_s if v is not None]),
            "b": summarize([v for v in b_tok_s if v is not None])}


def compare_outputs(ref_outputs: Sequence[Sequence[int]] | None,
                    ref_reasons: Sequence[str] | None,
                    outputs: Sequence[Sequence[int]] | None,
                    reasons: Sequence[str] | None) -> dict[str, Any]:
    """Token-identical greedy outputs, request by request, where both sides finished."""
    if ref_outputs is None or outputs is None:
        return {"compared": 0, "identical": 0, "mismatched": []}
    compared, identical, mismatched = 0, 0, []
    for i, (r_out, r_why, out, why) in enumerate(zip(ref_outputs, ref_reasons or (),
                                                     outputs, reasons or ())):
        if r_why not in FINISHED or why not in FINISHED:
            continue
        compared += 1
        if list(r_out) == list(out):
            identical += 1
        else:
            mismatched.append(i)
    return {"compared": compared, "identical": identical, "mismatched": mismatched}


def parity(a: dict, b: dict, reference: dict | None = None) -> dict[str, Any]:
    """B's first-round outputs against A's, or against ``reference`` (a clean, plugin-off,
    fault-free run of the same workload) when A produced none. ``status``: pass, FAIL, n/a."""
    against, ref = "A", a
    if a.get("outputs") is None and reference is not None:
        against, ref = "reference", reference
    res = compare_outputs(ref.get("outputs"), ref.get("finish_reasons"),
                          b.get("outputs"), b.get("finish_reasons"))
    res["against"] = against if res["compared"] else None
    res["status"] = NA if not res["compared"] else (PASS if not res["mismatched"] else FAIL)
    return res


def counter_total(counters: dict[str, dict[str, int]] | None, word: str) -> int:
    """Sum of every counter whose category name contains ``word``."""
    return sum(n for cat, reasons in (counters or {}).items() if word in cat
               for n in reasons.values())


def counters_matching(counters: dict[str, dict[str, int]] | None,
                      word: str) -> dict[str, int]:
    """``{"category.reason": n}`` for the categories containing ``word``."""
    return {f"{cat}.{reason}": n for cat, reasons in sorted((counters or {}).items())
            if word in cat for reason, n in sorted(reasons.items())}


def leaked(side: dict) -> int | None:
    """Blocks held after every request of a live engine finished, or audit violations;
    None when unknown (the engine died or never started)."""
    if side.get("engine_died") or side.get("hung") or side.get("held_blocks") is None:
        return None
    return int(side["held_blocks"]) + len(side.get("audit_violations") or ())


def completed_all(side: dict) -> bool:
    t = side.get("totals") or {}
    return (not side.get("engine_died") and not side.get("hung")
            and t.get("submitted", 0) > 0 and t.get("completed") == t.get("submitted"))


def checks(a: dict, b: dict, par: dict, thr: dict, tolerance: float,
           faulted_fail: bool = False) -> list[dict[str, str]]:
    """What makes a scenario pass: B completes every request (``faulted_fail``: all but
    the faulted ones, which fail), leaks nothing, gives A's greedy outputs, stays as
    deterministic as A, and keeps A's throughput within tolerance."""
    out = []

    def add(name: str, status: str, detail: str, warn: bool = False) -> None:
        out.append({"name": name, "status": status, "detail": detail, "warn": warn})

    t = b.get("totals") or {}
    state = "hung" if b.get("hung") else "died" if b.get("engine_died") else "alive"
    detail = (f"{t.get('completed', 0)}/{t.get('submitted', 0)} completed, engine {state}"
              + (f": {b.get('error')}" if b.get("error") else ""))
    if faulted_fail:
        faulted = int(b.get("faults_injected") or 0)
        ok = (state == "alive" and faulted > 0 and t.get("failed") == faulted
              and t.get("completed") == t.get("submitted", 0) - faulted)
        add("B completes every request but the faulted ones", PASS if ok else FAIL,
            f"{detail}; {t.get('failed', 0)} failed, {faulted} faults injected")
    else:
        add("B completes every request", PASS if completed_all(b) else FAIL, detail)

    lk = leaked(b)
    add("B leaks no blocks", NA if lk is None else PASS if lk == 0 else FAIL,
        "unknown" if lk is None else f"{b.get('held_blocks')} blocks held after the run, "
        f"{len(b.get('audit_violations') or ())} audit violations")

    detail = (f"{par['identical']}/{par['compared']} requests token-identical to "
              f"{par['against']}" if par["compared"] else "nothing to compare")
    if par.get("mismatched"):
        detail += f"; differing requests: {par['mismatched']}"
    add("greedy parity", par["status"], detail)

    if a.get("outputs") is not None and b.get("outputs") is not None:
        bad = a.get("outputs_consistent", True) and not b.get("outputs_consistent", True)
        add("B as deterministic as A across rounds", FAIL if bad else PASS,
            f"A consistent: {a.get('outputs_consistent')}, B consistent: "
            f"{b.get('outputs_consistent')}")

    med = thr.get("ratio_median")
    if med is None:
        add("throughput ratio", NA, "no paired samples (a side did not finish its rounds)")
    else:
        status, note = cost_status(thr, tolerance)
        add("throughput ratio", status,
            f"median B/A {med:.3f} over {len(thr['ratios'])} round pairs "
            f"(min {thr['ratio_min']:.3f}, max {thr['ratio_max']:.3f}); tolerance {tolerance}"
            + note, warn=bool(note))
    return out


def cost_status(thr: dict, tolerance: float) -> tuple[str, str]:
    """A cost verdict only where the measurement resolves the tolerance: PASS when every
    round pair is at or above it, FAIL when every one is below it and they agree within
    twice the band; otherwise INCONCLUSIVE (never a failure), with why."""
    lo, hi = thr["ratio_min"], thr["ratio_max"]
    if lo >= tolerance:
        return PASS, ""
    if hi < tolerance and not noisy(thr, tolerance):
        return FAIL, ""
    why = (f"the round pairs spread {thr['ratio_spread_pct']:.0f}%, more than twice the "
           f"{100 * abs(1 - tolerance):.0f}% band (a busy machine?)" if noisy(thr, tolerance)
           else "the round pairs lie on both sides of the tolerance")
    return INCONCLUSIVE, (f"; not resolved: {why}; not counted as a failure (a quieter "
                          f"machine or --repeat 3 resolves more)")


def verdict(all_checks: Iterable[dict]) -> bool:
    return all(c["status"] != FAIL for c in all_checks)


# ---------------------------------------------------------------------------- serving
LATENCIES = ("ttft", "itl", "e2e")        # time to first token, between tokens, end to end


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100), linear between the closest ranks (numpy's default,
    as vLLM's serving benchmark computes it); None for no values."""
    vals = sorted(float(v) for v in values)
    if not vals:
        return None
    pos = (len(vals) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(vals) - 1)
    return vals[lo] + (vals[hi] - vals[lo]) * (pos - lo)


def latency_summary(samples: dict[str, Sequence[float]]) -> dict[str, dict[str, float | None]]:
    """``{metric: {"p50", "p99", "n"}}`` for each latency in ``samples`` (seconds)."""
    return {m: {"p50": percentile(samples.get(m) or (), 50),
                "p99": percentile(samples.get(m) or (), 99), "n": len(samples.get(m) or ())}
            for m in LATENCIES}


def latency_ratios(a: dict, b: dict) -> dict[str, float | None]:
    """B/A of each latency percentile, ``{"ttft_p50": r, ...}`` (None where a side has none);
    above 1 means B is slower."""
    out = {}
    for m in LATENCIES:
        for q in ("p50", "p99"):
            x, y = (a.get(m) or {}).get(q), (b.get(m) or {}).get(q)
            out[f"{m}_{q}"] = y / x if x and y is not None else None
    return out
