"""What ``kvguard-ab`` writes: the side-by-side text table and the JSON file, and the
cells and verdict the chart (:mod:`~vllm_kvguard.tools.ab.chart`) shows too.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from vllm_kvguard.tools.ab import stats as abstats
from vllm_kvguard.tools.ab.stats import FAIL, NA

# ---------------------------------------------------------------------------- text table
COLUMNS = ("scenario", "side", "plugin", "startup s", "done/failed/aborted", "died",
           "leaked", "faults", "tok/s (spread)", "B/A tok/s [min-max]", "parity",
           "rollbacks", "fallbacks", "cudagraph")


MP_NA = "n/a (mp)"   # --multiprocess: the CUDA-graph audit object stays in the worker


def pairs(n) -> str:
    """``1 fresh A/B process pair``, ``3 fresh A/B process pairs``."""
    return f"{n} fresh A/B process pair" + ("" if n == 1 else "s")


def _num(v: float | None, fmt: str = "{:.1f}") -> str:
    return "-" if v is None else fmt.format(v)


def coverage_cell(side: dict) -> str:
    """The CUDA-graph audit of the B engine (shapes covered), else its cudagraph counters."""
    if side.get("engine_core_separate"):
        return MP_NA
    cov = side.get("coverage")
    if cov and cov.get("total"):
        return (f"{cov['covered']}/{cov['total']} shapes" + ("" if cov.get("ok") else " GAPS"))
    if cov:
        return f"n/a on CPU (mode {cov.get('mode')})" if side.get("platform") == "cpu" else (
            f"none intended (mode {cov.get('mode')})")
    found = abstats.counters_matching(side.get("counters"), "cudagraph")
    if found:
        return ", ".join(f"{k.split('.', 1)[1]}={v}" for k, v in found.items())
    return "n/a on CPU" if side.get("platform") == "cpu" else "no counters"


def rollbacks_cell(side: dict) -> str:
    counters = side.get("counters") or {}
    done = sum((counters.get("rollback") or {}).values())
    failed = sum((counters.get("rollback_failed") or {}).values())
    return str(done) + (f" ({failed} failed)" if failed else "")


def parity_cell(par: dict) -> str:
    """``identical/compared``, ``=ref`` when against the reference run, ``MISMATCH``."""
    if par["status"] == NA:
        return "n/a"
    return f"{par['identical']}/{par['compared']}" + (
        " =ref" if par["against"] == "reference" else "") + (
        " MISMATCH" if par["status"] == FAIL else "")


def leaked_cell(side: dict) -> str:
    lk = abstats.leaked(side)
    return "-" if lk is None else str(lk)


def side_row(sc: dict, key: str) -> list[str]:
    side = sc["sides"][key]
    t = side.get("totals") or {}
    died = "HUNG" if side.get("hung") else "YES" if side.get("engine_died") else "no"
    if side.get("startup_failed"):
        died = "NO START"
    thr = abstats.summarize([v for v in side.get("tok_s") or () if v is not None])
    tok = "-" if thr["median"] is None else (
        f"{thr['median']:.0f} ({thr['spread_pct']:.0f}%)" if thr["n"] > 1
        else f"{thr['median']:.0f}")
    row = [sc["name"] if key == "A" else "", key, side.get("label", ""),
           _num(side.get("startup_s")),
           f"{t.get('completed', 0)}/{t.get('failed', 0)}/{t.get('aborted', 0)}"
           + (f" of {t['submitted']}" if t.get("submitted") else ""),
           died, leaked_cell(side),
           str(side["faults_injected"]) if side.get("faults_injected") else "-", tok]
    if key == "A":
        return row + [""] * 5
    th = sc["throughput"]
    ratio = "n/a" if th.get("ratio_median") is None else (
        f"{th['ratio_median']:.3f} [{th['ratio_min']:.2f}-{th['ratio_max']:.2f}]")
    plugin_on = bool(side.get("patches")) or side.get("engine_core_separate")
    counters = side.get("counters")
    fallbacks = str(abstats.counter_total(counters, "fallback"))
    return row + [ratio, parity_cell(sc["parity"]), rollbacks_cell(side) if plugin_on else "-",
                  fallbacks if plugin_on else "-", coverage_cell(side)]


def _grid(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def format_table(report: dict) -> str:
    """The side-by-side table, the failed checks, the micro-benchmarks and the verdict."""
    if report.get("settings", {}).get("serve"):
        return format_serve_table(report)
    rows = [list(COLUMNS)]
    for sc in report["scenarios"]:
        rows += [side_row(sc, "A"), side_row(sc, "B")]
    lines = _grid(rows)
    lines.insert(1, "-" * len(lines[0]))
    env = report.get("environment", {})
    s = report.get("settings", {})
    omp = (s.get("thread_env") or {}).get("OMP_NUM_THREADS")
    threads = f"; {omp} OpenMP thread(s) per engine, unbound" if omp else ""
    lines.insert(0, f"kvguard-ab {report.get('kvguard_version', '')}: vLLM "
                    f"{env.get('vllm', '?')} on {env.get('platform', '?')} "
                    f"({env.get('cpus', '?')} CPUs); A = plugin off, B = plugin on; "
                    f"{pairs(s.get('repeat'))} per scenario, tolerance "
                    f"{s.get('tolerance')}" + threads)
    lines.append("")
    for sc in report["scenarios"]:
        pre = [f"{k} {sc['sides'][k]['preemptions']}" for k in "AB"
               if sc["sides"][k].get("preemptions") is not None]
        extra = f", preemptions {' / '.join(pre)}" if pre else ""
        lines.append(f"{sc['name']}: {sc['description']} "
                     f"[{sc.get('rounds_per_sample', '?')} rounds per sample{extra}]")
        lines += _check_lines(sc)
    return "\n".join(lines + _closing_lines(report))


def _check_lines(sc: dict) -> list[str]:
    return [f"  [{c['status']}] {c['name']}: {c['detail']}" for c in sc["checks"]
            if c["status"] != abstats.PASS or c.get("warn")]


def _closing_lines(report: dict) -> list[str]:
    """The micro-benchmarks, an interruption and the verdict."""
    lines = []
    mb = report.get("microbench") or {}
    for name, res in mb.items():
        if res.get("deterministic") and isinstance(res.get("ratio"), (int, float)):
            lines.append(f"cost in instructions (callgrind, deterministic, this run): "
                         f"{res['ratio']:.4f} ({res.get('meaning', 'B/A')}; "
                         f"{res.get('detail', '')})")
            continue
        if isinstance(res.get("ratio"), (int, float)):
            cell = f"{res['ratio']:.3f} ({res.get('meaning', 'B/A')}; {res.get('detail', '')})"
        else:
            cell = f"n/a ({res.get('detail', 'not measured')})"
        lines.append(f"{name} micro-benchmark, this run: {cell}")
    if report.get("interrupted"):
        lines.append("INTERRUPTED: the table shows the scenarios finished before Ctrl-C")
    lines.append(verdict_line(report))
    return lines


# ---------------------------------------------------------------------------- --serve
SERVE_COLUMNS = ("scenario", "side", "plugin", "startup s", "ok/failed", "client errors",
                 "died", "faults", "TTFT p50/p99 ms", "ITL p50/p99 ms", "E2E p50/p99 s",
                 "tok/s", "B/A tok/s [min-max]", "B/A p50 TTFT/ITL/E2E",
                 "B/A p99 TTFT/ITL/E2E", "parity", "rollbacks")


def _pair(lat: dict, metric: str, scale: float, fmt: str) -> str:
    m = lat.get(metric) or {}
    if m.get("p50") is None:
        return "-"
    return f"{fmt.format(m['p50'] * scale)}/{fmt.format(m['p99'] * scale)}"


def _ratios(r: dict, q: str) -> str:
    vals = [r.get(f"{m}_{q}") for m in abstats.LATENCIES]
    return "n/a" if all(v is None for v in vals) else "/".join(_num(v, "{:.2f}") for v in vals)


def serve_row(sc: dict, key: str) -> list[str]:
    side = sc["sides"][key]
    t, lat = side.get("totals") or {}, side.get("latency") or {}
    died = "NO START" if side.get("startup_failed") else "YES" if side.get("engine_died") \
        else "no"
    errors = ", ".join(f"{k} x{n}" for k, n in (side.get("errors") or {}).items()) or "-"
    tok = abstats.summarize([v for v in side.get("tok_s") or () if v is not None])
    row = [sc["name"] if key == "A" else "", key, side.get("label", ""),
           _num(side.get("startup_s")),
           f"{t.get('completed', 0)}/{t.get('failed', 0)} of {t.get('submitted', 0)}",
           errors, died, str(side.get("faults_injected") or "-"),
           _pair(lat, "ttft", 1e3, "{:.0f}"), _pair(lat, "itl", 1e3, "{:.1f}"),
           _pair(lat, "e2e", 1.0, "{:.2f}"), _num(tok["median"], "{:.0f}")]
    if key == "A":
        return row + [""] * 5
    th, par, r = sc["throughput"], sc["parity"], sc.get("latency_ratios") or {}
    ratio = "n/a" if th.get("ratio_median") is None else (
        f"{th['ratio_median']:.3f} [{th['ratio_min']:.2f}-{th['ratio_max']:.2f}]")
    par_cell = "n/a" if par["status"] == NA else (
        f"{par['identical']}/{par['compared']}"
        + (" =ref" if par["against"] == "reference" else "")
        + (" MISMATCH" if par["status"] == FAIL else ""))
    plugin_on = any("EngineCore" in p for p in side.get("processes") or ())
    return row + [ratio, _ratios(r, "p50"), _ratios(r, "p99"), par_cell,
                  rollbacks_cell(side) if plugin_on else "-"]


def format_serve_table(report: dict) -> str:
    """``--serve``: the client's view of both servers side by side, then as format_table."""
    rows = [list(SERVE_COLUMNS)]
    for sc in report["scenarios"]:
        rows += [serve_row(sc, "A"), serve_row(sc, "B")]
    lines = _grid(rows)
    lines.insert(1, "-" * len(lines[0]))
    env, s = report.get("environment", {}), report.get("settings", {})
    sc0 = report["scenarios"][0]
    lines.insert(0, f"kvguard-ab {report.get('kvguard_version', '')} --serve: vLLM "
                    f"{env.get('vllm', '?')} on {env.get('platform', '?')} "
                    f"({env.get('cpus', '?')} CPUs); A and B = vllm serve, A plugin off, "
                    f"B plugin on; {s.get('repeat')} request stream(s) per side (ABBA), "
                    f"{sc0.get('requests_per_stream')} requests each, Poisson "
                    f"{s.get('request_rate')} req/s, streamed; tolerance {s.get('tolerance')}")
    lines.append("")
    for sc in report["scenarios"]:
        lines.append(f"{sc['name']}: {sc['description']}")
        lines += _check_lines(sc)
    return "\n".join(lines + _closing_lines(report))


def checks_with(report: dict, status: str) -> list[str]:
    """``"scenario: check"`` for every check of ``status``."""
    return [f"{sc['name']}: {c['name']}" for sc in report["scenarios"]
            for c in sc["checks"] if c["status"] == status]


def verdict(report: dict) -> str:
    """PASS, FAIL or INCOMPLETE (interrupted, nothing failed)."""
    return ("FAIL" if checks_with(report, FAIL) else
            "INCOMPLETE" if report.get("interrupted") else "PASS")


def verdict_line(report: dict) -> str:
    word, unsure = verdict(report), checks_with(report, abstats.INCONCLUSIVE)
    return ("verdict: " + word
            + (f" ({'; '.join(checks_with(report, FAIL))})" if word == "FAIL" else "")
            + (f"; throughput not resolved by this run's noise (inconclusive, not a "
               f"failure): {'; '.join(unsure)}" if unsure else ""))


# ---------------------------------------------------------------------------- JSON
def write_json(report: dict, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1, sort_keys=False) + "\n")
    return path


def load(path: str | Path) -> dict[str, Any]:
    return json.loads(Path(path).read_text())
