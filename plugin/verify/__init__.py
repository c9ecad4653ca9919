"""Self-verified activation: a patch outside its declared vLLM range proves itself first.

On a vLLM a patch was not proven on (newer than the newest proven release, say), the
patch is applied only after, in that process and before vLLM uses its targets:

1. the drift guard passes at run time: every declared target and private name resolves
   (:meth:`Patch.drift`) and the parameters its wrappers read sit where they expect
   (:mod:`.signatures`); names of a module the process has not loaded are checked when
   vLLM imports it (a miss then turns the patch off there);
2. its behavioural self-test passes on vLLM's real classes (:data:`CHECKS`, by patch
   name: each checks what a vLLM change would break first), through the patch's own
   wrappers, quietly (log lines and counters of the test are not the engine's).

The cheap self-tests (pure Python KV managers) run at activation. Those of :data:`WHERE`
run where their target runs, on what vLLM built there: the patch is applied pending, and
its wrappers call :func:`due` before vLLM first uses the target in that process (the
scheduler's process for containment and for admission, whose limits are made there; the
model runner's for cudagraph). A patch failing either is reverted and skipped with its
reason. Inside the declared range nothing here runs. Verdicts (the drift guard's too) are
shared with the processes this one starts afterwards (same vLLM, same node) through
:data:`ENV_VERIFIED`, so a process tree checks each patch once; a deferred failure
reaches the front end in the counters' ``collective_rpc`` reply (:func:`heard`), which
turns the patch off there too.
"""
from __future__ import annotations

import importlib
import json
import os
import socket
import sys
import time
from dataclasses import dataclass

import wrapt

from vllm_kvguard import log, report

#: patch name -> "module:function" (or a callable) of its behavioural self-test, which
#: raises :class:`SelfTestFailed` (or any error) when the patch must stay off.
CHECKS = {
    "allocator": "vllm_kvguard.verify.allocator:check",
    "admission": "vllm_kvguard.verify.estimation:admission",
    "warmup": "vllm_kvguard.verify.estimation:warmup",
    "containment": "vllm_kvguard.verify.containment:check",
    "cudagraph": "vllm_kvguard.verify.cudagraph:check",
}
#: what each self-test shows, for the doctor's table and the docs
SHOWS = {
    "allocator": "a multi-group allocation failing in a later group is rolled back exactly",
    "admission": "the certificate equals the allocator at the boundary",
    "warmup": "the reserved-block model equals the allocator",
    "containment": "a connector call raising for one request ends that request only",
    "cudagraph": "the coverage probe runs on the installed graph manager",
    "distributed": "names and signatures only (always on with the plugin)",
    "faults": "names and signatures only (test tooling)",
    "health": "names and signatures only (the verdict reads the front end's own state)",
}
#: patches whose self-test runs where vLLM uses their target, on what it built there
WHERE = {
    "admission": "the scheduler's process, before its admission limits are published",
    "containment": "the scheduler's process, before its Scheduler is built",
    "cudagraph": "the model runner's process, before its KV cache and graphs are set up",
}
ENV_VERIFIED = "KVGUARD_VERIFIED"
#: set while a self-test runs: a process vLLM starts meanwhile (its model registry probe,
#: ``python -m vllm.model_executor.models.registry``, when a self-test builds a config)
#: runs no self-test of its own (they would nest without end) and leaves the patch off
ENV_TESTING = "KVGUARD_SELF_TESTING"
_seconds: dict[str, float] = {}
_pending: dict[str, tuple] = {}         # patch name -> (patch, version): self-test due
_listeners: list = []                    # fn(name, reason) when a deferred verdict lands
_verdicts: dict[str, str] = {}           # patch name -> reason ("" passed): deferred, here
#: their key in this process's entry of the counters' reply (:mod:`vllm_kvguard.remote`)
VERDICTS = "verdicts"


class SelfTestFailed(AssertionError):
    """A self-test saw vLLM or the fix behave otherwise than the patch needs."""


@dataclass
class Verdict:
    ok: bool
    reason: str = ""         # why not (empty when ok)
    stage: str = ""          # "drift" | "self-test" | "" (passed)
    cached: bool = False     # decided by an ancestor process
    pending: bool = False    # applied; its self-test runs where its target runs (:func:`due`)


def preflight(patch, version, modules=None) -> list[str]:
    """The drift guard at run time: missing names, then moved parameters (of the names in
    ``modules`` only, if given: see :func:`_names`)."""
    from vllm_kvguard.verify.signatures import signature_drift

    missing = patch.drift(version, modules)
    return missing or signature_drift(patch, version, modules)


