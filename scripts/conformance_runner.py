"""The conformance runner: fetch a pin's sdist, run vLLM's ``tests/v1/core`` in passes, compare.

``scripts/conformance.py`` is its command line (the run is described there). Here: the sdist
cached beside the pin venvs (``pip download``) and its ``tests/`` unpacked into a temporary
run folder, the test-only dependencies installed beside the venv, one pytest pass per mode
(``plain``, ``patched``, ``audit``) in the pin's venv with its own environment and the two
pytest plugins (``conformance_platform``, then ``conformance_plugin``), and the comparison:
the tests that pass plain and not patched, re-run once on both sides, and the proof that the
plugin was (or, plain, was not) in place. Standard library only; import it with ``scripts/``
on ``sys.path`` (``conformance.py`` does), as it imports ``conformance_plugin`` by name.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import shutil
import subprocess
import tarfile
import tempfile
import time
from pathlib import Path

from conformance_plugin import CLEANUP_ENV, MODE_ENV, PLATFORM_PLUGIN, STATS_ENV

HERE = Path(__file__).resolve().parent
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
PLUGIN_NAME = "conformance_plugin"   # the passes' own plugin, as ``-p conformance_plugin``


class SetupError(RuntimeError):
    """The run could not be made (no sdist, no venv, no test dependencies)."""


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
