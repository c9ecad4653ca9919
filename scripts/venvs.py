#!/usr/bin/env python3
"""Create or reuse a cached virtual environment for one vLLM pin of ``pins.txt``.

    python3 scripts/venvs.py 0.32.0          # prints the venv's path (builds it if needed)
    python3 scripts/venvs.py --list          # the pins, their venvs and whether they are ready
    python3 scripts/venvs.py 0.33.0 --rebuild

Venvs live outside the repository, under ``$KVGUARD_VENV_ROOT`` (default
``$XDG_CACHE_HOME/vllm-kvguard/venvs``, i.e. ``~/.cache/vllm-kvguard/venvs``), one folder per
pin. A venv is reused only if its marker file ``.kvguard-ready`` exists and records the
same install recipe (requirement, test deps, Python, this script's recipe version); the
marker is written last, so a half-built venv is thrown away and built again.

This repository is installed editable into the venv (``pip install --no-deps -e``); when
the venv was last pointed at another checkout, or ``pyproject.toml`` changed, that one
step is redone (a few seconds), never the whole venv.

Extra pip options (another index, a proxy) come from pip's own config or ``PIP_*``
environment variables: torch 2.13.0+cpu is found through the machine's pip config here,
elsewhere through PyTorch's CPU wheel index (``PIP_EXTRA_INDEX_URL``).
Standard library only: this runs before any venv exists.
"""
from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PINS_FILE = REPO / "pins.txt"

#: Bump when the install steps change: every cached venv is then rebuilt once.
RECIPE_VERSION = 1
TEST_DEPS = ("pluggy", "wrapt", "packaging", "pytest", "pytest-mock", "hypothesis",
             "pytest-timeout")
#: Break beside torch 2.13.0+cpu (torchvision::nms missing) and vLLM runs without them.
REMOVE_AFTER = ("torchvision", "torchaudio", "torchcodec")
#: torch for ``deps=pure-python`` pins (the CPU build on this machine's disk).
PURE_PYTHON_TORCH = "torch==2.13.0"
#: Requirements of a CUDA vLLM wheel that ``deps=pure-python`` leaves out: torch and its
#: media/CUDA companions and GPU kernel packages (normalized names; ``*`` = prefix).
GPU_ONLY = ("torch", "torchaudio", "torchvision", "torchcodec", "triton*", "nvidia-*",
            "cupy*", "xformers", "flashinfer*", "pynvvideocodec", "apache-tvm-ffi", "tilelang",
            "nvtx", "fastsafetensors", "instanttensor", "quack-kernels", "tokenspeed-*",
            "humming-kernels*", "deep-gemm*", "deep-ep*")
#: Modules that must import in every venv (the pure-Python surfaces the patches target).
#: (Model Runner V1's ``vllm.v1.cudagraph_dispatcher`` is not here: 0.34.0 removed it.)
CHECK_IMPORTS = ("vllm.config", "vllm.v1.core.kv_cache_manager", "vllm.v1.core.sched.scheduler",
                 "vllm.v1.worker.gpu.cudagraph_utils",
                 "vllm.v1.worker.gpu.warmup")
MARKER = ".kvguard-ready"
REPO_MARKER = ".kvguard-repo"


@dataclass(frozen=True)
class Pin:
    name: str
    requirement: str
    suite: str = "smoke"              # integration tests: full | smoke | none
    deps: str = "all"                 # all | pure-python
    default: bool = False
    extras: tuple = ()                # test-only packages for this pin (pip requirements)
    conformance: bool = False         # the matrix runs vLLM's own tests/v1/core here too
    cases: str = "all"                # unit tests' generated cases: all | core
    options: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def distribution(self) -> str:
        return self.requirement.split("==")[0].strip()


class PinError(ValueError):
    pass


