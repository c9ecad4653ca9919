"""What ``kvguard-ab`` writes: the side-by-side text table, the JSON file and a PNG chart.

The chart is drawn without matplotlib (zlib + struct and a 5x7 bitmap font), so the tool
needs nothing beyond vLLM and the plugin on a fresh machine.
"""
from __future__ import annotations

import json
import math
import struct
import zlib
from pathlib import Path
from typing import Any

from vllm_kvguard.tools import abstats
from vllm_kvguard.tools.abstats import FAIL, NA

# ---------------------------------------------------------------------------- text table
COLUMNS = ("scenario", "side", "plugin", "startup s", "done/failed/aborted", "died",
           "leaked", "faults", "tok/s (spread)", "B/A tok/s [min-max]", "parity",
           "rollbacks", "fallbacks", "cudagraph")


MP_NA = "n/a (mp)"   # --multiprocess: the CUDA-graph audit object stays in the worker


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


def side_row(sc: dict, key: str) -> list[str]:
    side = sc["sides"][key]
    t = side.get("totals") or {}
    died = "HUNG" if side.get("hung") else "YES" if side.get("engine_died") else "no"
    if side.get("startup_failed"):
        died = "NO START"
    lk = abstats.leaked(side)
    thr = abstats.summarize([v for v in side.get("tok_s") or () if v is not None])
    tok = "-" if thr["median"] is None else (
        f"{thr['median']:.0f} ({thr['spread_pct']:.0f}%)" if thr["n"] > 1
        else f"{thr['median']:.0f}")
    row = [sc["name"] if key == "A" else "", key, side.get("label", ""),
           _num(side.get("startup_s")),
           f"{t.get('completed', 0)}/{t.get('failed', 0)}/{t.get('aborted', 0)}"
           + (f" of {t['submitted']}" if t.get("submitted") else ""),
           died, "-" if lk is None else str(lk),
           str(side["faults_injected"]) if side.get("faults_injected") else "-", tok]
    if key == "A":
        return row + [""] * 5
    th, par = sc["throughput"], sc["parity"]
    ratio = "n/a" if th.get("ratio_median") is None else (
        f"{th['ratio_median']:.3f} [{th['ratio_min']:.2f}-{th['ratio_max']:.2f}]")
    if par["status"] == NA:
        par_cell = "n/a"
    else:
        par_cell = f"{par['identical']}/{par['compared']}" + (
            " =ref" if par["against"] == "reference" else "") + (
            " MISMATCH" if par["status"] == FAIL else "")
    plugin_on = bool(side.get("patches")) or side.get("engine_core_separate")
    counters = side.get("counters")
    fallbacks = str(abstats.counter_total(counters, "fallback"))
    return row + [ratio, par_cell, rollbacks_cell(side) if plugin_on else "-",
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
                    f"{s.get('repeat')} fresh A/B process pairs per scenario, tolerance "
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
        if isinstance(res.get("ratio"), (int, float)):
            cell = f"{res['ratio']:.3f} ({res.get('meaning', 'B/A')}; {res.get('detail', '')})"
        else:
            cell = f"n/a ({res.get('detail', 'not measured')})"
        lines.append(f"{name} micro-benchmark, this run: {cell}")
    if report.get("interrupted"):
        lines.append("INTERRUPTED: the table shows the scenarios finished before Ctrl-C")
    failed = [f"{sc['name']}: {c['name']}" for sc in report["scenarios"]
              for c in sc["checks"] if c["status"] == FAIL]
    unsure = [f"{sc['name']}: {c['name']}" for sc in report["scenarios"]
              for c in sc["checks"] if c["status"] == abstats.INCONCLUSIVE]
    lines.append("verdict: " + ("PASS" if not failed and not report.get("interrupted")
                                else "FAIL (" + "; ".join(failed) + ")" if failed
                                else "INCOMPLETE")
                 + (f"; inconclusive, re-run with a larger --repeat: {'; '.join(unsure)}"
                    if unsure else ""))
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


# ---------------------------------------------------------------------------- JSON
def write_json(report: dict, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1, sort_keys=False) + "\n")
    return path


