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

Each pass loads this file as a pytest plugin (``-p conformance``, the second half below),
after ``conformance_platform.py`` (the test-only CPU platform choice that lets a CUDA
wheel's pure-Python pin run vLLM's scheduler-level tests; the same in every pass).
It writes config-only local models with a stand-in tokenizer under the Hugging Face ids
the tests name (into an offline Hugging Face cache inside the run, so nothing downloads),
keeps vLLM's caches (its model-inspection cache among them) inside the run, and records
per test its outcome, the ``allocate_slots`` calls that went through the plugin's
transaction and any audit violation. The files that start a real engine on a downloaded
model are left out (:data:`EXCLUDE`). Every test gets vLLM's own ``skip_global_cleanup``
marker (its per-test gc and distributed teardown, meant to be skipped for CPU unit tests;
``--global-cleanup`` keeps it), in every pass alike. The passes run at once, one per CPU
(``--jobs``), each with its own vLLM cache folder.

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

The top level is standard library only, like ``matrix.py``: it runs before any venv exists.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
SUITE = "tests/v1/core"
#: Files that start a real engine (or an OpenAI server) on a model they download.
EXCLUDE = (
    "tests/v1/core/test_scheduler_e2e.py",
    "tests/v1/core/test_reset_prefix_cache_e2e.py",
    "tests/v1/core/prefix_cache/test_hybrid_prefix_cache_hit_rate.py",
)
#: Files outside ``tests/`` that the suite reads (0.34: the prompt block-hash vectors).
DATA_FILES = ("rust/src/engine-core-client/src/tests/prompt_block_hash_vectors.json",)
#: Test-only packages vLLM's tests/conftest.py imports that a pin venv lacks; installed
#: with ``pip install --target`` beside the venv (never into it) and put on PYTHONPATH.
TEST_DEPS = ("tblib",)
PASSES = ("plain", "patched", "audit")
PER_TEST_TIMEOUT = 300
PASS_TIMEOUT = 3600
ALLOCATE_SLOTS = "vllm.v1.core.kv_cache_manager.KVCacheManager.allocate_slots"
PLUGIN_NAME = "conformance"          # this file, as ``-p conformance``
#: The test-only platform choice (``conformance_platform.py``), loaded in every pass.
PLATFORM_PLUGIN = "conformance_platform"

MODE_ENV = "KVGUARD_CONFORMANCE"
STATS_ENV = "KVGUARD_CONFORMANCE_STATS"
CLEANUP_ENV = "KVGUARD_CONFORMANCE_GLOBAL_CLEANUP"


class SetupError(RuntimeError):
    """The run could not be made (no sdist, no venv, no test dependencies)."""


# =============================================================================== runner
def _venvs():
    sys.path.insert(0, str(HERE))
    try:
        import venvs  # noqa: PLC0415  (scripts/venvs.py)
    finally:
        sys.path.remove(str(HERE))
    return venvs


@contextlib.contextmanager
def _locked(path: Path):
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _run_quiet(cmd: list[str], log: Path, env: dict | None = None, timeout: int = 1800) -> int:
    with open(log, "a") as fh:
        fh.write(f"\n$ {' '.join(cmd)}\n")
        fh.flush()
        return subprocess.call(cmd, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                               env={**os.environ, "PIP_NO_INPUT": "1", "PIP_PROGRESS_BAR": "off",
                                    **(env or {})}, timeout=timeout)


def _pkg_info_version(path: Path) -> tuple[str, str]:
    name = version = ""
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith("Name:"):
            name = line.split(":", 1)[1].strip()
        elif line.startswith("Version:"):
            version = line.split(":", 1)[1].strip()
        if not line.strip():
            break
    return name, version


