"""Exact instruction counts of one region of Python code, with valgrind's callgrind.

Shared by ``bench_scheduler.py``, ``bench_allocator.py`` (``--instructions``) and
``bench_engine.py``, which also names where a region's instructions go by Python function
(the marks at the end of this file).

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
def start(argv: list[str], out_file: str, env: dict | None = None,
          options: list[str] = ()) -> subprocess.Popen:
    """Start ``python argv...`` under callgrind (with extra callgrind ``options``);
    profiles go to ``out_file.N``."""
    cmd = ["valgrind", "--tool=callgrind", "--instr-atstart=no", "--collect-atstart=no",
           f"--toggle-collect={TOGGLE}", f"--dump-after={TOGGLE}", "--dump-instr=no",
           "--compress-strings=no", "--compress-pos=no", *options,
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


# --------------------------------------------------------- where a region's Ir go, by function
# Callgrind sees C functions only: on CPython 3.11 a Python function is no C function of its
# own (Python-to-Python calls run inside one ``_PyEval_EvalFrameDefault``). So a child that
# wants its Python functions named routes each through a C function of its own, built here:
# ``kvgmark_<i>`` calls its first argument with the rest. :func:`mark_functions` swaps each
# chosen function's code for a trampoline ``return kvgmark_<i>(original, *a, **k)`` (the
# function object stays the same, so every reference to it, bound methods and closures
# included, goes through the mark). Started with :data:`MARK_OPTIONS`, callgrind names each
# mark's context by its callers, so :func:`marked_costs` finds each call's nearest marked
# caller and splits a function's inclusive instructions into its own (self) and its marked
# callees'. A mark costs its caller a C call and the trampoline (~100 instructions): an
# attribution, not a count of record.
MARKS = 512
MARK_OPTIONS = ["--separate-callers40=kvgmark_*"]
_MARK_C = """#include <Python.h>
{fns}
static PyMethodDef methods[] = {{
{table}
    {{NULL, NULL, 0, NULL}}
}};
static struct PyModuleDef mod = {{PyModuleDef_HEAD_INIT, "kvgmark", NULL, -1, methods}};
PyMODINIT_FUNC PyInit_kvgmark(void) {{ return PyModule_Create(&mod); }}
"""


def build_marks(directory: str):
    """The ``kvgmark`` extension (compiled with the system's cc into ``directory``)."""
    import importlib.util
    import sysconfig

    fns = "\n".join(
        f"static PyObject *kvgmark_{i}(PyObject *m, PyObject *const *a, Py_ssize_t n, "
        f"PyObject *kw) {{ return PyObject_Vectorcall(a[0], a + 1, "
        f"PyVectorcall_NARGS(n) - 1, kw); }}" for i in range(MARKS))
    table = "\n".join(f'    {{"m{i}", (PyCFunction)(void (*)(void))kvgmark_{i}, '
                      f'METH_FASTCALL | METH_KEYWORDS, NULL}},' for i in range(MARKS))
    src, lib = os.path.join(directory, "kvgmark.c"), os.path.join(directory, "kvgmark.so")
    with open(src, "w") as fh:
        fh.write(_MARK_C.format(fns=fns, table=table))
    # -fno-ipa-icf: identical functions must stay distinct symbols
    subprocess.run(["cc", "-shared", "-fPIC", "-O1", "-fno-ipa-icf",
                    "-I", sysconfig.get_paths()["include"], "-o", lib, src], check=True)
    spec = importlib.util.spec_from_file_location("kvgmark", lib)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def called_functions(run, keep) -> list:
    """The Python functions whose code object ``keep(code)`` accepts and ``run()`` calls
    (a profiling pass: run it outside any counted region)."""
    import gc
    import types

    codes: set = set()

    def prof(frame, event, arg):
        if event == "call" and keep(frame.f_code):
            codes.add(frame.f_code)
    sys.setprofile(prof)
    try:
        run()
    finally:
        sys.setprofile(None)
    flags = 0x20 | 0x80 | 0x200            # generators and coroutines: run outside a call
    frozen = gc.get_freeze_count()         # vLLM freezes what its start-up built
    gc.unfreeze()
    try:
        return [f for f in gc.get_objects() if isinstance(f, types.FunctionType)
                and f.__code__ in codes and not f.__code__.co_flags & flags]
    finally:
        if frozen:
            gc.freeze()


def label_of(fn) -> str:
    """``file.py:qualname``, with the str and function names a closure holds (which
    patch a shared wrapper belongs to)."""
    name = f"{os.path.basename(fn.__code__.co_filename)}:{fn.__qualname__}"
    cells = []
    for cell in fn.__closure__ or ():
        try:
            v = cell.cell_contents
        except ValueError:
            continue
        if isinstance(v, str) and len(v) < 40:
            cells.append(v)
        elif callable(v) and hasattr(v, "__qualname__") and not isinstance(v, type):
            cells.append(v.__qualname__)
    return name + (f"[{', '.join(cells)}]" if cells else "")


_used = [0]                # marks handed out in this process


def mark_functions(marks, fns: dict) -> dict:
    """Route each function of ``fns`` {label: function} through its own ``kvgmark_<i>``;
    returns {"kvgmark_<i>": label}. Functions whose code cannot be swapped are left."""
    import types
    import warnings

    names = {}
    for label, fn in fns.items():
        i = _used[0]
        if i >= MARKS:
            break
        code = fn.__code__
        free = code.co_freevars
        src = "def _outer():\n" + "".join(f"    {v} = None\n" for v in free)
        src += "    def _t(*a, **k):\n"
        if free:
            src += f"        if a is None: ({', '.join(free)},)\n"
        src += "        return '\\0M'('\\0O', *a, **k)\n    return _t\n"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            outer = compile(src, code.co_filename, "exec").co_consts[0]
        t = next(c for c in outer.co_consts if isinstance(c, types.CodeType))
        if t.co_freevars != free:
            continue
        orig = types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__,
                                  fn.__closure__)
        orig.__kwdefaults__ = fn.__kwdefaults__
        mark = getattr(marks, f"m{i}")
        consts = tuple(mark if c == "\0M" else orig if c == "\0O" else c for c in t.co_consts)
        fn.__code__ = t.replace(co_consts=consts, co_name=code.co_name,
                                co_qualname=code.co_qualname)
        names[f"kvgmark_{i}"] = label
        _used[0] += 1
    return names


