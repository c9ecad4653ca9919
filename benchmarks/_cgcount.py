"""Exact instruction counts of one region of Python code, with valgrind's callgrind.

Shared by ``bench_scheduler.py`` and ``bench_allocator.py`` (``--instructions``).

How a count is taken
    The benchmark starts a child process of itself under
    ``valgrind --tool=callgrind --instr-atstart=no --collect-atstart=no
    --toggle-collect=_operator_call --dump-after=_operator_call``:

    * ``--instr-atstart=no``: the child's start-up (importing torch and vLLM, ~20 s of
      CPU natively) runs uninstrumented, ~5x instead of ~50x slower;
    * the child builds its objects and warms up, then switches instrumentation on for
      itself (``callgrind_control -i on <pid>``, answered while the child spins, since
      callgrind reads commands only while the client runs code), and off again after
      the region;
    * it then runs each measured region as ``operator.call(region)``. Callgrind counts
      instructions only inside the C function ``_operator_call`` (``--toggle-collect``),
      which vLLM and the plugin do not call (a nested call would be harmless: callgrind
      names it ``_operator_call'2`` and neither toggles nor dumps on it), and writes
      one profile per region on its exit (``--dump-after``): ``<out>.1``, ``<out>.2``,
      ... Each holds the instructions executed (``Ir``) by that region and nothing else.

Why the count is exact, and why one count is not enough
    Callgrind counts every guest instruction executed, independent of load on the
    machine, CPU frequency and caches. The child runs with ``PYTHONHASHSEED=0`` and a
    seeded workload, so a repeat of the same child gives the same number. What remains
    is the program's own behaviour, and there the heap's layout matters: where objects
    land decides dict probe lengths, allocator paths and when the garbage collector runs.
    The same code counted after a few extra objects were allocated first differs by up
    to 0.7% on vLLM's scheduler step, as much as a small overhead itself; and a second
    region counted later in the same process sees yet another layout. So each side is
    counted in its own child, once per *layout* (:func:`shift_layout`: N small objects
    allocated before anything else), and sides are compared layout by layout
    (:func:`count_each`).
"""
from __future__ import annotations

import json
import operator
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

#: The C function that brackets a measured region (``operator.call``, Python >= 3.11).
TOGGLE = "_operator_call"


def available() -> str | None:
    """None when counting works here, else why not."""
    if shutil.which("valgrind") is None:
        return "valgrind is not installed (apt-get install valgrind)"
    if shutil.which("callgrind_control") is None:
        return "callgrind_control is not installed (it comes with valgrind)"
    if not hasattr(operator, "call"):
        return "needs Python >= 3.11 (operator.call brackets the measured region)"
    return None


# ------------------------------------------------------------------------ in the child
def instrumentation(on: bool) -> None:
    """Switch callgrind's instrumentation on or off for this process (no-op outside
    valgrind). Counting happens only inside :func:`region` in any case; switching it
    off between regions only saves time (warm-up runs ~5x instead of ~50x slower).

    callgrind_control reaches callgrind through vgdb, which callgrind polls only while
    this process executes code: spin (do not block) until it answers."""
    if not os.environ.get("KVGUARD_BENCH_UNDER_CALLGRIND"):
        return
    proc = subprocess.Popen(["callgrind_control", "-i", "on" if on else "off",
                             str(os.getpid())],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    n = 0
    while proc.poll() is None:
        n += sum(range(64))                      # run code so callgrind sees the command
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("callgrind_control did not answer")
    out = proc.stdout.read().decode(errors="replace")
    if proc.returncode != 0 or "OK" not in out:
        raise RuntimeError(f"callgrind_control -i {'on' if on else 'off'} failed: "
                           f"{out.strip()}")


def region(fn, *args):
    """Run ``fn(*args)`` as one counted region (one ``<out>.N`` profile), with
    instrumentation on for it only."""
    instrumentation(True)
    try:
        return operator.call(fn, *args)
    finally:
        instrumentation(False)


# ------------------------------------------------------------------------ in the parent
def start(argv: list[str], out_file: str, env: dict | None = None) -> subprocess.Popen:
    """Start ``python argv...`` under callgrind; profiles go to ``out_file.N``."""
    cmd = ["valgrind", "--tool=callgrind", "--instr-atstart=no", "--collect-atstart=no",
           f"--toggle-collect={TOGGLE}", f"--dump-after={TOGGLE}", "--dump-instr=no",
           "--compress-strings=no", "--compress-pos=no",
           f"--callgrind-out-file={out_file}", sys.executable, *argv]
    child_env = dict(os.environ if env is None else env)
    child_env["PYTHONHASHSEED"] = "0"
    child_env["KVGUARD_BENCH_UNDER_CALLGRIND"] = "1"
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=child_env, text=True)


