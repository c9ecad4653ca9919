#!/usr/bin/env python3
"""Run the test suites on every pinned vLLM (``pins.txt``) and print the truth table.

    python3 scripts/matrix.py                    # every pin: unit suite + its integration suite
    python3 scripts/matrix.py --pins 0.27.1,0.33.0
    python3 scripts/matrix.py --default          # the default pin only
    python3 scripts/matrix.py --unit-only
    python3 scripts/matrix.py -- -k allocator    # extra pytest arguments, on every pytest run
    python3 scripts/matrix.py --table            # print the truth table of the last run again
    python3 scripts/matrix.py --conformance all  # vLLM's own tests/v1/core on every pin
    python3 scripts/matrix.py --conformance none # ... on no pin (default: the pins that say
                                                 # conformance=yes in pins.txt)

Per pin, in order: ensure its cached venv (``scripts/venvs.py``), run ``unit_tests/`` in full,
run ``integration_tests/`` (all of it on ``suite=full`` pins, ``-m smoke`` on ``suite=smoke``
ones), then probe what activation does there, then (on the pins marked ``conformance=yes``
in ``pins.txt``; ``--conformance`` overrides) run the conformance stage: vLLM's own
``tests/v1/core`` from the release's sdist, plain and with the plugin
(``scripts/conformance.py``). Results go to
``--results`` (default ``build/matrix/``): ``<pin>/unit.xml``, ``<pin>/integration.xml``
(JUnit), ``<pin>/facts.jsonl`` (facts tests recorded), ``<pin>/probe.json``,
``<pin>/conformance/`` (``conformance.json``, one JUnit file per pass),
``<pin>/timings.json`` and ``matrix.json``.
Prints per-pin timings, the truth table, and a closing ``matrix: N passed, N failed, N
skipped`` line. Exits 0 only if every pin's venv built and every suite passed (a suite that
selects no test counts as passed and is said so).

Standard library only.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import venvs as pinned  # noqa: E402  (scripts/venvs.py)


def _load_truth_table():
    """plugin/tools/truth_table.py by path: its result readers are stdlib-only (one JUnit
    reader)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "_kvguard_truth_table",
        Path(__file__).resolve().parent.parent / "plugin" / "tools" / "truth_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


truth_table = _load_truth_table()

REPO = pinned.REPO
#: A test without its own @pytest.mark.timeout still cannot eat the CI budget.
DEFAULT_TEST_TIMEOUT = 600
NO_TESTS_COLLECTED = 5
#: The per-pin stages whose result decides the pin's.
STAGES = ("unit", "integration", "probe", "conformance")