def fetch_sdist(version: str, python: str, cache: Path) -> Path:
    """``cache/vllm-<version>.tar.gz``, downloaded once with ``pip download``.

    vLLM's sdist cannot build its metadata here (CUDA/Rust build requirements), and pip
    keeps a downloaded sdist only after that build: with ``--no-clean`` it leaves the
    unpacked sdist in its temp folder, which is packed back into the cache file (the
    sidecar ``.json`` says which way the file came).
    """
    target = cache / f"vllm-{version}.tar.gz"
    meta = cache / f"vllm-{version}.json"
    with _locked(cache / f".vllm-{version}.lock"):
        if target.is_file() and meta.is_file():
            return target
        t0 = time.monotonic()
        work = Path(tempfile.mkdtemp(prefix=f".fetch-{version}-", dir=cache))
        try:
            log = cache / f"vllm-{version}.log"
            log.write_text(f"# fetching the vllm=={version} sdist\n")
            (work / "tmp").mkdir()
            _run_quiet([python, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                        "--no-build-isolation", "--no-clean", f"vllm=={version}",
                        "-d", str(work / "dl")], log, env={"TMPDIR": str(work / "tmp")})
            landed = work / "dl" / target.name
            if landed.is_file():
                origin = "pip download"
                shutil.move(str(landed), target)
            else:
                trees = [p.parent for p in (work / "tmp").glob("pip-*/*/PKG-INFO")
                         if _pkg_info_version(p) == ("vllm", version)]
                if not trees or not (trees[0] / "tests").is_dir():
                    raise SetupError(f"pip download of the vllm=={version} sdist left no sdist "
                                     f"(log: {log})")
                origin = ("pip download (metadata build failed; pip's unpacked sdist packed "
                          "back)")
                partial = target.with_suffix(".partial")
                with tarfile.open(partial, "w:gz", compresslevel=6) as tar:
                    tar.add(trees[0], arcname=f"vllm-{version}")
                partial.rename(target)
            meta.write_text(json.dumps({"version": version, "origin": origin,
                                        "bytes": target.stat().st_size,
                                        "seconds": round(time.monotonic() - t0, 1),
                                        "fetched_at": time.time()}, indent=1) + "\n")
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return target


def extract_tests(sdist: Path, dest: Path) -> Path:
    """Unpack the sdist's ``tests/``, ``pyproject.toml`` (pytest markers) and
    :data:`DATA_FILES` into ``dest``."""
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(sdist, "r:gz") as tar:
        members = []
        for m in tar:
            top, _, rest = m.name.partition("/")
            if rest in ("pyproject.toml", *DATA_FILES) or rest.startswith("tests/"):
                if not (m.isfile() or m.isdir()):
                    continue
                m.name = rest
                members.append(m)
        kwargs = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        tar.extractall(dest, members=members, **kwargs)
    if not (dest / SUITE).is_dir():
        raise SetupError(f"{sdist.name} has no {SUITE}")
    return dest


def ensure_test_deps(python: str, where: Path) -> Path:
    """:data:`TEST_DEPS` installed once into ``where`` (``pip install --target``)."""
    marker = where / ".kvguard-ready"
    want = {"deps": list(TEST_DEPS), "python": python}
    with _locked(where.parent / f".{where.name}.lock"):
        try:
            if json.loads(marker.read_text()) == want:
                return where
        except (OSError, ValueError):
            pass
        shutil.rmtree(where, ignore_errors=True)
        where.mkdir(parents=True)
        log = where.parent / f"{where.name}.log"
        log.write_text("")
        rc = _run_quiet([python, "-m", "pip", "install", "--no-deps", "--target", str(where),
                         *TEST_DEPS], log)
        if rc != 0:
            raise SetupError(f"installing {', '.join(TEST_DEPS)} failed (log: {log})")
        marker.write_text(json.dumps(want))
    return where


def pass_env(mode: str, run: Path, stats: Path, pythonpath: list[Path],
             pycache: Path | None = None, label: str | None = None,
             global_cleanup: bool = False) -> dict:
    label = label or mode
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("KVGUARD") and k not in ("PYTHONPATH", "PYTEST_ADDOPTS",
                                                         "PYTHONDONTWRITEBYTECODE")}
    hf = run / "hf"
    env.update({
        MODE_ENV: mode, STATS_ENV: str(stats),
        "PYTHONPATH": os.pathsep.join(map(str, pythonpath)),
        "HF_HOME": str(hf), "HF_HUB_CACHE": str(hf / "hub"), "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
        "VLLM_CACHE_ROOT": str(run / f"vllm-cache-{label}"),  # model inspection cache too
        "TORCHINDUCTOR_CACHE_DIR": str(run / "inductor"),
        "VLLM_RPC_BASE_PATH": str(run / "rpc"),
    })
    if pycache is not None:
        # The venvs are installed without byte-code (compiled lazily); a pass that may not
        # write any compiles vLLM, torch and transformers from source: minutes per pass.
        # The byte-code goes beside the venv, never into it.
        env["PYTHONPYCACHEPREFIX"] = str(pycache)
    if global_cleanup:
        env[CLEANUP_ENV] = "1"
    if mode != "plain":
        env["KVGUARD"] = "1"
    if mode == "audit":
        env["KVGUARD_AUDIT"] = "1"
    return env