def read_pins(path: Path = PINS_FILE) -> list[Pin]:
    pins: list[Pin] = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        if len(words) < 2 or "==" not in words[1]:
            raise PinError(f"{path.name}:{lineno}: expected 'NAME  dist==VERSION  [options]', "
                           f"got {line.strip()!r}")
        opts: dict[str, str] = {}
        for word in words[2:]:
            key, sep, val = word.partition("=")
            opts[key] = val if sep else "1"
        conformance = opts.pop("conformance", "no")
        pin = Pin(words[0], words[1], suite=opts.pop("suite", "smoke"),
                  deps=opts.pop("deps", "all"), default=opts.pop("default", "") == "1",
                  extras=tuple(x for x in opts.pop("extras", "").split(",") if x),
                  conformance=conformance in ("yes", "1"),
                  cases=opts.pop("cases", "all"), options=opts)
        if pin.suite not in ("full", "smoke", "none"):
            raise PinError(f"{path.name}:{lineno}: suite={pin.suite!r}; valid: full, smoke, none")
        if pin.deps not in ("all", "pure-python"):
            raise PinError(f"{path.name}:{lineno}: deps={pin.deps!r}; valid: all, pure-python")
        if pin.cases not in ("all", "core"):
            raise PinError(f"{path.name}:{lineno}: cases={pin.cases!r}; valid: all, core")
        if conformance not in ("yes", "no", "1"):
            raise PinError(f"{path.name}:{lineno}: conformance={conformance!r}; valid: yes, no")
        if opts:
            raise PinError(f"{path.name}:{lineno}: unknown option(s) {', '.join(opts)}; "
                           f"valid: suite=, deps=, extras=, conformance=, cases=, default")
        pins.append(pin)
    names = [p.name for p in pins]
    if len(set(names)) != len(names):
        raise PinError(f"{path.name}: duplicate pin names in {names}")
    if sum(p.default for p in pins) != 1:
        raise PinError(f"{path.name}: exactly one pin must be marked 'default'")
    return pins


def find_pin(name: str, pins: list[Pin] | None = None) -> Pin:
    pins = read_pins() if pins is None else pins
    for pin in pins:
        if name in (pin.name, pin.requirement) or (name == "default" and pin.default):
            return pin
    raise PinError(f"unknown pin {name!r}; valid: {', '.join(p.name for p in pins)}, default")


def venv_root() -> Path:
    root = os.environ.get("KVGUARD_VENV_ROOT")
    if root:
        return Path(root).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    return Path(cache) / "vllm-kvguard" / "venvs"


def venv_dir(pin: Pin) -> Path:
    return venv_root() / pin.name


def recipe(pin: Pin) -> dict:
    """Everything that decides a venv's contents: a change rebuilds it."""
    return {
        "recipe_version": RECIPE_VERSION,
        "requirement": pin.requirement,
        "deps": pin.deps,
        "test_deps": list(TEST_DEPS),
        "remove_after": list(REMOVE_AFTER),
        "python": f"{sys.version_info[0]}.{sys.version_info[1]}",
        **({"torch": PURE_PYTHON_TORCH, "gpu_only": list(GPU_ONLY)}
           if pin.deps == "pure-python" else {}),
        **({"extras": list(pin.extras)} if pin.extras else {}),
    }


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def is_ready(pin: Pin) -> bool:
    marker = _read_json(venv_dir(pin) / MARKER)
    return bool(marker) and marker.get("recipe") == recipe(pin)


class InstallError(RuntimeError):
    pass


class _Runner:
    """Runs install commands, appending their output to one log file per venv."""

    def __init__(self, log: Path, verbose: bool):
        self.log, self.verbose = log, verbose

    def __call__(self, *cmd: str, what: str) -> str:
        with open(self.log, "a") as fh:
            fh.write(f"\n$ {' '.join(cmd)}\n")
            fh.flush()
            start = fh.tell()
            proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL,
                                    env={**os.environ, "PIP_NO_INPUT": "1",
                                         "PIP_PROGRESS_BAR": "off"})
            t0 = time.monotonic()
            while True:                          # a heartbeat while pip runs, never silent
                try:
                    rc = proc.wait(timeout=HEARTBEAT_S)
                    break
                except subprocess.TimeoutExpired:
                    if not self.verbose:
                        sys.stderr.write(f"  ... still {what} ({time.monotonic() - t0:.0f} s; "
                                         f"{_last_line(self.log)})\n")
                        sys.stderr.flush()
        with open(self.log) as fh:              # streamed to the log, read back
            fh.seek(start)
            output = fh.read()
        if self.verbose:
            sys.stderr.write(output)
        if rc != 0:
            tail = "\n".join(line for line in output.splitlines()
                             if "is ignored: it is neither" not in line)[-3000:]
            raise InstallError(f"{what} failed (exit {rc}): {' '.join(cmd)}\n"
                               f"--- last lines (full log: {self.log}) ---\n{tail}")
        return output