# A part's own cost is its ``totals:`` line (the sum of its cost lines); its ``summary:``
# line is not usable once instrumentation was switched off and on (it can even wrap).
_TOTALS = re.compile(r"^totals:\s+(\d+)", re.M)


def region_counts(out_file: str) -> list[int]:
    """Ir of each region, in order, from the ``out_file.N`` profiles of one child."""
    counts, n = [], 1
    while os.path.exists(f"{out_file}.{n}"):
        with open(f"{out_file}.{n}") as fh:
            text = fh.read()
        m = _TOTALS.search(text)
        if m is None:
            raise RuntimeError(f"no totals line in {out_file}.{n}")
        counts.append(int(m.group(1)))
        n += 1
    return counts


def finish(proc: subprocess.Popen, out_file: str, what: str):
    """Wait for a child started by :func:`start`; return (its JSON result, region Ir)."""
    stdout, stderr = proc.communicate()
    if proc.returncode != 0:
        tail = "\n".join([line for line in stderr.splitlines()
                          if not line.startswith("==")][-15:])
        raise RuntimeError(f"callgrind child {what} failed (exit {proc.returncode}):\n{tail}")
    result = None
    for line in stdout.splitlines():
        if line.startswith("KVGUARD_BENCH_RESULT "):
            result = json.loads(line[len("KVGUARD_BENCH_RESULT "):])
    if result is None:
        raise RuntimeError(f"callgrind child {what} printed no result")
    counts = region_counts(out_file)
    if len(counts) != result.get("regions", len(counts)):
        raise RuntimeError(f"callgrind child {what}: {len(counts)} profiles for "
                           f"{result.get('regions')} regions (is {TOGGLE} a visible symbol "
                           f"of this Python?)")
    if any(c == 0 for c in counts):
        raise RuntimeError(f"callgrind child {what}: a region counted 0 instructions "
                           f"(is {TOGGLE} a visible symbol of this Python?)")
    return result, counts


def emit(result: dict) -> None:
    """The child's result line, read by :func:`finish`; then the child ends at once
    (interpreter teardown under valgrind takes a minute and measures nothing)."""
    print("KVGUARD_BENCH_RESULT " + json.dumps(result), flush=True)
    sys.stderr.flush()
    os._exit(0)


#: Layout shifts (objects allocated before the run) the benchmarks count each side under.
LAYOUTS = (0, 100, 1000, 3333, 7777)
_shift: list = []


def shift_layout(n: int) -> None:
    """Move every later allocation of this process: keep ``n`` small objects alive."""
    _shift[:] = [bytearray(64) for _ in range(n)]


def count_each(argv: list[str], sides: list[str], layouts, parallel: int = 2) -> dict:
    """Run ``python argv... --child SIDE --layout N`` under callgrind for every side and
    layout, ``parallel`` at a time; each child counts its regions and emits its result.
    Returns {(side, layout): (result, [instructions per region])}."""
    d = tmpdir()
    jobs = [(side, n) for n in layouts for side in sides]
    running, done = [], {}
    try:
        while jobs or running:
            while jobs and len(running) < parallel:
                side, n = jobs.pop(0)
                out = os.path.join(d, f"{side}-{n}.out")
                running.append((side, n, start(argv + ["--child", side, "--layout", str(n)],
                                               out), out))
            side, n, proc, out = running.pop(0)
            result, counts = finish(proc, out, f"{side} (layout {n})")
            done[(side, n)] = (result, counts)
    finally:
        for _side, _n, proc, _out in running:
            proc.kill()
        cleanup(d)
    return done


def tmpdir() -> str:
    return tempfile.mkdtemp(prefix="kvguard-cg-")


def cleanup(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)