def build_pytest_argv(python: str, junit: Path, selection: list[str], extra: list[str],
                plugins: list[str]) -> list[str]:
    cmd = [python, "-m", "pytest", *(selection or [SUITE]),
           *(f"--ignore={f}" for f in EXCLUDE),
           "-p", PLATFORM_PLUGIN, "-p", PLUGIN_NAME,
           *(a for p in plugins for a in ("-p", p)),
           "-p", "no:cacheprovider", "-q", "-rfE", "--tb=short",
           f"--junitxml={junit}", "-o", "junit_family=xunit2",
           f"--timeout={PER_TEST_TIMEOUT}"]
    return cmd + extra


def run_pass(mode: str, python: str, run: Path, results: Path, deps: Path, *,
             selection: list[str] | None = None, extra: list[str] = (),
             patched_plugins: list[str] = (), label: str | None = None,
             pycache: Path | None = None, global_cleanup: bool = False,
             quiet: bool = False) -> dict:
    """One pytest pass; returns ``{"mode", "rc", "seconds", "outcomes", "stats", ...}``."""
    label = label or mode
    stats = results / f"{label}.stats.json"
    outcomes_file = stats.with_suffix(".outcomes.jsonl")
    for f in (stats, outcomes_file):
        f.unlink(missing_ok=True)
    plugins = list(patched_plugins) if mode != "plain" else []
    extra_paths = [Path(p).resolve().parent for p in plugins if p.endswith(".py")]
    plugins = [Path(p).stem if p.endswith(".py") else p for p in plugins]
    env = pass_env(mode, run, stats, [HERE, deps, *extra_paths], pycache, label,
                   global_cleanup)
    cmd = build_pytest_argv(python, results / f"{label}.xml", selection or [], list(extra),
                            plugins)
    log = results / f"{label}.log"
    t0 = time.monotonic()
    with open(log, "w") as fh:
        fh.write("$ " + " ".join(cmd) + "\n")
        fh.flush()
        try:
            rc = subprocess.call(cmd, cwd=run, env=env, stdin=subprocess.DEVNULL,
                                 stdout=fh, stderr=subprocess.STDOUT, timeout=PASS_TIMEOUT)
        except subprocess.TimeoutExpired:
            rc = "timeout"
    secs = round(time.monotonic() - t0, 1)
    outcomes: dict[str, str] = {}
    try:
        for line in outcomes_file.read_text().splitlines():
            if line.strip():
                rec = json.loads(line)
                outcomes[rec["nodeid"]] = rec["outcome"]
    except (OSError, ValueError):
        pass
    try:
        st = json.loads(stats.read_text())
    except (OSError, ValueError):
        st = None
    tail = log.read_text(errors="replace").splitlines()[-1:] if log.exists() else []
    if not quiet:
        print(f"  {label:16} {secs:7.1f} s  rc {rc}  {tail[0] if tail else ''}", flush=True)
    return {"mode": mode, "rc": rc, "seconds": secs, "outcomes": outcomes, "stats": st,
            "log": str(log)}


def count(outcomes: dict[str, str], what: str = "passed") -> int:
    return sum(1 for o in outcomes.values() if o == what)


def newly_failing(plain: dict[str, str], patched: dict[str, str]) -> list[str]:
    """Tests that passed plain and did not pass patched (failed, errored, or went missing)."""
    return sorted(t for t, o in plain.items() if o == "passed"
                  and patched.get(t, "missing") not in ("passed", "skipped", "xfailed"))