def _key(version) -> str:
    try:
        import vllm
        where = os.path.dirname(getattr(vllm, "__file__", "") or "")
    except Exception:
        where = "?"
    return f"{version}@{where}@{socket.gethostname()}"


def _cached(version) -> dict:
    try:
        data = json.loads(os.environ.get(ENV_VERIFIED, "") or "{}")
    except ValueError:
        return {}
    return data.get("results", {}) if data.get("key") == _key(version) else {}


def _remember(version, name: str, reason: str) -> None:
    results = _cached(version)
    results[name] = reason or "ok"
    os.environ[ENV_VERIFIED] = json.dumps({"key": _key(version), "results": results})


def forget() -> None:
    """Drop the shared verdicts and the pending self-tests (tests, deactivation)."""
    os.environ.pop(ENV_VERIFIED, None)
    _seconds.clear()
    _pending.clear()
    _later.clear()
    _verdicts.clear()
    if "vllm_kvguard.remote" in sys.modules:
        sys.modules["vllm_kvguard.remote"].offer(VERDICTS, None)


def testing() -> bool:
    """Whether a self-test runs now (in this process: what vLLM builds meanwhile is the
    test's, not the engine's; in a process started meanwhile: nothing is tested)."""
    return bool(os.environ.get(ENV_TESTING))


def failed(name: str) -> str:
    """Why patch ``name``'s self-test failed in this process tree ("" if it did not)."""
    from vllm_kvguard.versions import vllm_version

    known = _cached(vllm_version()).get(name, "ok")
    return "" if known == "ok" else known


def seconds() -> dict[str, float]:
    """Seconds each self-test took in this process (absent: not run here)."""
    return dict(_seconds)


def run_check(name: str, **context) -> str:
    """Run patch ``name``'s self-test now (its patch applied); "" when it passed or it has
    none, else the reason. ``context``: what vLLM built where the target runs (the deferred
    self-tests build a stand-in without it: ``kvguard doctor``, tests)."""
    target = CHECKS.get(name)
    if target is None:
        return ""
    t0 = time.perf_counter()
    os.environ[ENV_TESTING] = name
    try:
        if callable(target):
            fn = target
        else:
            module, _, attr = target.partition(":")
            fn = getattr(importlib.import_module(module), attr)
        with log.quiet(), report.scratch():
            fn(**context)
        return ""
    except SelfTestFailed as exc:
        return str(exc)
    except Exception as exc:           # the test could not run on this vLLM: not proven
        return f"{type(exc).__name__}: {exc}"[:200]
    finally:
        os.environ.pop(ENV_TESTING, None)
        _seconds[name] = time.perf_counter() - t0


#: suffix of a patch's drift-guard verdict among the shared verdicts
NAMES = ":names"


def _names(patch, version) -> str:
    """The drift guard's reason ("" when it passes). Only the names of modules this
    process has loaded are checked now; the rest when vLLM imports their module
    (:func:`_check_at_import`), before any object of it exists: importing them here would
    cost the front end about 2 s for the model runner's few hundred modules. A failure,
    and a pass of every name, are shared with the processes started afterwards."""
    key = patch.name + NAMES
    known = _cached(version).get(key)
    if known is None:
        modules = patch.modules(version)
        loaded = {m for m in modules if m in sys.modules}
        missing = preflight(patch, version, loaded)
        known = "not in this vLLM: " + ", ".join(missing) if missing else ""
        if missing or loaded == modules:
            _remember(version, key, known)
        else:
            for module in modules - loaded:
                _check_at_import(module, patch, version)
    return "" if known == "ok" else known


_later: dict[str, list] = {}            # module -> [(patch, version)]: names still to check
_hooked: set[str] = set()               # modules with our post-import hook (never removed)


def _check_at_import(module: str, patch, version) -> None:
    _later.setdefault(module, []).append((patch, version))
    if module not in _hooked:
        _hooked.add(module)
        wrapt.register_post_import_hook(_imported, module)


def _imported(module) -> None:
    """A module with names still to check was imported: a patch missing one is reverted
    here (before vLLM builds anything from the module) and its verdict shared."""
    for patch, version in _later.pop(module.__name__, ()):
        try:
            missing = patch.applied and preflight(patch, version, {module.__name__})
            if missing:
                reason = "not in this vLLM: " + ", ".join(missing)
                _pending.pop(patch.name, None)
                _settle(patch, version, patch.name, reason)
                _offer(patch.name, reason)
        except Exception as exc:        # fail open, and never into vLLM's import
            log.logger.error("vllm-kvguard: patch %r reverted, internal error checking "
                             "%s (%s: %s)", patch.name, module.__name__,
                             type(exc).__name__, exc)
            patch.revert()


