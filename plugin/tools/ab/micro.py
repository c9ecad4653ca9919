"""The micro-benchmarks ``kvguard-ab`` runs beside its scenarios, read back as one ratio each.

``instructions``: ``benchmarks/bench_allocator.py --per-call`` counts with valgrind's
callgrind the instructions of one decode-shaped ``allocate_slots`` call through vLLM's
method and through the plugin's transaction: deterministic (a second run gives the same
count within a few instructions), so it is the cost figure a second run repeats, where the
wall-clock ratios of the scenarios on a shared machine may not resolve their tolerance. It
runs single-threaded from the start of the run, on the CPU the engines leave idle between
their alternating rounds (:func:`start`, :func:`finish`). ``dispatch``:
``benchmarks/bench_dispatch.py`` times the CUDA-graph fallback accounting on vLLM's
dispatchers. Both exist in a source checkout only; from an installed wheel they are n/a.
"""
from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parents[3] / "benchmarks"   # in a source checkout

# name: (script, quick arguments, parser of the script's output)
_PER_CALL = re.compile(r"vLLM ([\d,]+) Ir/call; through a pass-through \+([\d,]+) .*?through "
                       r"the transaction \+([\d,]+) Ir/call")
_ALLOC_LINE = re.compile(r"allocator patch throughput ratio ([0-9.]+)(.*)")
_DISPATCH_ROW = re.compile(r"^\s+(\S.*?)\s+(\d+) ns\s+(\d+) ns\s+([+-][0-9.]+)%.*"
                           r"(OK|OVER TARGET)\s*$")


def _parse_allocator(out: str) -> dict:
    m = _ALLOC_LINE.search(out)
    if not m:
        return {}
    return {"ratio": float(m.group(1)), "meaning": "KVCacheManager ops/s, B/A",
            "detail": m.group(0).strip()}


def _parse_per_call(out: str) -> dict:
    m = _PER_CALL.search(out)
    if not m:
        return {}
    base, floor, txn = (int(g.replace(",", "")) for g in m.groups())
    return {"ratio": 1.0 + txn / base, "deterministic": True,
            "meaning": "instructions per decode-shaped allocate_slots call, B/A (callgrind)",
            "detail": f"vLLM {base:,} Ir, with the plugin +{txn:,} Ir ({txn / base:.2%}; "
                      f"a bare pass-through wrapper alone +{floor:,})"}


def _parse_dispatch(out: str) -> dict:
    rows = [(float(m.group(4)), m.group(1)) for m in map(_DISPATCH_ROW.match, out.splitlines())
            if m]
    if not rows:
        return {}
    pct, case = max(rows)
    return {"ratio": 1.0 + pct / 100.0, "meaning": "time per dispatch call, B/A, worst "
            "graphed case", "detail": f"{case}: {pct:+.2f}% (target <= 3%)"}


MICROBENCH = {
    "instructions": ("allocator", ["--per-call", "--layouts", "1"], _parse_per_call),
    "dispatch": ("dispatch", ["--rounds", "5", "--calls", "1000"], _parse_dispatch),
}
EXTRA = {"allocator": ("allocator", ["--rounds", "3"], _parse_allocator)}   # on request


def start(name: str) -> subprocess.Popen | dict:
    """Start ``benchmarks/bench_<script>.py`` (plugin off/on side by side, in one child)
    with quick arguments; a dict (``ratio`` None) when the script is absent."""
    script, args, _ = {**MICROBENCH, **EXTRA}[name]
    path = BENCH_DIR / f"bench_{script}.py"
    if not path.is_file():
        return {"ratio": None, "detail": f"benchmarks/bench_{script}.py not present"}
    return subprocess.Popen([sys.executable, str(path), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=str(BENCH_DIR.parent),
                            start_new_session=True)


def finish(name: str, proc: subprocess.Popen | dict, timeout: float) -> dict:
    """Its summary ``{"ratio", "meaning", "detail"}``; ``ratio`` None when the script is
    absent, timed out or printed no summary (e.g. no valgrind: its one line says why)."""
    if isinstance(proc, dict):
        return proc
    try:
        out, err = proc.communicate(timeout=timeout)
    except BaseException as exc:
        stop(proc)
        if not isinstance(exc, subprocess.TimeoutExpired):
            raise
        return {"ratio": None, "detail": f"timed out after {timeout:.0f} s"}
    found = {**MICROBENCH, **EXTRA}[name][2](out)
    if found:
        return found
    tail = (out.strip().splitlines() + err.strip().splitlines() or ["no output"])[-1]
    return {"ratio": None, "detail": f"no summary line (exit {proc.returncode}): {tail[:120]}"}


def stop(proc: subprocess.Popen | dict) -> None:
    if not isinstance(proc, dict) and proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def microbench(name: str, timeout: float) -> dict:
    """:func:`start` then :func:`finish`."""
    return finish(name, start(name), timeout)