def proof(mode: str, stats: dict | None) -> list[str]:
    """What is missing from the proof that the plugin was (or, plain, was not) in place."""
    if stats is None:
        return ["the pass wrote no session statistics (pytest died or never started)"]
    problems = []
    if mode == "plain":
        if stats.get("wrapped"):
            problems.append(f"plain pass has vllm-kvguard wrappers: {stats['wrapped']}")
        return problems
    res = (stats.get("activation") or {}).get("allocator", "")
    if not res.startswith("applied"):
        problems.append(f"allocator patch not applied ({res or 'activation did not run'})")
    if ALLOCATE_SLOTS not in (stats.get("wrapped") or []):
        problems.append("KVCacheManager.allocate_slots carries no vllm-kvguard wrapper")
    if not stats.get("txn_calls"):
        problems.append("no allocate_slots call went through the transaction")
    if stats.get("tripped"):
        problems.append(f"tripped: {', '.join(stats['tripped'])}")
    counters = stats.get("counters") or {}
    for cat in ("internal_error", "rollback_failed"):
        if counters.get(cat):
            problems.append(f"{cat}: {counters[cat]}")
    if stats.get("rollback_disabled"):
        problems.append(f"rollback disabled by an internal error ({stats['rollback_disabled']})")
    if mode == "audit" and not (counters.get("audit") or {}).get("steps"):
        problems.append("the audit never ran")
    return problems


def _names(tests: list[str], limit: int = 8) -> str:
    shown = ", ".join(tests[:limit])
    return shown + (f", ... {len(tests) - limit} more" if len(tests) > limit else "")


def conformance(python: str, sdist: Path, deps: Path, results: Path, *,
                extra: list[str] = (), selection: list[str] | None = None,
                passes: tuple[str, ...] = PASSES, patched_plugins: list[str] = (),
                keep: bool = False, pin: str = "", pycache: Path | None = None,
                jobs: int | None = None, global_cleanup: bool = False) -> dict:
    """Run the passes, re-run differences once on both sides, compare; the report dict."""
    results.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    run = Path(tempfile.mkdtemp(prefix="kvguard-conformance-"))
    rec: dict = {"pin": pin, "sdist": str(sdist), "suite": SUITE, "exclude": list(EXCLUDE),
                 "selection": selection or [], "passes": {}, "ok": True, "problems": []}
    try:
        extract_tests(sdist, run)
        rec["extract_seconds"] = round(time.monotonic() - t0, 1)
        kw = dict(extra=extra, pycache=pycache, global_cleanup=global_cleanup)
        jobs = jobs or min(len(passes), os.cpu_count() or 1)
        rec["jobs"] = jobs
        with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
            futures = {mode: pool.submit(run_pass, mode, python, run, results, deps,
                                         selection=selection,
                                         patched_plugins=patched_plugins, **kw)
                       for mode in passes}
            runs = {mode: f.result() for mode, f in futures.items()}
        plain = runs.get("plain")
        for mode, r in runs.items():
            entry = {"seconds": r["seconds"], "rc": r["rc"], "passed": count(r["outcomes"]),
                     "failed": count(r["outcomes"], "failed"),
                     "skipped": count(r["outcomes"], "skipped"),
                     "tests": len(r["outcomes"]), "proof_missing": proof(mode, r["stats"])}
            st = r["stats"] or {}
            entry.update({k: st.get(k) for k in ("txn_calls", "tests_with_txn", "wrapped",
                                                  "tripped", "counters", "activation",
                                                  "platform")})
            if mode == "audit":
                entry["violations"] = st.get("violations") or {}
            if not r["outcomes"]:
                entry["proof_missing"].append("no test outcome recorded")
            if r["rc"] not in (0, 1):                 # 1: some test failed (both sides)
                entry["proof_missing"].append(f"pytest exit {r['rc']} (log: {r['log']})")
            rec["passes"][mode] = entry
            rec["problems"] += [f"{mode}: {p}" for p in entry["proof_missing"]]
        for mode in passes:
            if mode == "plain" or plain is None:
                continue
            cand = newly_failing(plain["outcomes"], runs[mode]["outcomes"])
            entry = rec["passes"][mode]
            entry["candidates"] = cand
            confirmed = cand
            if cand:          # once more on both sides: a flaky or load-bound test is not counted
                with concurrent.futures.ThreadPoolExecutor(max_workers=min(2, jobs)) as pool:
                    fp = pool.submit(run_pass, "plain", python, run, results, deps,
                                     selection=cand, label=f"{mode}-rerun-plain", **kw)
                    fx = pool.submit(run_pass, mode, python, run, results, deps,
                                     selection=cand, patched_plugins=patched_plugins,
                                     label=f"{mode}-rerun-{mode}", **kw)
                    again_p, again_x = fp.result(), fx.result()
                confirmed = sorted(t for t in cand if again_p["outcomes"].get(t) == "passed"
                                   and again_x["outcomes"].get(t) != "passed")
                entry["rerun_seconds"] = round(again_p["seconds"] + again_x["seconds"], 1)
            entry["newly_failing"] = confirmed
            entry["flaky"] = sorted(set(cand) - set(confirmed))
            entry["newly_passing"] = sorted(
                t for t, o in runs[mode]["outcomes"].items()
                if o == "passed" and plain["outcomes"].get(t) not in (None, "passed"))
            if confirmed:
                rec["problems"].append(f"{mode}: {len(confirmed)} newly failing")
    finally:
        if keep:
            rec["run_dir"] = str(run)
        else:
            shutil.rmtree(run, ignore_errors=True)
        if pycache is not None:          # the run folder's own byte-code: never reused
            shutil.rmtree(pycache / str(run).lstrip(os.sep), ignore_errors=True)
    rec["ok"] = not rec["problems"]
    rec["seconds"] = round(time.monotonic() - t0, 1)
    (results / "conformance.json").write_text(json.dumps(rec, indent=1) + "\n")
    return rec


