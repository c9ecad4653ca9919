"""The ``kvguard-ab`` PNG chart: requests completed by A and B, and the throughput ratio B/A
with its min-max, one column per scenario.

:func:`chart_spec` computes everything the chart says (title with the verdict, vLLM
version, date and machine; the legend labels; the NOISY / inconclusive / FAIL marks; leaked
blocks and parity per scenario) from the report alone, so it is unit-tested without
drawing. :func:`write_png` draws it with matplotlib, the optional ``chart`` extra
(``pip install 'vllm-kvguard[chart]'``); without it the tool says so in one line
(:data:`MISSING`) and writes no PNG.
"""
from __future__ import annotations

from pathlib import Path

from vllm_kvguard.tools.ab import report as abreport, stats as abstats

MISSING = "no PNG: matplotlib is not installed (pip install 'vllm-kvguard[chart]')"
COLORS = {"A": "#8c8c8c", "B": "#2d6ec8", abstats.PASS: "#2a9640", abstats.FAIL: "#d22828",
          abstats.INCONCLUSIVE: "#e08a00", "line": "#555555"}
A_LABEL, B_LABEL = "A: plugin off", "B: plugin on"
EQUAL_LABEL = "B = A (ratio 1.0)"
ORDER = (abstats.PASS, abstats.FAIL, abstats.INCONCLUSIVE, abstats.NA)   # legend order


def _completed(side: dict) -> tuple[float | None, str]:
    """Percent of submitted requests completed, and the label over its bar."""
    t = side.get("totals") or {}
    pct = 100.0 * t.get("completed", 0) / t["submitted"] if t.get("submitted") else 0.0
    dead = side.get("engine_died") or side.get("hung") or side.get("startup_failed")
    if dead and not pct:
        return None, "died" if not side.get("startup_failed") else "no start"
    return pct, f"{pct:.0f}%"


def _throughput_status(sc: dict) -> str:
    return next((c["status"] for c in sc["checks"] if c["name"] == "throughput ratio"),
                abstats.NA)


def ratio_label(status: str) -> str:
    return f"B/A median, min-max ({status})"


def tolerance_label(tol: float) -> str:
    return f"tolerance {tol} (below it: FAIL)"


def machine(env: dict) -> str:
    """``x86_64, cpu, 2 CPUs``: the machine of a report's ``environment``."""
    parts = [str(x) for x in (env.get("machine"), env.get("platform")) if x]
    return ", ".join(parts + [f"{env.get('cpus', '?')} CPUs"])


def chart_spec(report: dict) -> dict:
    """What the chart shows, as plain data: ``title``, ``subtitle``, ``tolerance``,
    ``legend`` (labels per panel, in drawing order) and one ``rows`` entry per scenario."""
    env, s = report.get("environment") or {}, report.get("settings") or {}
    tol = s.get("tolerance", 0.97)
    unsure = abreport.checks_with(report, abstats.INCONCLUSIVE)
    verdict = abreport.verdict(report) + (f", {len(unsure)} inconclusive" if unsure else "")
    title = (f"kvguard-ab {verdict} | vLLM {env.get('vllm', '?')} | "
             f"{(report.get('started_at') or '?')[:10]} | {machine(env)}")
    subtitle = (f"A = plugin off, B = plugin on; {abreport.pairs(s.get('repeat', '?'))} per "
                f"scenario; tolerance {tol}")
    rows, statuses = [], []
    for sc in report["scenarios"]:
        a, b = sc["sides"]["A"], sc["sides"]["B"]
        th, status = sc["throughput"], _throughput_status(sc)
        marks = []
        if abstats.noisy(th, tol):
            marks.append("NOISY")
        if status == abstats.INCONCLUSIVE:
            marks.append("inconclusive")
        if not sc["ok"]:
            marks.append("FAIL")
        ratio = None if th.get("ratio_median") is None else (
            th["ratio_median"], th["ratio_min"], th["ratio_max"])
        if ratio is not None and status not in statuses:
            statuses.append(status)
        (pa, la), (pb, lb) = _completed(a), _completed(b)
        leaked = f"leaked A {abreport.leaked_cell(a)} / B {abreport.leaked_cell(b)}"
        parity = f"parity {abreport.parity_cell(sc['parity'])}"
        rows.append({"name": sc["name"], "completed": {"A": pa, "B": pb},
                     "completed_labels": {"A": la, "B": lb}, "ratio": ratio,
                     "status": status, "marks": marks, "leaked": leaked, "parity": parity,
                     "xlabel": "\n".join((sc["name"], leaked, parity))})
    legend = {"completed": [A_LABEL, B_LABEL],
              "throughput": [ratio_label(st) for st in ORDER if st in statuses]
              + [EQUAL_LABEL, tolerance_label(tol)]}
    return {"title": title, "subtitle": subtitle, "tolerance": tol, "rows": rows,
            "legend": legend}


