"""The micro-benchmarks ``kvguard-ab`` runs after its scenarios, read back as one ratio each.

``benchmarks/bench_allocator.py`` (the allocator patch on the real ``KVCacheManager``) and
``benchmarks/bench_dispatch.py`` (the CUDA-graph fallback accounting on vLLM's
dispatchers) each compare the plugin off and on inside one child process, which isolates
costs too small for the engine scenarios to resolve. They exist in a source checkout only;
from an installed wheel the result is n/a.
"""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parents[2] / "benchmarks"   # in a source checkout

# name: (quick arguments, what the ratio means, parser of the script's output)
_ALLOC_LINE = re.compile(r"allocator patch throughput ratio ([0-9.]+)(.*)")
_DISPATCH_ROW = re.compile(r"^\s+(\S.*?)\s+(\d+) ns\s+(\d+) ns\s+([+-][0-9.]+)%.*"
                           r"(OK|OVER TARGET)\s*$")


def _parse_allocator(out: str) -> dict:
    m = _ALLOC_LINE.search(out)
    if not m:
        return {}
    return {"ratio": float(m.group(1)), "meaning": "KVCacheManager ops/s, B/A",
            "detail": m.group(0).strip()}


def _parse_dispatch(out: str) -> dict:
    rows = [(float(m.group(4)), m.group(1)) for m in map(_DISPATCH_ROW.match, out.splitlines())
            if m]
    if not rows:
        return {}
    pct, case = max(rows)
    return {"ratio": 1.0 + pct / 100.0, "meaning": "time per dispatch call, B/A, worst "
            "graphed case", "detail": f"{case}: {pct:+.2f}% (target <= 3%)"}


MICROBENCH = {
    "allocator": (["--rounds", "3"], _parse_allocator),
    "dispatch": (["--rounds", "5", "--calls", "1000"], _parse_dispatch),
}


def microbench(name: str, timeout: float) -> dict:
    """Run ``benchmarks/bench_<name>.py`` (plugin off/on side by side, in one child) with
    quick arguments and read its summary: ``{"ratio", "meaning", "detail"}``; ``ratio`` is
    None when the script is absent (an installed wheel) or its summary is missing."""
    path = BENCH_DIR / f"bench_{name}.py"
    if not path.is_file():
        return {"ratio": None, "detail": f"benchmarks/bench_{name}.py not present"}
    args, parse = MICROBENCH[name]
    try:
        res = subprocess.run([sys.executable, str(path), *args], capture_output=True,
                             text=True, timeout=timeout, cwd=str(BENCH_DIR.parent))
    except subprocess.TimeoutExpired:
        return {"ratio": None, "detail": f"timed out after {timeout:.0f} s"}
    found = parse(res.stdout)
    if found:
        return found
    tail = (res.stderr.strip().splitlines() or ["no output"])[-1]
    return {"ratio": None, "detail": f"no summary line (exit {res.returncode}): {tail[:120]}"}