def summary(rec: dict) -> list[str]:
    p = rec["passes"]
    lines = []
    plain_n = p["plain"]["passed"] if "plain" in p else 0
    for mode in ("patched", "audit"):
        if mode not in p:
            continue
        e = p[mode]
        nf = e.get("newly_failing", [])
        head = (f"{plain_n} passed plain; {mode}: {e['passed']} passed, {len(nf)} newly failing"
                + (f" ({_names(nf)})" if nf else ""))
        notes = [f"{e.get('txn_calls') or 0} allocate_slots calls through the transaction in "
                 f"{e.get('tests_with_txn') or 0} tests"]
        if e.get("flaky"):
            notes.append(f"{len(e['flaky'])} differed once, not on re-run: {_names(e['flaky'])}")
        if e.get("newly_passing"):
            notes.append(f"{len(e['newly_passing'])} newly passing: {_names(e['newly_passing'])}")
        lines.append(head + "  [" + "; ".join(notes) + "]")
        if mode == "audit":
            v = e.get("violations") or {}
            total = sum(len(x) for x in v.values())
            lines.append(f"audit violations: {total} in {len(v)} tests"
                         + (f" ({_names(sorted(v))})" if v else ""))
            for test in sorted(v)[:10]:
                lines.append(f"  {test}: {v[test][0]}")
    for prob in rec["problems"]:
        lines.append(f"problem: {prob}")
    return lines


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
    ap.add_argument("--passes", default=",".join(PASSES),
                    help=f"comma list of {', '.join(PASSES)} (plain is needed to compare)")
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
    venvs = _venvs()
    passes = tuple(p.strip() for p in args.passes.split(",") if p.strip())
    if "plain" not in passes or not set(passes) <= set(PASSES):
        ap.error(f"--passes must include plain; valid: {', '.join(PASSES)}")
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
        sdist = fetch_sdist(version, python, cache)
        deps = ensure_test_deps(python, root / "conformance-deps" / pin.name)
        prep = round(time.monotonic() - t0, 1)
    except (venvs.PinError, venvs.InstallError, SetupError, OSError) as exc:
        print(f"conformance: {exc}", file=sys.stderr)
        return 2
    if args.fetch_only:
        print(f"conformance: {sdist} and {deps} ready in {prep} s")
        return 0
    results = (args.results or REPO / "build" / "conformance" / pin.name).resolve()
    print(f"conformance on vLLM {pin.name}: {SUITE} of {sdist.name} "
          f"(cached in {cache}; ready in {prep} s), passes {', '.join(passes)}", flush=True)
    rec = conformance(python, sdist, deps, results, extra=extra, selection=args.tests,
                      passes=passes, patched_plugins=args.patched_plugin, keep=args.keep,
                      pin=pin.name, pycache=root / "conformance-pycache" / pin.name,
                      jobs=args.jobs, global_cleanup=args.global_cleanup)
    rec["prepare_seconds"] = prep
    (results / "conformance.json").write_text(json.dumps(rec, indent=1) + "\n")
    for line in summary(rec):
        print(line)
    print(f"conformance {'passed' if rec['ok'] else 'FAILED'} on vLLM {pin.name} in "
          f"{rec['seconds'] + prep:.0f} s (results: {results})", flush=True)
    return 0 if rec["ok"] else 1