# ---------------------------------------------------------------------------- PNG
# 5x7 glyphs, column-major, bit 0 = top row (the classic glcdfont layout).
_FONT = {
    "0": (0x3E, 0x51, 0x49, 0x45, 0x3E), "1": (0x00, 0x42, 0x7F, 0x40, 0x00),
    "2": (0x42, 0x61, 0x51, 0x49, 0x46), "3": (0x21, 0x41, 0x45, 0x4B, 0x31),
    "4": (0x18, 0x14, 0x12, 0x7F, 0x10), "5": (0x27, 0x45, 0x45, 0x45, 0x39),
    "6": (0x3C, 0x4A, 0x49, 0x49, 0x30), "7": (0x01, 0x71, 0x09, 0x05, 0x03),
    "8": (0x36, 0x49, 0x49, 0x49, 0x36), "9": (0x06, 0x49, 0x49, 0x29, 0x1E),
    "A": (0x7E, 0x11, 0x11, 0x11, 0x7E), "B": (0x7F, 0x49, 0x49, 0x49, 0x36),
    "C": (0x3E, 0x41, 0x41, 0x41, 0x22), "D": (0x7F, 0x41, 0x41, 0x22, 0x1C),
    "E": (0x7F, 0x49, 0x49, 0x49, 0x41), "F": (0x7F, 0x09, 0x09, 0x09, 0x01),
    "G": (0x3E, 0x41, 0x49, 0x49, 0x7A), "H": (0x7F, 0x08, 0x08, 0x08, 0x7F),
    "I": (0x00, 0x41, 0x7F, 0x41, 0x00), "J": (0x20, 0x40, 0x41, 0x3F, 0x01),
    "K": (0x7F, 0x08, 0x14, 0x22, 0x41), "L": (0x7F, 0x40, 0x40, 0x40, 0x40),
    "M": (0x7F, 0x02, 0x0C, 0x02, 0x7F), "N": (0x7F, 0x04, 0x08, 0x10, 0x7F),
    "O": (0x3E, 0x41, 0x41, 0x41, 0x3E), "P": (0x7F, 0x09, 0x09, 0x09, 0x06),
    "Q": (0x3E, 0x41, 0x51, 0x21, 0x5E), "R": (0x7F, 0x09, 0x19, 0x29, 0x46),
    "S": (0x46, 0x49, 0x49, 0x49, 0x31), "T": (0x01, 0x01, 0x7F, 0x01, 0x01),
    "U": (0x3F, 0x40, 0x40, 0x40, 0x3F), "V": (0x1F, 0x20, 0x40, 0x20, 0x1F),
    "W": (0x3F, 0x40, 0x38, 0x40, 0x3F), "X": (0x63, 0x14, 0x08, 0x14, 0x63),
    "Y": (0x07, 0x08, 0x70, 0x08, 0x07), "Z": (0x61, 0x51, 0x49, 0x45, 0x43),
    ".": (0x00, 0x60, 0x60, 0x00, 0x00), "-": (0x08, 0x08, 0x08, 0x08, 0x08),
    "/": (0x20, 0x10, 0x08, 0x04, 0x02), ":": (0x00, 0x36, 0x36, 0x00, 0x00),
    "%": (0x23, 0x13, 0x08, 0x64, 0x62), "(": (0x00, 0x1C, 0x22, 0x41, 0x00),
    ")": (0x00, 0x41, 0x22, 0x1C, 0x00), "[": (0x00, 0x7F, 0x41, 0x41, 0x00),
    "]": (0x00, 0x41, 0x41, 0x7F, 0x00), "=": (0x14, 0x14, 0x14, 0x14, 0x14),
    "+": (0x08, 0x08, 0x3E, 0x08, 0x08), ",": (0x00, 0x50, 0x30, 0x00, 0x00),
    "<": (0x08, 0x14, 0x22, 0x41, 0x00), ">": (0x00, 0x41, 0x22, 0x14, 0x08),
    "_": (0x40, 0x40, 0x40, 0x40, 0x40), "?": (0x02, 0x01, 0x51, 0x09, 0x06),
    ";": (0x00, 0x56, 0x36, 0x00, 0x00), "*": (0x14, 0x08, 0x3E, 0x08, 0x14),
    " ": (0, 0, 0, 0, 0),
}

WHITE, BLACK, GRAY = (255, 255, 255), (30, 30, 30), (150, 150, 150)
LIGHT, BLUE, RED, GREEN = (225, 225, 225), (45, 110, 200), (210, 40, 40), (40, 150, 60)


class Canvas:
    """An RGB pixel buffer with just what a bar chart needs."""

    def __init__(self, width: int, height: int, bg=WHITE):
        self.w, self.h = width, height
        self.px = bytearray(bytes(bg) * (width * height))

    def rect(self, x0: int, y0: int, x1: int, y1: int, color) -> None:
        x0, x1 = sorted((max(0, min(self.w, int(x0))), max(0, min(self.w, int(x1)))))
        y0, y1 = sorted((max(0, min(self.h, int(y0))), max(0, min(self.h, int(y1)))))
        row = bytes(color) * (x1 - x0)
        for y in range(y0, y1):
            i = (y * self.w + x0) * 3
            self.px[i:i + len(row)] = row

    def text(self, x: int, y: int, s: str, color=BLACK, scale: int = 2) -> int:
        """Draw ``s`` with its top-left at (x, y); return the x after it."""
        for ch in s.upper():
            cols = _FONT.get(ch, _FONT["?"])
            for cx, bits in enumerate(cols):
                for cy in range(7):
                    if bits >> cy & 1:
                        self.rect(x + cx * scale, y + cy * scale,
                                  x + (cx + 1) * scale, y + (cy + 1) * scale, color)
            x += 6 * scale
        return x

    @staticmethod
    def text_width(s: str, scale: int = 2) -> int:
        return 6 * scale * len(s)

    def png(self) -> bytes:
        raw = b"".join(b"\x00" + bytes(self.px[y * self.w * 3:(y + 1) * self.w * 3])
                       for y in range(self.h))

        def chunk(kind: bytes, data: bytes) -> bytes:
            return (struct.pack(">I", len(data)) + kind + data
                    + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))

        return (b"\x89PNG\r\n\x1a\n"
                + chunk(b"IHDR", struct.pack(">IIBBBBB", self.w, self.h, 8, 2, 0, 0, 0))
                + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))