HEARTBEAT_S = 30.0


def _last_line(log: Path) -> str:
    """pip's last log line, shortened, for the heartbeat."""
    try:
        with open(log, "rb") as fh:
            fh.seek(max(0, os.path.getsize(log) - 4096))
            lines = [ln for ln in fh.read().decode("utf-8", "replace").splitlines()
                     if ln.strip()]
    except OSError:
        return "log unreadable"
    last = lines[-1].strip() if lines else ""
    return "pip: " + (last[:100] + "..." if len(last) > 100 else last)


_FILTER_REQUIREMENTS = r"""
import fnmatch, json, sys
from importlib import metadata
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
dist, gpu_only = sys.argv[1], json.loads(sys.argv[2])
keep, dropped = [], []
for raw in metadata.requires(dist) or []:
    req = Requirement(raw)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    name = canonicalize_name(req.name)
    req.marker = None
    (dropped if any(fnmatch.fnmatch(name, g) for g in gpu_only) else keep).append(str(req))
print(json.dumps({"keep": keep, "dropped": dropped}))
"""


def _build(pin: Pin, path: Path, run: _Runner) -> dict:
    py = str(path / "bin" / "python")
    pip = (py, "-m", "pip")
    install = (*pip, "install", "--no-compile")   # byte-compile lazily: ~40 s CPU less a venv
    steps: dict[str, float] = {}

    def step(name, *cmd, what):
        t0 = time.monotonic()
        out = run(*cmd, what=what)
        steps[name] = round(time.monotonic() - t0, 1)
        return out

    step("venv", sys.executable, "-m", "venv", str(path), what="creating the venv")
    if pin.deps == "all":
        step("install", *install, pin.requirement, *TEST_DEPS,
             what=f"installing {pin.requirement}")
    else:
        step("install_nodeps", *install, "--no-deps", pin.requirement,
             what=f"installing {pin.requirement} --no-deps")
        step("install_packaging", *install, "packaging", what="installing packaging")
        out = step("read_requirements", py, "-c", _FILTER_REQUIREMENTS,
                   pin.distribution, json.dumps(GPU_ONLY),
                   what=f"reading {pin.distribution}'s requirements")
        reqs = json.loads(out.strip().splitlines()[-1])
        (path / "kvguard-dropped-requirements.txt").write_text("\n".join(reqs["dropped"]) + "\n")
        step("install_deps", *install, PURE_PYTHON_TORCH, *reqs["keep"], *TEST_DEPS,
             what=f"installing {pin.requirement}'s pure-Python requirements")
    if pin.extras:
        step("install_extras", *install, *pin.extras,
             what=f"installing this pin's test extras {', '.join(pin.extras)}")
    step("remove", *pip, "uninstall", "-y", *REMOVE_AFTER, what="removing " + " ".join(REMOVE_AFTER))
    step("check_imports", py, "-c", "import importlib, sys\n"
         "for m in sys.argv[1:]: importlib.import_module(m)", *CHECK_IMPORTS,
         what=f"importing {', '.join(CHECK_IMPORTS)}")
    return steps


