#!/usr/bin/env python3
"""Conformance: vLLM's own ``tests/v1/core`` passes identically with the plugin.

    python3 scripts/conformance.py                       # the default pin
    python3 scripts/conformance.py --pin 0.29.0
    python3 scripts/conformance.py --python VENV/bin/python --results DIR
    python3 scripts/conformance.py -- -k prefix          # extra pytest arguments (every pass)

For one pin of ``pins.txt``: fetch that release's sdist once (``pip download``; cached in
``<venv root>/sdists/``, beside the pin venvs), unpack its ``tests/`` into a temporary run
folder (nothing is vendored into this repository) and run ``tests/v1/core`` in the pin's
venv three times:

* ``plain``: vLLM alone (``KVGUARD`` unset);
* ``patched``: ``KVGUARD=1`` and ``vllm.plugins.load_general_plugins()`` at session start,
  as vLLM itself loads the plugin;
* ``audit``: the same with ``KVGUARD_AUDIT=1`` (the pool's invariants after every step).

Each pass loads two pytest plugins of ``scripts/``: ``conformance_platform.py`` (the
test-only CPU platform choice that lets a CUDA wheel's pure-Python pin run vLLM's
scheduler-level tests; the same in every pass), then ``conformance_plugin.py``, which
writes config-only local models with a stand-in tokenizer under the Hugging Face ids
the tests name (into an offline Hugging Face cache inside the run, so nothing downloads),
keeps vLLM's caches (its model-inspection cache among them) inside the run, and records
per test its outcome, the ``allocate_slots`` calls that went through the plugin's
transaction and any audit violation. The files that start a real engine on a downloaded
model are left out (``conformance_runner.EXCLUDE``). Every test gets vLLM's own
``skip_global_cleanup`` marker (its per-test gc and distributed teardown, meant to be
skipped for CPU unit tests; ``--global-cleanup`` keeps it), in every pass alike. The
passes run at once, one per CPU (``--jobs``), each with its own vLLM cache folder.

A patched pass must prove the plugin was in place: the allocator applied, its wrapper on
``KVCacheManager.allocate_slots``, transactions run, no patch tripped and no internal
error counted. A test that passes plain and fails patched is run once more on both sides;
if it still passes plain and fails patched it is *newly failing*, and the run fails.
Prints ``N passed plain; patched: N passed, M newly failing (names)``, the same for the
audit pass, and the audit violations found (a finding, reported, not a failure: many of
vLLM's tests build pool states by hand). Writes ``conformance.json`` and one JUnit file
per pass into ``--results``. Exit 0: conformant; 1: newly failing tests or a proof
missing; 2: the run could not be made (no sdist, no venv).

``--patched-plugin MODULE`` loads another pytest plugin in the patched passes only (the
unit test injects a deliberately broken patch that way and expects newly failing tests).

This file is the command line; ``conformance_runner.py`` runs the passes and compares them,
``conformance_plugin.py`` runs inside them. Standard library only, like ``matrix.py``: it
runs before any venv exists.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
try:
    import conformance_runner as runner  # noqa: E402  (scripts/conformance_runner.py)
    import venvs  # noqa: E402  (scripts/venvs.py)
finally:
    sys.path.remove(str(HERE))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pin", default="default", help="pin of pins.txt (default: the default pin)")
    ap.add_argument("--python", help="the venv's python (default: the pin's cached venv, "
                                     "built if needed)")
    ap.add_argument("--sdist-cache", type=Path,
                    help="where sdists are cached (default: <venv root>/sdists)")
    ap.add_argument("--results", type=Path, help="results folder (default: "
                                                  "build/conformance/<pin>)")
    ap.add_argument("--passes", default=",".join(runner.PASSES),
                    help=f"comma list of {', '.join(runner.PASSES)} (plain is needed to "
                         "compare)")
    ap.add_argument("--patched-plugin", action="append", default=[], metavar="MODULE",
                    help="another pytest plugin (module name or .py path) loaded in the "
                         "patched passes only")
    ap.add_argument("--keep", action="store_true", help="keep the temporary run folder")
    ap.add_argument("--jobs", type=int, help="passes run at once (default: one per CPU, at "
                                             "most one per pass)")
    ap.add_argument("--global-cleanup", action="store_true",
                    help="keep vLLM's per-test global cleanup (gc + distributed teardown, "
                         "~3 s a test on a busy machine); by default every test gets vLLM's "
                         "own skip_global_cleanup marker, meant for CPU unit tests")
    ap.add_argument("--fetch-only", action="store_true",
                    help="only cache the sdist and the test dependencies (the matrix does "
                         "this before the unit suite, whose runner test reads them)")
    ap.add_argument("tests", nargs="*", help="node ids inside the suite (default: all of it)")
    args = ap.parse_args(argv)
    passes = tuple(p.strip() for p in args.passes.split(",") if p.strip())
    if "plain" not in passes or not set(passes) <= set(runner.PASSES):
        ap.error(f"--passes must include plain; valid: {', '.join(runner.PASSES)}")
    try:
        pin = venvs.find_pin(args.pin)
        python = args.python
        if python is None:
            python = venvs.ensure(pin, REPO)["python"]
        version = pin.requirement.split("==", 1)[1].strip()
        # Caches live beside the venv: in its parent folder (the venv root).
        root = (Path(os.path.abspath(python)).parent.parent.parent if args.python
                else venvs.venv_root())
        cache = (args.sdist_cache or root / "sdists").resolve()
        t0 = time.monotonic()
        sdist = runner.fetch_sdist(version, python, cache)
        deps = runner.ensure_test_deps(python, root / "conformance-deps" / pin.name)
        prep = round(time.monotonic() - t0, 1)
    except (venvs.PinError, venvs.InstallError, runner.SetupError, OSError) as exc:
        print(f"conformance: {exc}", file=sys.stderr)
        return 2
    if args.fetch_only:
        print(f"conformance: {sdist} and {deps} ready in {prep} s")
        return 0
    results = (args.results or REPO / "build" / "conformance" / pin.name).resolve()
    print(f"conformance on vLLM {pin.name}: {runner.SUITE} of {sdist.name} "
          f"(cached in {cache}; ready in {prep} s), passes {', '.join(passes)}", flush=True)
    rec = runner.conformance(python, sdist, deps, results, extra=extra,
                             selection=args.tests, passes=passes,
                             patched_plugins=args.patched_plugin, keep=args.keep,
                             pin=pin.name, pycache=root / "conformance-pycache" / pin.name,
                             jobs=args.jobs, global_cleanup=args.global_cleanup)
    rec["prepare_seconds"] = prep
    (results / "conformance.json").write_text(json.dumps(rec, indent=1) + "\n")
    for line in runner.summary(rec):
        print(line)
    print(f"conformance {'passed' if rec['ok'] else 'FAILED'} on vLLM {pin.name} in "
          f"{rec['seconds'] + prep:.0f} s (results: {results})", flush=True)
    return 0 if rec["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