def _panel(cv: Canvas, top: int, height: int, title: str, groups: list[dict],
           ymax: float, lines: tuple = ()) -> None:
    """Grouped bars: each group has ``bars`` [(value|None, color, label)], a ``name`` and
    optional ``whiskers`` {bar index: (lo, hi)}. ``lines``: (value, color) guides."""
    left, right = 70, cv.w - 20
    cv.text(left, top, title, scale=2)
    y0, y1 = top + 30, top + height - 40             # plot area
    def ypos(v: float) -> int:
        return int(y1 - (y1 - y0) * max(0.0, min(v, ymax)) / ymax)
    step = next(st for st in (0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 25, 50, 100, 1e9)
                if ymax / st <= 6)
    for k in range(int(ymax / step + 1e-9) + 1):
        v = k * step
        cv.rect(left, ypos(v), right, ypos(v) + 1, LIGHT)
        label = f"{v:.2f}" if step < 1 else f"{v:.0f}"
        cv.text(left - 8 - cv.text_width(label, 1), ypos(v) - 3, label, GRAY, 1)
    for v, color in lines:
        for x in range(left, right, 8):
            cv.rect(x, ypos(v), x + 5, ypos(v) + 2, color)
    slot = (right - left) / max(1, len(groups))
    for g, group in enumerate(groups):
        gx = left + g * slot
        nb = len(group["bars"])
        bw = min(40, slot * 0.7 / nb)
        start = gx + (slot - bw * nb) / 2
        for i, (val, color, label) in enumerate(group["bars"]):
            x0 = start + i * bw
            if val is not None:
                cv.rect(x0 + 2, ypos(val), x0 + bw - 2, y1, color)
            lo_hi = group.get("whiskers", {}).get(i)
            if lo_hi:
                xm = int(x0 + bw / 2)
                cv.rect(xm - 1, ypos(lo_hi[1]), xm + 1, ypos(lo_hi[0]) + 1, BLACK)
                cv.rect(xm - 5, ypos(lo_hi[1]), xm + 6, ypos(lo_hi[1]) + 2, BLACK)
                cv.rect(xm - 5, ypos(lo_hi[0]), xm + 6, ypos(lo_hi[0]) + 2, BLACK)
            top_y = ypos(val if val is not None else 0) - 12
            if lo_hi:
                top_y = min(top_y, ypos(lo_hi[1]) - 12)
            cv.text(int(x0 + bw / 2 - cv.text_width(label, 1) / 2), top_y, label,
                    RED if val is None else BLACK, 1)
        name = group["name"]
        cv.text(int(gx + slot / 2 - cv.text_width(name, 1) / 2), y1 + 8, name, BLACK, 1)
    cv.rect(left, y1, right, y1 + 1, BLACK)


def chart(report: dict) -> Canvas:
    """Top: requests completed (%) by A and B. Bottom: throughput B/A with min-max."""
    scs = report["scenarios"]
    cv = Canvas(max(760, 150 * len(scs) + 100), 560)
    cv.text(20, 12, "KVGUARD-AB: A = PLUGIN OFF (GRAY), B = PLUGIN ON (BLUE)", scale=2)
    groups = []
    for sc in scs:
        bars = []
        for key, color in (("A", GRAY), ("B", BLUE)):
            side = sc["sides"][key]
            t = side.get("totals") or {}
            pct = 100.0 * t.get("completed", 0) / t["submitted"] if t.get("submitted") else 0.0
            dead = side.get("engine_died") or side.get("hung") or side.get("startup_failed")
            label = "DIED" if dead and not pct else f"{pct:.0f}%"
            bars.append((None if dead and not pct else pct, color, label))
        groups.append({"name": sc["name"], "bars": bars})
    _panel(cv, 40, 250, "REQUESTS COMPLETED (%)", groups, 100.0)
    groups, hi = [], 1.2
    tol = report.get("settings", {}).get("tolerance", 0.97)
    for sc in scs:
        th = sc["throughput"]
        med = th.get("ratio_median")
        if med is None:
            groups.append({"name": sc["name"], "bars": [(None, BLUE, "N/A")]})
            continue
        hi = max(hi, math.ceil(th["ratio_max"] * 1.1 * 4) / 4)
        color = GREEN if med >= tol else RED
        groups.append({"name": sc["name"], "bars": [(med, color, f"{med:.3f}")],
                       "whiskers": {0: (th["ratio_min"], th["ratio_max"])}})
    _panel(cv, 300, 250, f"THROUGHPUT B/A (MEDIAN, MIN-MAX; TOLERANCE {tol})", groups, hi,
           lines=((1.0, GRAY), (tol, RED)))
    return cv


def write_png(report: dict, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(chart(report).png())
    return path


def load(path: str | Path) -> dict[str, Any]:
    return json.loads(Path(path).read_text())