_MARK_NAME = re.compile(r"^kvgmark_\d+$")


def marked_costs(profile: str, names: dict, c_groups: dict | None = None) -> dict:
    """{label: {"calls", "incl", "self", "out"}} from one profile of a child started with
    :data:`MARK_OPTIONS`: ``incl`` the instructions of the outermost calls (recursion
    counted once), ``self`` minus what its marked callees took, ``out`` the marked calls
    it made (see :func:`overhead`). ``c_groups`` {label:
    regex}: also the summed self instructions of the C functions each regex matches
    (``calls`` and ``incl`` 0 there)."""
    incl: dict = {}       # context name -> inclusive Ir (its cost lines + its calls)
    own: dict = {}        # function name -> self Ir (cost lines not of a call)
    calls: dict = {}      # context name -> calls into it
    fn = None
    pending = None        # the cfn of a "calls=" line whose cost line follows
    with open(profile) as fh:
        for line in fh:
            if line.startswith("fn="):
                fn = line[3:].strip()
                incl.setdefault(fn, 0)
            elif line.startswith("cfn="):
                pending = line[4:].strip()
            elif line.startswith("calls="):
                calls[pending] = calls.get(pending, 0) + int(line[6:].split()[0])
                pending = True
            elif line[:1].isdigit() or line[:1] in "+-*":
                parts = line.split()
                if fn is not None and len(parts) >= 2:
                    incl[fn] += int(parts[1])
                    if pending is not True:
                        own[fn] = own.get(fn, 0) + int(parts[1])
                    pending = None
    out: dict = {}
    for ctx, cost in incl.items():
        chain = [p for p in ctx.split("'") if not p.isdigit()]
        if not _MARK_NAME.match(chain[0]) or chain[0] not in names:
            continue
        me = chain[0]
        parent = next((p for p in chain[1:] if _MARK_NAME.match(p)), None)
        row = out.setdefault(names[me], {"calls": 0, "incl": 0, "self": 0, "out": 0})
        row["calls"] += calls.get(ctx, 0)
        row["self"] += cost
        if me not in chain[1:]:
            row["incl"] += cost                      # outermost: no recursion above it
        if parent in names:
            prow = out.setdefault(names[parent], {"calls": 0, "incl": 0, "self": 0, "out": 0})
            prow["self"] -= cost
            prow["out"] += calls.get(ctx, 0)         # marked calls it made
    for label, rx in (c_groups or {}).items():
        pat = re.compile(rx)
        out[label] = {"calls": 0, "incl": 0, "out": 0,
                      "self": sum(v for k, v in own.items() if pat.search(k.split("'")[0]))}
    return out


def _empty():
    pass


def _loop_marked(n):
    for _ in range(n):
        _empty()


def _loop_plain(n):
    for _ in range(n):
        _plain()


def _plain():
    pass


def overhead_region(marks, n: int = 2000):
    """A region that calibrates the marks: ``(run, names)``; run it as its own region and
    pass its profile to :func:`overhead`."""
    names = mark_functions(marks, {"_empty": _empty, "_loop_marked": _loop_marked,
                                   "_loop_plain": _loop_plain})

    def run():
        _loop_marked(n)
        _loop_plain(n)
    return run, names


def overhead(profile: str, names: dict) -> tuple[float, float]:
    """(inside, outside): what one marked call adds inside its mark (the callee's self)
    and around it (its caller's self), from :func:`overhead_region`'s profile."""
    c = marked_costs(profile, names)
    n = c["_empty"]["calls"]
    total = (c["_loop_marked"]["incl"] - c["_loop_plain"]["incl"]) / n
    inside = c["_empty"]["self"] / n
    return inside, total - inside


def corrected(costs: dict, inside: float, outside: float) -> dict:
    """``self`` less the marks' own cost: ``inside`` per call, ``outside`` per marked call
    made."""
    return {k: dict(v, self=v["self"] - v["calls"] * inside - v["out"] * outside)
            for k, v in costs.items()}