@contextlib.contextmanager
def _locked(pin: Pin):
    """One builder per venv at a time (parallel runners, several checkouts)."""
    venv_root().mkdir(parents=True, exist_ok=True)
    with open(venv_root() / f".{pin.name}.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _pyproject_digest(repo: Path) -> str:
    """What an editable install depends on: pyproject.toml (entry points, package map)."""
    return hashlib.sha256((repo / "pyproject.toml").read_bytes()).hexdigest()[:16]


def _install_repo(pin: Pin, path: Path, repo: Path, run: _Runner) -> bool:
    """Point the venv's editable vllm-kvguard at ``repo``; return whether it had to."""
    want = {"repo": str(repo), "pyproject": _pyproject_digest(repo)}
    if _read_json(path / REPO_MARKER) == want:
        return False
    (path / REPO_MARKER).unlink(missing_ok=True)
    run(str(path / "bin" / "python"), "-m", "pip", "install", "--no-deps", "-e", str(repo),
        what=f"installing {repo} (editable) into the {pin.name} venv")
    (path / REPO_MARKER).write_text(json.dumps(want))
    return True


def ensure(pin: Pin, repo: Path = REPO, rebuild: bool = False, verbose: bool = False,
           with_repo: bool = True) -> dict:
    """Build ``pin``'s venv unless a complete one is cached; return what happened.

    Returns ``{"path", "python", "built", "seconds", "steps", "log"}``; raises
    :class:`InstallError` naming the failed step and the log file. ``with_repo=False``
    leaves out the editable install of ``repo`` (:func:`install_repo`, done just before the
    pin's tests): ``scripts/matrix.py --build-ahead`` builds venvs while another pin's tests
    run from the same checkout, which an editable build writes into.
    """
    path = venv_dir(pin)
    log = venv_root() / f"{pin.name}.log"
    t0 = time.monotonic()
    built = False
    steps: dict = {}
    with _locked(pin):
        run = _Runner(log, verbose)
        if rebuild or not is_ready(pin):
            if path.exists():
                shutil.rmtree(path)
            log.write_text(f"# building {pin.requirement} into {path}\n")
            print(f"vllm-kvguard: building the {pin.name} venv ({pin.requirement}) into "
                  f"{path}; pip's log: {log} (a few minutes the first time)",
                  file=sys.stderr, flush=True)
            steps = _build(pin, path, run)
            built = True
            (path / MARKER).write_text(json.dumps({"recipe": recipe(pin), "steps": steps,
                                                   "built_at": time.time()}, indent=1))
        t1 = time.monotonic()
        if with_repo and _install_repo(pin, path, repo.resolve(), run):
            steps["install_repo"] = round(time.monotonic() - t1, 1)
    return {"path": str(path), "python": str(path / "bin" / "python"), "built": built,
            "seconds": round(time.monotonic() - t0, 1), "steps": steps, "log": str(log)}


def install_repo(pin: Pin, repo: Path = REPO, verbose: bool = False) -> float | None:
    """Point ``pin``'s (built) venv at ``repo``, editable; seconds taken, None if it was."""
    t0 = time.monotonic()
    with _locked(pin):
        run = _Runner(venv_root() / f"{pin.name}.log", verbose)
        if not _install_repo(pin, venv_dir(pin), repo.resolve(), run):
            return None
    return round(time.monotonic() - t0, 1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("pin", nargs="?", help="pin name from pins.txt (or 'default')")
    ap.add_argument("--list", action="store_true", help="list pins and their venvs")
    ap.add_argument("--rebuild", action="store_true", help="rebuild even if cached")
    ap.add_argument("-v", "--verbose", action="store_true", help="show pip's output")
    args = ap.parse_args(argv)
    try:
        pins = read_pins()
        if args.list or not args.pin:
            for p in pins:
                state = "ready" if is_ready(p) else "not built"
                print(f"{p.name:8} {p.requirement:20} {state:9} {venv_dir(p)}")
            return 0
        pin = find_pin(args.pin, pins)
        info = ensure(pin, rebuild=args.rebuild, verbose=args.verbose)
    except (PinError, InstallError) as exc:
        print(f"venvs.py: {exc}", file=sys.stderr)
        return 2
    what = "built" if info["built"] else "reused"
    print(f"{what} {pin.name} venv in {info['seconds']} s {info['steps'] or ''}", file=sys.stderr)
    print(info["path"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
