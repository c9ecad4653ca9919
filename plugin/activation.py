"""What the entry point does: read flags, apply the chosen patches, log one report line."""
from __future__ import annotations

import multiprocessing
import sys
import threading

from vllm_kvguard import __version__, process
from vllm_kvguard.flags import Flags, read_flags
from vllm_kvguard.log import logger

_lock = threading.Lock()
_state: dict = {"flags": None, "results": None, "driver": False}


def flags() -> Flags:
    """The flags this process was activated with (read fresh if not activated)."""
    return _state["flags"] or read_flags()


def results() -> dict[str, str] | None:
    """{patch name: "applied" | "skipped: why"} for this process, or None if inactive."""
    return _state["results"]


def activate(env=None) -> dict[str, str] | None:
    """Apply the patches the flags select. Idempotent; never raises."""
    with _lock:
        if _state["results"] is not None:
            return _state["results"]
        fl = read_flags(env)
        for err in fl.errors:            # once per process tree, not once per process
            if process.first_in_tree("flag:" + err[:60]):
                logger.warning("vllm-kvguard: %s", err)
        if not fl.enabled:
            _compare_with_driver([])
            return None
        _state["flags"] = fl
        from vllm_kvguard.patches import select_patches
        from vllm_kvguard.versions import vllm_version

        version = vllm_version()
        if version is None:                  # one line, not one per patch
            logger.warning("vllm-kvguard: vLLM is not installed; nothing to patch")
            _state["results"] = {p.name: "skipped: vLLM is not installed"
                                 for p in select_patches(fl)}
            return _state["results"]
        chosen = select_patches(fl)
        res: dict[str, str] = {}
        # fault injection last: self-tests must not meet (nor count) injected faults
        for patch in sorted(chosen, key=lambda p: p.name == "faults"):
            res[patch.name] = _apply_one(patch, version, fl)
        res = {p.name: res[p.name] for p in chosen}
        _state["results"] = res
        if any(r.startswith("applied") for r in res.values()):
            _export_metrics()
        logger.info("%s", startup_line(version, res))
        logger.debug("vllm-kvguard: %d targets wrapped, %d more when vLLM loads their module; "
                     "%s", len(wrapped_targets()), pending_targets(), declared_changes())
        _warn_outside_range(version, res, chosen)
        _compare_with_driver([n for n, r in res.items() if r.startswith("applied")])
        return res


def _compare_with_driver(applied: list[str]) -> None:
    """The first process to activate publishes its patches; the others compare (one
    warning when they differ: a worker on a node whose KVGUARD* variables differ)."""
    try:
        if applied and process.publish(applied):
            _state["driver"] = True
        elif (msg := process.mismatch(applied)) is not None:
            logger.warning("%s", msg)
    except Exception as exc:  # fail open: the comparison is a diagnosis only
        logger.warning("vllm-kvguard: driver comparison off (%s: %s)", type(exc).__name__, exc)


def _export_metrics() -> None:
    """Counters of every patch on vLLM's own ``/metrics`` (vllm_kvguard.metrics)."""
    try:
        from vllm_kvguard import metrics, report

        kind = process.kind()
        metrics.setup()
        report.set_gauge("active_processes", {kind: 1})
    except Exception as exc:  # fail open: metrics are a view, never a reason to stop
        logger.warning("vllm-kvguard: metrics export off (%s: %s)", type(exc).__name__, exc)