# ====================================================== pytest plugin (inside the venv)
# Loaded by every pass as ``-p conformance``; everything below runs only under pytest.
#: Config-only models under the Hugging Face ids the tests name (their real configs'
#: shapes; weights are never read: the tests build schedulers and KV managers only).
_OPT = {"activation_dropout": 0.0, "activation_function": "relu",
        "architectures": ["OPTForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 2,
        "do_layer_norm_before": True, "dropout": 0.1, "enable_bias": True, "eos_token_id": 2,
        "init_std": 0.02, "layer_norm_elementwise_affine": True, "layerdrop": 0.0,
        "max_position_embeddings": 2048, "model_type": "opt", "pad_token_id": 1,
        "prefix": "</s>", "torch_dtype": "float16", "use_cache": True, "vocab_size": 50272}
_LLAMA_7B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
             "intermediate_size": 11008, "num_attention_heads": 32, "num_hidden_layers": 32,
             "num_key_value_heads": 32, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
             "vocab_size": 32064, "torch_dtype": "float16", "rope_theta": 10000.0}
MODELS = {
    "facebook/opt-125m": {**_OPT, "ffn_dim": 3072, "hidden_size": 768, "num_attention_heads": 12,
                          "num_hidden_layers": 12, "word_embed_proj_dim": 768},
    "facebook/opt-350m": {**_OPT, "do_layer_norm_before": False, "ffn_dim": 4096,
                          "hidden_size": 1024, "num_attention_heads": 16,
                          "num_hidden_layers": 24, "word_embed_proj_dim": 512},
    # ModelConfig()'s default model.
    "Qwen/Qwen3-0.6B": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
                        "hidden_size": 1024, "intermediate_size": 3072, "head_dim": 128,
                        "num_attention_heads": 16, "num_key_value_heads": 8,
                        "num_hidden_layers": 28, "max_position_embeddings": 40960,
                        "max_window_layers": 28, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
                        "sliding_window": None, "use_sliding_window": False,
                        "attention_bias": False, "tie_word_embeddings": True,
                        "torch_dtype": "bfloat16", "vocab_size": 151936, "bos_token_id": 151643,
                        "eos_token_id": 151645, "hidden_act": "silu"},
    "Qwen/Qwen1.5-7B": {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
                        "hidden_size": 4096, "intermediate_size": 11008,
                        "num_attention_heads": 32, "num_key_value_heads": 32,
                        "num_hidden_layers": 32, "max_position_embeddings": 32768,
                        "max_window_layers": 28, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
                        "sliding_window": 32768, "use_sliding_window": False,
                        "tie_word_embeddings": False, "torch_dtype": "bfloat16",
                        "vocab_size": 151936, "bos_token_id": 151643, "eos_token_id": 151643,
                        "hidden_act": "silu"},
    # A hybrid (Gated DeltaNet + attention) MoE with an MTP draft (0.34's test_scheduler.py).
    "Qwen/Qwen3-Next-80B-A3B-Instruct": {
        "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
        "hidden_size": 2048, "intermediate_size": 5120, "num_attention_heads": 16,
        "num_key_value_heads": 2, "head_dim": 256, "num_hidden_layers": 48,
        "full_attention_interval": 4, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "linear_num_key_heads": 16,
        "linear_num_value_heads": 32, "num_experts": 512, "num_experts_per_tok": 10,
        "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
        "decoder_sparse_step": 1, "norm_topk_prob": True, "mlp_only_layers": [],
        "max_position_embeddings": 262144, "rope_theta": 10000000,
        "partial_rotary_factor": 0.25, "rms_norm_eps": 1e-6, "vocab_size": 151936,
        "torch_dtype": "bfloat16", "tie_word_embeddings": False, "attention_bias": False,
        "hidden_act": "silu", "bos_token_id": 151643, "eos_token_id": 151645},
    "llava-hf/llava-1.5-7b-hf": {
        "architectures": ["LlavaForConditionalGeneration"], "model_type": "llava",
        "ignore_index": -100, "image_token_index": 32000, "pad_token_id": 32001,
        "projector_hidden_act": "gelu", "vision_feature_layer": -2,
        "vision_feature_select_strategy": "default", "image_seq_length": 576,
        "torch_dtype": "float16", "tie_word_embeddings": False,
        "text_config": {**_LLAMA_7B, "architectures": None},
        "vision_config": {"model_type": "clip_vision_model", "hidden_size": 1024,
                          "image_size": 336, "intermediate_size": 4096,
                          "num_attention_heads": 16, "num_hidden_layers": 24,
                          "patch_size": 14, "projection_dim": 768, "hidden_act": "quick_gelu",
                          "layer_norm_eps": 1e-5}},
    "Qwen/Qwen2.5-VL-3B-Instruct": {
        "architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl",
        "hidden_size": 2048, "intermediate_size": 11008, "num_attention_heads": 16,
        "num_key_value_heads": 2, "num_hidden_layers": 36, "max_position_embeddings": 128000,
        "max_window_layers": 70, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "sliding_window": 32768, "use_sliding_window": False, "tie_word_embeddings": True,
        "torch_dtype": "bfloat16", "vocab_size": 151936, "bos_token_id": 151643,
        "eos_token_id": 151645, "hidden_act": "silu", "image_token_id": 151655,
        "video_token_id": 151656, "vision_start_token_id": 151652,
        "vision_end_token_id": 151653, "vision_token_id": 151654,
        "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
        "vision_config": {"depth": 32, "hidden_act": "silu", "hidden_size": 1280,
                          "intermediate_size": 3420, "num_heads": 16, "in_chans": 3,
                          "out_hidden_size": 2048, "patch_size": 14,
                          "spatial_merge_size": 2, "spatial_patch_size": 14,
                          "window_size": 112, "fullatt_block_indexes": [7, 15, 23, 31],
                          "tokens_per_second": 2, "temporal_patch_size": 2}},
}
_SNAPSHOT = "c0f0c0f0c0f0c0f0c0f0c0f0c0f0c0f0c0f0c0f0"      # any 40-hex commit id
_STATE: dict = {"txn_calls": 0, "tests_with_txn": 0, "violations": {}, "current": None,
                "outcomes": {}, "fh": None}