def _fmt(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def pytest_cmd(python: str, paths: list[str], junit: Path, marker: str | None,
               extra: list[str]) -> list[str]:
    cmd = [python, "-m", "pytest", *paths, f"--junitxml={junit}", "-o", "junit_family=xunit2",
           f"--timeout={DEFAULT_TEST_TIMEOUT}", "-rfEs", "-q", "-p", "no:cacheprovider",
           "--durations=5"]
    if marker:
        cmd += ["-m", marker]
    return cmd + extra


def run_suite(name: str, cmd: list[str], env: dict) -> dict:
    print(f"\n---- {name}: {' '.join(cmd[1:])}", flush=True)
    t0 = time.monotonic()
    rc = subprocess.call(cmd, cwd=REPO, env=env, stdin=subprocess.DEVNULL)
    secs = round(time.monotonic() - t0, 1)
    ok = rc in (0, NO_TESTS_COLLECTED)
    note = "no tests selected" if rc == NO_TESTS_COLLECTED else ("" if ok else f"pytest exit {rc}")
    return {"ok": ok, "rc": rc, "seconds": secs, "note": note}


def run_pin(pin: pinned.Pin, out: Path, args, venv_future=None) -> dict:
    d = out / pin.name
    d.mkdir(parents=True, exist_ok=True)
    for stale in ("unit.xml", "integration.xml", "facts.jsonl", "probe.json", "timings.json"):
        (d / stale).unlink(missing_ok=True)
    shutil.rmtree(d / "conformance", ignore_errors=True)
    rec: dict = {"pin": pin.name, "requirement": pin.requirement, "ok": True}
    print(f"\n==== vLLM {pin.name} ({pin.requirement})", flush=True)
    try:
        t0 = time.monotonic()
        info = (venv_future.result() if venv_future is not None
                else pinned.ensure(pin, REPO, rebuild=args.rebuild))
        waited = round(time.monotonic() - t0, 1)
        if venv_future is not None:          # never while another pin's tests run
            took = pinned.install_repo(pin, REPO)
            if took is not None:
                info["steps"]["install_repo"] = took
    except (pinned.InstallError, OSError) as exc:
        print(f"matrix: venv for {pin.name} failed: {exc}", file=sys.stderr, flush=True)
        rec.update(ok=False, venv={"ok": False, "error": str(exc)})
        (d / "timings.json").write_text(json.dumps(rec, indent=1))
        return rec
    rec["venv"] = {"ok": True, "built": info["built"], "seconds": info["seconds"],
                   "waited": waited, "steps": info["steps"], "path": info["path"]}
    print(f"venv {'built' if info['built'] else 'reused'} in {_fmt(info['seconds'])} "
          f"(waited {_fmt(waited)}): {info['path']}", flush=True)
    env = {**os.environ,
           "KVGUARD_PIN": pin.name,
           "KVGUARD_CASES": pin.cases,          # testing/cases.py: all, or the core set
           "KVGUARD_FACTS_FILE": str(d / "facts.jsonl"),
           "VLLM_CACHE_ROOT": str(d / "vllm-cache")}   # no cache shared across vLLM versions
    for var in ("KVGUARD", "KVGUARD_PATCHES", "KVGUARD_FORCE", "KVGUARD_FAULTS"):
        env.pop(var, None)                  # tests choose their own flags
    py = info["python"]
    if wants_conformance(pin, args.conformance):     # the unit suite's runner test reads it
        subprocess.call([sys.executable, str(REPO / "scripts" / "conformance.py"), "--pin",
                         pin.name, "--python", py, "--fetch-only"], cwd=REPO, env=env,
                        stdin=subprocess.DEVNULL)

    rec["unit"] = run_suite(f"{pin.name} unit",
                            pytest_cmd(py, ["unit_tests"], d / "unit.xml", None, args.pytest),
                            env)
    suite = args.integration or pin.suite
    if suite != "none":
        rec["integration"] = run_suite(
            f"{pin.name} integration ({suite})",
            pytest_cmd(py, ["integration_tests"], d / "integration.xml",
                       integration_marker(suite, not args.full), args.pytest), env)
        rec["integration"]["suite"] = suite
    t0 = time.monotonic()
    probe = subprocess.run([py, "-m", "vllm_kvguard.tools.truth_table", "probe",
                            "--out", str(d / "probe.json")], cwd=REPO, env=env,
                           stdin=subprocess.DEVNULL, capture_output=True, text=True)
    rec["probe"] = {"ok": probe.returncode == 0, "seconds": round(time.monotonic() - t0, 1)}
    if probe.returncode != 0:
        print(f"matrix: probe on {pin.name} failed:\n{probe.stderr[-2000:]}", file=sys.stderr)
    if wants_conformance(pin, args.conformance):
        rec["conformance"] = run_conformance(pin, py, d / "conformance", env, args.full)
    rec["ok"] = all(rec[k]["ok"] for k in STAGES if k in rec)
    (d / "timings.json").write_text(json.dumps(rec, indent=1))
    return rec


def integration_marker(suite: str, skip_slow: bool) -> str | None:
    """The ``-m`` expression of a pin's integration suite (``skip_slow``: no ``slow``)."""
    marker = "smoke" if suite == "smoke" else None
    if skip_slow:
        marker = f"{marker} and not slow" if marker else "not slow"
    return marker


def wants_conformance(pin: pinned.Pin, choice: str) -> bool:
    """``--conformance``: ``pins`` (the pins marked ``conformance=yes``), ``default`` (the
    default pin only), ``all`` or ``none``."""
    return (choice == "all" or (choice == "default" and pin.default)
            or (choice == "pins" and pin.conformance))


def run_conformance(pin: pinned.Pin, python: str, out: Path, env: dict,
                    full: bool = False) -> dict:
    """The conformance stage (``scripts/conformance.py``, stdlib: runs under this Python);
    passes plain and audit, or (``full``) plain, patched and audit."""
    cmd = [sys.executable, str(REPO / "scripts" / "conformance.py"), "--pin", pin.name,
           "--python", python, "--results", str(out),
           "--passes", "plain,patched,audit" if full else "plain,audit"]
    print(f"\n---- {pin.name} conformance: {' '.join(cmd[1:])}", flush=True)
    t0 = time.monotonic()
    rc = subprocess.call(cmd, cwd=REPO, env=env, stdin=subprocess.DEVNULL)
    secs = round(time.monotonic() - t0, 1)
    note = {0: "", 1: "a vLLM outcome changed or a proof is missing",
            2: "could not run (sdist, venv or test deps)"}.get(rc, f"exit {rc}")
    return {"ok": rc == 0, "rc": rc, "seconds": secs, "note": note}


def timing_table(recs: list[dict], total: float) -> str:
    lines = [f"{'pin':8} {'venv':>16} {'waited':>8} {'unit':>9} {'integration':>18} {'probe':>7}"
             f" {'conformance':>11}  result"]
    for r in recs:
        v = r.get("venv", {})
        venv = ("FAILED" if not v.get("ok") else
                f"{_fmt(v['seconds'])} {'built' if v['built'] else 'reused'}")
        waited = _fmt(v.get("waited"))
        unit = _fmt(r["unit"]["seconds"]) if "unit" in r else "-"
        integ = (f"{_fmt(r['integration']['seconds'])} ({r['integration']['suite']})"
                 if "integration" in r else "-")
        probe = _fmt(r["probe"]["seconds"]) if "probe" in r else "-"
        conf = _fmt(r["conformance"]["seconds"]) if "conformance" in r else "-"
        notes = [f"{k}: {r[k]['note']}" for k in ("unit", "integration", "conformance")
                 if k in r and r[k].get("note")]
        result = ("ok" if r["ok"] else "FAILED") + (f" ({'; '.join(notes)})" if notes else "")
        lines.append(f"{r['pin']:8} {venv:>16} {waited:>8} {unit:>9} {integ:>18} {probe:>7}"
                     f" {conf:>11}  {result}")
    lines.append(f"total {_fmt(total)}")
    return "\n".join(lines)


def totals(out: Path, recs: list[dict]) -> dict[str, int]:
    tot = {"passed": 0, "failed": 0, "skipped": 0}
    for r in recs:
        for suite in ("unit", "integration"):
            if suite not in r:
                continue
            t = truth_table.junit_totals(out / r["pin"] / f"{suite}.xml")
            if t is None:                       # pytest died before writing its report
                tot["failed"] += 0 if r[suite]["ok"] else 1
                continue
            for k in tot:
                tot[k] += t[k]
        if not r.get("venv", {}).get("ok"):
            tot["failed"] += 1                  # a pin whose venv failed is a failure
    return tot


def print_table(python: str, out: Path) -> int:
    return subprocess.call([python, "-m", "vllm_kvguard.tools.truth_table", "--results",
                            str(out)],
                           cwd=REPO, stdin=subprocess.DEVNULL)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sel = ap.add_mutually_exclusive_group()
    sel.add_argument("--pins", help="comma-separated pin names (default: all of pins.txt)")
    sel.add_argument("--default", action="store_true", help="only the default pin")
    ap.add_argument("--unit-only", dest="integration", action="store_const", const="none",
                    default=None, help="skip the integration suites")
    ap.add_argument("--integration", dest="integration", choices=("full", "smoke", "none"),
                    help="override each pin's integration suite")
    ap.add_argument("--results", type=Path,
                    default=Path(os.environ.get("KVGUARD_RESULTS_DIR", REPO / "build" / "matrix")),
                    help="results folder (default: build/matrix, or $KVGUARD_RESULTS_DIR)")
    ap.add_argument("--rebuild", action="store_true", help="rebuild the venvs")
    ap.add_argument("--build-ahead", action="store_true",
                    help="build the next pins' venvs in the background while tests run "
                         "(a fresh CI machine: saves most of the install time)")
    ap.add_argument("--full", action="store_true",
                    help="also the integration tests marked slow (the longest real-server and "
                         "engine configurations) and every conformance pass (plain, patched, "
                         "audit); without it: no slow tests, conformance passes plain and "
                         "audit (the audit pass runs the patched plugin too)")
    ap.add_argument("--conformance", choices=("pins", "default", "all", "none"),
                    default="pins",
                    help="run vLLM's own tests/v1/core plain and with the plugin "
                         "(scripts/conformance.py) on the pins marked conformance=yes in "
                         "pins.txt (pins, the default), on the default pin only, on every "
                         "selected pin, or nowhere")
    ap.add_argument("--table", action="store_true",
                    help="only print the truth table of the last run's results")
    args = ap.parse_args(argv)
    args.pytest = extra
    try:
        pins = pinned.read_pins()
        if args.default:
            pins = [pinned.find_pin("default", pins)]
        elif args.pins:
            pins = [pinned.find_pin(n.strip(), pins) for n in args.pins.split(",") if n.strip()]
    except pinned.PinError as exc:
        print(f"matrix: {exc}", file=sys.stderr)
        return 2

    out = args.results.resolve()
    if args.table:
        ready = [p for p in [pinned.find_pin("default")] + pins if pinned.is_ready(p)]
        if not ready:
            print("matrix: no pin venv is built yet; run scripts/matrix.py first", file=sys.stderr)
            return 2
        return print_table(str(pinned.venv_dir(ready[0]) / "bin" / "python"), out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    recs = []
    builder = futures = None
    if args.build_ahead:       # one builder thread: the next pin's venv builds during tests
        builder = concurrent.futures.ThreadPoolExecutor(max_workers=1)
        futures = [builder.submit(pinned.ensure, pin, REPO, args.rebuild, with_repo=False)
                   for pin in pins]
    for i, pin in enumerate(pins):
        recs.append(run_pin(pin, out, args, futures[i] if futures else None))
        (out / "matrix.json").write_text(json.dumps(
            {"pins": [r["pin"] for r in recs], "runs": recs}, indent=1))
    total = time.monotonic() - t0
    if builder is not None:
        builder.shutdown()

    print("\n==== per-pin timings")
    print(timing_table(recs, total))
    table_python = next((r["venv"]["path"] + "/bin/python" for r in recs
                         if r.get("venv", {}).get("ok")), None)
    if table_python:
        print("\n==== truth table (python -m vllm_kvguard.tools.truth_table)", flush=True)
        print_table(table_python, out)
    ok = all(r["ok"] for r in recs)
    t = totals(out, recs)
    print(f"\nmatrix: {t['passed']} passed, {t['failed']} failed, {t['skipped']} skipped",
          flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