def _apply_one(patch, version, fl: Flags) -> str:
    if not patch.targets_in(version):
        return f"skipped: none of its targets is in vLLM {version}"
    try:
        if patch.supports(version) or fl.force:
            notes = patch.apply(fl)
        else:                                  # outside its range: it proves itself first
            from vllm_kvguard import verify

            box: list = []
            verdict = verify.verify(patch, version, lambda: box.append(patch.apply(fl)))
            if not verdict.ok:
                logger.info("vllm-kvguard: patch %r skipped: %s", patch.name, verdict.reason)
                return f"skipped: {verdict.reason}"
            verify.on_verdict(_settled)    # a deferred self-test or drift check may end it
            return (PENDING if verdict.pending else "applied (verified)") + \
                (f" [{'; '.join(box[0])}]" if box and box[0] else "")
    except LookupError as exc:
        logger.warning("vllm-kvguard: patch %r skipped: %s", patch.name, exc)
        return f"skipped: {exc}"
    except Exception as exc:  # fail open: leave vLLM unpatched for this patch
        patch.revert()
        logger.error("vllm-kvguard: patch %r not applied, internal error (%s: %s); "
                     "vLLM runs without it", patch.name, type(exc).__name__, exc)
        return f"skipped: internal error {type(exc).__name__}"
    forced = "" if patch.supports(version) else " (forced outside its range)"
    return "applied" + forced + (f" [{'; '.join(notes)}]" if notes else "")


#: a patch applied with its self-test still to run where its target runs (verify.WHERE)
PENDING = "applied (self-test where it runs)"


def _settled(name: str, reason: str) -> None:
    """A deferred self-test ended in this process: its result, one line."""
    from vllm_kvguard import verify

    res = _state["results"]
    if res is not None and name in res:
        res[name] = f"skipped: {reason}" if reason else "applied (verified)"
    where = process.role()
    if reason:
        logger.warning("vllm-kvguard: patch %r off in %s: %s", name, where, reason)
    else:
        logger.info("vllm-kvguard: %s self-test passed in %s (%.2f s)", name, where,
                    verify.seconds().get(name, 0.0))


def wrapped_targets() -> list[str]:
    """The host targets that carry a vllm-kvguard wrapper in this process right now.

    Checked on the live objects (not our bookkeeping), so tests can ask any process,
    e.g. workers through ``LLM.collective_rpc``.
    """
    if "vllm_kvguard.patches" not in sys.modules:     # never activated here: nothing to find
        return []
    from vllm_kvguard.patches import ALL_PATCHES
    from vllm_kvguard.registry import is_wrapped, resolve

    found = []
    for patch in ALL_PATCHES:
        for target in patch.targets_in():
            if target.module not in sys.modules:     # not loaded: cannot be wrapped yet
                continue
            resolved = resolve(target.module, target.qualname)
            if resolved is not None and is_wrapped(resolved[2]):
                found.append(target.name)
    return found


#: the always-on part: carries the flags to Ray workers, brings counters back
ALWAYS_ON = "distributed"
LINE_LIMIT = 199


def _short(reason: str) -> str:
    r = reason[len("skipped: "):] if reason.startswith("skipped: ") else reason
    for key, short in (("self-test failed", "self-test failed"), ("not in this vLLM", "drift"),
                       ("missing", "targets missing"), ("none of its targets", "no targets"),
                       ("outside", "outside its range"), ("internal error", "internal error")):
        if key in r:
            return short
    return r[:30]


def startup_line(version, res: dict[str, str]) -> str:
    """One line under 200 characters: who speaks, vLLM, the fixes on and off (with why)."""
    from vllm_kvguard.flags import PATCH_NAMES

    applied = [n for n, r in res.items() if r.startswith("applied") and n != ALWAYS_ON]
    fixes = [n for n in applied if n != "faults"]
    off = [(n, _short(r)) for n, r in res.items() if not r.startswith("applied")
           and n != ALWAYS_ON]
    off += [(n, "not chosen") for n in PATCH_NAMES if n not in res]
    verified = any("verified" in res[n] for n in applied)
    proc = multiprocessing.current_process().name
    head = (f"vllm-kvguard {__version__} {'active' if fixes else 'inactive'} in {proc} "
            f"({process.describe()}), vLLM {version}: ")
    pending = any(r.startswith(PENDING) for r in res.values())
    on = ", ".join(n + ("*" if "verified" in res[n] else "+" if res[n].startswith(PENDING)
                        else "") for n in applied) or "no fix"
    always = res.get(ALWAYS_ON, "")
    tail = (f"; {ALWAYS_ON} always on" if always.startswith("applied") else "") + \
        ("; *verified here" if verified else "") + \
        ("; +self-test where it runs" if pending else "")
    by_why: dict[str, list[str]] = {}
    for n, why in off:
        by_why.setdefault(why, []).append(n)
    for detail in (True, False):
        offs = "; ".join(f"{', '.join(ns)} ({why})" if detail else ", ".join(ns)
                         for why, ns in by_why.items())
        line = head + f"on: {on}" + (f"; off: {offs}" if off else "") + tail
        if len(line) <= LINE_LIMIT:
            return line
    return line[:LINE_LIMIT - 3] + "..."