def write_models(hub: Path) -> None:
    """Each of :data:`MODELS` as an offline Hugging Face cache entry (config.json and a
    stand-in word-level tokenizer), so ``ModelConfig("facebook/opt-125m")`` resolves it."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    specials = ["<unk>", "<s>", "</s>", "<pad>"]
    vocab = {tok: i for i, tok in enumerate(specials + [f"w{i}" for i in range(252)])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(specials)
    tok_json = tok.to_str()
    tok_cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
               "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>",
               "model_max_length": 1 << 20, "clean_up_tokenization_spaces": False}
    for repo_id, config in MODELS.items():
        entry = hub / ("models--" + repo_id.replace("/", "--"))
        snap = entry / "snapshots" / _SNAPSHOT
        snap.mkdir(parents=True, exist_ok=True)
        (snap / "config.json").write_text(json.dumps({"_name_or_path": repo_id, **config},
                                                     indent=1))
        (snap / "tokenizer.json").write_text(tok_json)
        (snap / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=1))
        (entry / "refs").mkdir(exist_ok=True)
        (entry / "refs" / "main").write_text(_SNAPSHOT)


def _mode() -> str | None:
    return os.environ.get(MODE_ENV)


def pytest_configure(config):
    mode = _mode()
    if mode is None:
        return
    hub = os.environ.get("HF_HUB_CACHE")
    if hub:
        write_models(Path(hub))
    stats = os.environ.get(STATS_ENV)
    if stats:
        _STATE["fh"] = open(Path(stats).with_suffix(".outcomes.jsonl"), "a")
    if mode == "plain":
        return
    import vllm.plugins                                   # as vLLM loads its plugins

    vllm.plugins.load_general_plugins()
    from vllm_kvguard import activation
    from vllm_kvguard.fixes.transaction import audit, rollback

    _STATE["activation"] = activation.results()
    original = rollback.Rollback.transaction

    def transaction(self, manager, fn):                   # count the transaction's calls
        txn = original(self, manager, fn)
        if txn is None:
            return None

        def allocate_slots(*args, **kwargs):
            _STATE["txn_calls"] += 1
            _STATE["test_txn"] = True
            return txn(*args, **kwargs)

        return allocate_slots

    rollback.Rollback.transaction = transaction
    _STATE["fix_module"] = rollback
    report = audit.report_violations

    def report_violations(result, where="after schedule"):
        test = _STATE["current"] or "(outside a test)"
        found = _STATE["violations"].setdefault(test, [])
        if len(found) < 20:
            found.extend(str(v) for v in result.violations[:20 - len(found)])
        return report(result, where)

    audit.report_violations = report_violations


def pytest_collection_modifyitems(config, items):
    """vLLM's own marker for CPU unit tests: no per-test gc + distributed teardown."""
    if _mode() is None or os.environ.get(CLEANUP_ENV):
        return
    for item in items:
        item.add_marker("skip_global_cleanup")