def verify(patch, version, apply) -> Verdict:
    """Drift guard, then ``apply()`` and the self-test; on failure the patch is reverted.
    ``apply``: applies the patch (raises like :meth:`Patch.apply`)."""
    drift = _names(patch, version)
    if drift:
        return Verdict(False, drift, "drift")
    if os.environ.get(ENV_TESTING):
        return Verdict(False, f"not verified: started during the {os.environ[ENV_TESTING]} "
                              "self-test of a parent process", "self-test")
    known = _cached(version).get(patch.name)
    if known is not None and known != "ok":
        return Verdict(False, known, "self-test", cached=True)
    apply()
    if known == "ok":
        return Verdict(True, cached=True)
    if patch.name in WHERE:
        _pending[patch.name] = (patch, version)
        return Verdict(True, pending=True)
    why = run_check(patch.name)
    if not patch.applied:       # a module its self-test imported lacks a name (_imported)
        return Verdict(False, _cached(version).get(patch.name) or why, "drift")
    reason = f"self-test failed: {why}" if why else ""
    _remember(version, patch.name, reason)
    if why:
        patch.revert()
        return Verdict(False, reason, "self-test")
    return Verdict(True)


def pending(name: str) -> bool:
    """Whether patch ``name`` is applied here with its self-test still due."""
    return name in _pending


def due(name: str, **context) -> bool:
    """Called by a deferred patch's wrappers before vLLM first uses its target in this
    process: runs its self-test once, on ``context`` (what vLLM built here); a failure
    reverts the patch. Returns whether the patch is still on (False: pass straight through).
    Free when nothing is due (inside the proven range: always)."""
    entry = _pending.pop(name, None)
    if entry is None:
        return True
    patch, version = entry
    if not patch.applied:                # reverted since (drift found at import)
        return False
    why = run_check(name, **context)
    reason = f"self-test failed: {why}" if why else ""
    _settle(patch, version, name, reason)
    _offer(name, reason)
    return not why


def _settle(patch, version, name: str, reason: str) -> None:
    _remember(version, name, reason)
    if reason:
        patch.revert()
    for listener in list(_listeners):
        listener(name, reason)


def _offer(name: str, reason: str) -> None:
    """The verdict in this process's entry of the counters' reply (JSON strings)."""
    from vllm_kvguard import process, remote

    _verdicts[name] = reason and f"{reason} (in {process.role()}, pid {os.getpid()})"
    remote.offer(VERDICTS, dict(_verdicts))


def heard(offers) -> None:
    """Verdicts other processes offer (``offers``: their :data:`VERDICTS` entries, raw):
    a patch still pending here whose self-test failed where it runs is turned off here
    too (the front end: no door without the engine's limits), with that process's reason.
    A pass changes nothing here (the patch stays applied; its verdict is logged where it
    ran)."""
    for raw in offers:
        if not isinstance(raw, dict):
            continue
        for name, reason in raw.items():
            if name in _pending and isinstance(reason, str) and reason:
                patch, version = _pending.pop(name)
                if patch.applied:
                    _settle(patch, version, name, reason[:300])


def on_verdict(listener) -> None:
    """``listener(name, reason)`` when a deferred self-test ends ("" reason: passed) or a
    name checked at import is missing."""
    if listener not in _listeners:
        _listeners.append(listener)


# --------------------------------------------------------------------------- proven range
#: the proven-releases table shipped with the package (written by scripts/matrix.py)
PROVEN_FILE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                           "proven.json")


def proven() -> dict | None:
    """The shipped proven-releases table (``truth_table.load``'s shape), or None."""
    try:
        with open(PROVEN_FILE) as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return None


def proven_range() -> str:
    """``0.27.1 to 0.34.0``: the releases the shipped table proves (else the patches'
    declared ranges)."""
    from packaging.version import InvalidVersion, Version

    pins = []
    for pin in (proven() or {}).get("pins", []):
        try:
            pins.append(Version(pin))
        except InvalidVersion:
            continue
    if pins:
        return f"{min(pins)} to {max(pins)}"
    from vllm_kvguard.patches import ALL_PATCHES

    return " | ".join(sorted({p.vllm_versions for p in ALL_PATCHES}))