def figure(spec: dict):
    """The matplotlib ``Figure`` for :func:`chart_spec` (no pyplot, no global state)."""
    from matplotlib.figure import Figure

    rows = spec["rows"]
    n = max(1, len(rows))
    fig = Figure(figsize=(max(9.0, 2.0 * n + 3.5), 8.0), dpi=110, layout="constrained")
    fig.suptitle(spec["title"] + "\n" + spec["subtitle"], fontsize=11,
                 fontfamily="DejaVu Sans")
    top, bottom = fig.subplots(2, 1, sharex=True)
    xs = list(range(len(rows)))
    for i, key, label in ((-1, "A", A_LABEL), (1, "B", B_LABEL)):
        pos = [x + i * 0.18 for x in xs]
        vals = [r["completed"][key] or 0.0 for r in rows]
        bars = top.bar(pos, vals, width=0.34, color=COLORS[key], label=label)
        for bar, r in zip(bars, rows):
            dead = r["completed"][key] is None
            top.annotate(r["completed_labels"][key], (bar.get_x() + bar.get_width() / 2,
                         bar.get_height()), xytext=(0, 2), textcoords="offset points",
                         ha="center", va="bottom", fontsize=8,
                         color=COLORS[abstats.FAIL] if dead else "black")
    top.set_ylim(0, 115)
    top.set_ylabel("requests completed (%)")
    _legend(top, spec["legend"]["completed"])
    top.grid(axis="y", alpha=0.3)

    tol, hi = spec["tolerance"], 1.2
    for status in ORDER:
        pts = [(x, r["ratio"]) for x, r in zip(xs, rows)
               if r["ratio"] is not None and r["status"] == status]
        if not pts:
            continue
        med = [m for _, (m, _, _) in pts]
        err = [[m - lo for _, (m, lo, _) in pts], [h - m for _, (m, _, h) in pts]]
        hi = max(hi, *(h * 1.08 for _, (_, _, h) in pts))
        bottom.errorbar([x for x, _ in pts], med, yerr=err, fmt="o", ms=7, capsize=6,
                        color=COLORS.get(status, COLORS["line"]), label=ratio_label(status))
    bottom.axhline(1.0, color=COLORS["line"], lw=1, ls="--", label=EQUAL_LABEL)
    bottom.axhline(tol, color=COLORS[abstats.FAIL], lw=1, ls=":",
                   label=tolerance_label(tol))
    lo_lim = min([0.8, tol - 0.05] + [r["ratio"][1] * 0.95 for r in rows if r["ratio"]])
    bottom.set_ylim(lo_lim, hi)
    for x, r in zip(xs, rows):
        y = r["ratio"][2] if r["ratio"] else 1.0
        text = " ".join(r["marks"]) if r["ratio"] else " ".join(["n/a"] + r["marks"])
        if text:
            bottom.annotate(text, (x, y), xytext=(0, 8), textcoords="offset points",
                            ha="center", fontsize=8, fontweight="bold",
                            color=COLORS[abstats.FAIL] if "FAIL" in r["marks"]
                            else COLORS[abstats.INCONCLUSIVE] if r["marks"] else "black")
    bottom.set_ylabel("throughput B/A")
    _legend(bottom, spec["legend"]["throughput"])
    bottom.grid(axis="y", alpha=0.3)
    bottom.set_xticks(xs, [r["xlabel"] for r in rows], fontsize=8)
    bottom.set_xlim(-0.6, len(rows) - 0.4)
    return fig


def _legend(ax, labels: list[str]) -> None:
    """A legend right of the panel, in the order of ``labels`` (every one drawn)."""
    handles = dict(zip(*reversed(ax.get_legend_handles_labels())))
    ax.legend([handles[lab] for lab in labels], labels, loc="upper left",
              bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)


def write_png(report: dict, path: str | Path) -> Path | None:
    """The chart as a PNG at ``path``; None (nothing written) without matplotlib."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return None
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure(chart_spec(report)).savefig(path)
    return path