def pytest_runtest_logstart(nodeid, location):
    _STATE["current"] = nodeid
    _STATE["test_txn"] = False
    _STATE["outcomes"][nodeid] = "passed"


def pytest_runtest_logreport(report):
    if _mode() is None:
        return
    was = _STATE["outcomes"].get(report.nodeid, "passed")
    if report.failed:
        now = "failed"
    elif report.skipped:
        now = "xfailed" if hasattr(report, "wasxfail") else "skipped"
    elif report.when == "call" and hasattr(report, "wasxfail"):
        now = "xpassed"
    else:
        now = "passed"
    if was == "failed" or (was in ("skipped", "xfailed") and now == "passed"):
        now = was
    _STATE["outcomes"][report.nodeid] = now


def pytest_runtest_logfinish(nodeid, location):
    if _mode() is None:
        return
    if _STATE.get("test_txn"):
        _STATE["tests_with_txn"] += 1
    _STATE["current"] = None
    fh = _STATE["fh"]
    if fh is not None:
        fh.write(json.dumps({"nodeid": nodeid, "outcome": _STATE["outcomes"][nodeid]}) + "\n")
        fh.flush()


def pytest_sessionfinish(session, exitstatus):
    mode = _mode()
    stats = os.environ.get(STATS_ENV)
    if mode is None or not stats:
        return
    out = {"mode": mode, "exitstatus": int(exitstatus), "txn_calls": _STATE["txn_calls"],
           "tests_with_txn": _STATE["tests_with_txn"], "violations": _STATE["violations"],
           "activation": _STATE.get("activation"), "wrapped": [], "tripped": [],
           "counters": {},
           "platform": getattr(sys.modules.get(PLATFORM_PLUGIN), "CHOICE", None)}
    if "vllm_kvguard" in sys.modules:
        from vllm_kvguard import activation, hostcall, report
        from vllm_kvguard.patches import ALL_PATCHES

        out["wrapped"] = activation.wrapped_targets()
        out["tripped"] = [p.name for p in ALL_PATCHES if hostcall.tripped(p.name)]
        out["counters"] = report.snapshot()
        if mode != "plain":
            from vllm_kvguard.patches import allocator

            fix = allocator._State.fix
            out["rollback_disabled"] = getattr(fix, "disabled", None)
    Path(stats).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