def _warn_outside_range(version, res: dict[str, str], chosen) -> None:
    """Outside a chosen patch's proven range: one WARNING per process tree."""
    outside = [p for p in chosen if not p.supports(version)]
    if not outside or flags().force or not process.first_in_tree(f"release:{version}"):
        return
    from vllm_kvguard.verify import proven_range

    ok = [p.name for p in outside if res.get(p.name, "").startswith("applied")
          and not res[p.name].startswith(PENDING)]
    later = [p.name for p in outside if res.get(p.name, "").startswith(PENDING)]
    bad = [f"{p.name} ({res[p.name][len('skipped: '):]})" for p in outside
           if not res.get(p.name, "").startswith("applied")]
    logger.warning(
        "vllm-kvguard: vLLM %s is outside the proven range %s; verified on it and applied: "
        "%s;%s not applied: %s. Run `kvguard doctor` for details; upgrade vllm-kvguard or "
        "pin vLLM to a proven release to be covered (KVGUARD_FORCE=1 applies unchecked).",
        version, proven_range(), ", ".join(ok) or "none",
        f" self-test where its target runs: {', '.join(later)};" if later else "",
        "; ".join(bad) or "none")


def declared_changes() -> str:
    """The run-time changes the applied patches may make, by kind (the registry's view)."""
    from collections import Counter

    from vllm_kvguard.patches import ALL_PATCHES

    kinds = Counter(c.kind for p in ALL_PATCHES if p.applied for c in p.changes)
    if not kinds:
        return "no run-time changes declared"
    return "run-time changes declared: " + ", ".join(
        f"{n} {kind}{'s' if n > 1 else ''}" for kind, n in sorted(kinds.items()))


def unwrapped_loaded_targets() -> list[str]:
    """Targets of applied patches that exist in a loaded module but carry no wrapper
    (should be empty: a wrap that did not happen)."""
    from vllm_kvguard.patches import ALL_PATCHES
    from vllm_kvguard.registry import is_wrapped, resolve

    wrong = []
    for patch in ALL_PATCHES:
        if not patch.applied:
            continue
        for target in patch.targets_in():
            if target.module in sys.modules:
                resolved = resolve(target.module, target.qualname)
                if resolved is not None and not is_wrapped(resolved[2]):
                    wrong.append(target.name)
    return wrong


def pending_targets() -> int:
    """Targets of applied patches whose module this process has not imported (yet)."""
    from vllm_kvguard.patches import ALL_PATCHES

    return sum(1 for p in ALL_PATCHES if p.applied
               for t in p.targets_in() if t.module not in sys.modules)


def deactivate() -> None:
    """Revert every patch this process applied (tests, uninstrument)."""
    from vllm_kvguard.patches import ALL_PATCHES

    with _lock:
        for patch in ALL_PATCHES:
            patch.revert()
        if "vllm_kvguard.metrics" in sys.modules:
            sys.modules["vllm_kvguard.metrics"].teardown()
        if _state["driver"]:
            process.unpublish()
        process.forget_noted()
        if "vllm_kvguard.verify" in sys.modules:
            sys.modules["vllm_kvguard.verify"].forget()
        _state.update(flags=None, results=None, driver=False)
