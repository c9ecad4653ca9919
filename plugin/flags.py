"""Environment flags. All of them use the ``KVGUARD`` prefix (never ``VLLM_``).

=============================  ==============================================================
``KVGUARD``                    ``1``/``on``: apply every patch that supports the installed vLLM.
                               unset, ``0``/``off``: apply nothing (no wrapper anywhere).
``KVGUARD_PATCHES``            comma list choosing patches by name (default: all of them);
                               ``-name`` entries turn one off (``-cudagraph``: all but it).
                               ``none`` applies no fix (useful with ``KVGUARD_FAULTS``).
``KVGUARD_FORCE``              ``1``: apply patches even outside their declared vLLM range.
``KVGUARD_AUDIT``              ``1``: verify the block pool's invariants after every step.
``KVGUARD_FAULTS``             test-only fault injection, e.g. ``every=7`` or
                               ``rate=0.1,seed=3,after=20``; ``phase=`` one of
                               :data:`FAULT_PHASES` (default ``allocator``). Loudly logged.
``KVGUARD_LIVENESS_STEPS``     steps a waiting request may stall before it is reported (default 64; never failed).
``KVGUARD_HEALTH_STALL_S``     seconds EngineCore may hold work without completing a step before
                               ``/health`` answers 503 (default 300; ``health`` patch).
``KVGUARD_ADMISSION``          ``0``/``off``: leave out the ``admission`` patch (requests that can
                               never fit are not refused at the door: vLLM's behaviour).
``KVGUARD_CUDAGRAPH_COMPLETE`` ``1``: extend CUDA-graph capture to every reachable decode shape;
                               ``force``: also extend an explicit user capture list.
=============================  ==============================================================

Bad values never raise: :func:`read_flags` returns them as ``errors`` (one clear line
each, naming the flag, the bad value and the valid choices) and the safe reading.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Mapping

ON = ("1", "on", "true", "yes")
OFF = ("", "0", "off", "false", "no")

#: Names a user may put in KVGUARD_PATCHES. ``faults`` is enabled by KVGUARD_FAULTS instead.
PATCH_NAMES = ("allocator", "warmup", "cudagraph", "admission", "containment", "health")

#: Where an injected fault fires: ``BlockPool.get_new_blocks``, the scheduler-side KV
#: connector's ``get_num_new_matched_tokens`` / ``update_state_after_alloc``, or a KV load
#: the worker reports failed (its blocks in ``invalid_block_ids``), or ``freeze``:
#: EngineCore's step blocks forever in ``Scheduler.update_from_output`` (a frozen step).
FAULT_PHASES = ("allocator", "lookup", "update", "load", "freeze")
#: KVGUARD_HEALTH_STALL_S's default: vLLM's own limit on one step
#: (``VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS``, 300), far above any step measured (docs/health.md).
HEALTH_STALL_S = 300.0


@dataclass(frozen=True)
class FaultSpec:
    """Where and when the injected fault fires: call numbers are counted per process."""

    every: int = 0          # raise on every Nth call (0: use rate)
    rate: float = 0.0       # or with this probability
    seed: int = 0
    after: int = 0          # never during the first N calls
    limit: int = 0          # at most this many faults (0: no limit)
    phase: str = "allocator"  # one of FAULT_PHASES


@dataclass(frozen=True)
class Flags:
    enabled: bool = False
    patches: tuple[str, ...] = PATCH_NAMES
    force: bool = False
    audit: bool = False
    faults: FaultSpec | None = None
    liveness_steps: int = 64
    health_stall_s: float = HEALTH_STALL_S
    cudagraph_complete: bool = False
    cudagraph_complete_force: bool = False
    errors: tuple[str, ...] = field(default_factory=tuple)


def _bool(env: Mapping[str, str], name: str, errors: list[str]) -> bool:
    raw = env.get(name, "")
    val = raw.strip().lower()
    if val in ON:
        return True
    if val not in OFF:
        errors.append(f"{name}={raw!r} is not valid; use one of 1, on, 0, off "
                      f"(unset means off); treating it as off")
    return False


def parse_faults(raw: str) -> FaultSpec:
    """Parse ``every=N`` / ``rate=P[,seed=S]`` (+ ``after=N``, ``limit=N``, ``phase=P``);
    raise ValueError."""
    valid = ("every", "rate", "seed", "after", "limit", "phase")
    values: dict = {}
    for part in filter(None, (p.strip() for p in raw.split(","))):
        key, sep, val = part.partition("=")
        key = key.strip()
        if not sep or key not in valid:
            raise ValueError(f"KVGUARD_FAULTS: {part!r} is not key=value with a key in "
                             f"{', '.join(valid)} (example: every=7 or rate=0.1,seed=3)")
        if key == "phase":
            if val.strip() not in FAULT_PHASES:
                raise ValueError(f"KVGUARD_FAULTS: phase={val!r} is not valid; use one of "
                                 f"{', '.join(FAULT_PHASES)}")
            values[key] = val.strip()
            continue
        try:
            values[key] = float(val) if key == "rate" else int(val)
        except ValueError:
            raise ValueError(f"KVGUARD_FAULTS: {key}={val!r} is not a number") from None
    spec = FaultSpec(**values)
    if spec.every < 0 or not 0.0 <= spec.rate <= 1.0 or spec.after < 0 or spec.limit < 0:
        raise ValueError(f"KVGUARD_FAULTS={raw!r}: need every>=0, 0<=rate<=1, after>=0, limit>=0")
    if not spec.every and not spec.rate:
        raise ValueError(f"KVGUARD_FAULTS={raw!r} never fires; set every=N or rate=P")
    return spec


def read_flags(env: Mapping[str, str] | None = None) -> Flags:
    env = os.environ if env is None else env
    errors: list[str] = []
    enabled = _bool(env, "KVGUARD", errors)
    if errors:
        errors[-1] = errors[-1].replace("treating it as off", "vllm-kvguard stays off")

    patches: tuple[str, ...] = PATCH_NAMES
    raw = chosen = env.get("KVGUARD_PATCHES")
    if raw is not None:
        names = [n.strip().lower() for n in raw.split(",") if n.strip()]
        off = [n[1:].strip() for n in names if n.startswith("-")]
        names = [n for n in names if not n.startswith("-")]
        if names == ["none"]:
            patches = ()
        else:
            bad = [n for n in names + off if n not in PATCH_NAMES]
            if names or not off:
                patches = tuple(n for n in PATCH_NAMES if n in names)
            patches = tuple(n for n in patches if n not in off)
            if bad or not (names or off):
                errors.append(
                    f"KVGUARD_PATCHES={raw!r}: unknown patch name(s) {', '.join(bad) or '(empty)'}; "
                    f"valid: {', '.join(PATCH_NAMES)} (-name: all but it), or none; applying: "
                    f"{', '.join(patches) or 'none'}")

    raw = env.get("KVGUARD_ADMISSION", "").strip().lower()
    if raw and raw in OFF:
        patches = tuple(n for n in patches if n != "admission")
    elif raw and raw not in ON:
        errors.append(f"KVGUARD_ADMISSION={raw!r} is not valid; use one of 1, on, 0, off "
                      f"(unset means on); leaving admission as KVGUARD_PATCHES chose")
    if chosen is not None and "admission" in patches and "warmup" not in patches:
        errors.append(f"KVGUARD_PATCHES={chosen!r}: admission without warmup refuses nothing "
                      f"(EngineCore publishes the door's limits as the warmup patch's "
                      f"Scheduler.__init__ wrapper ends); add warmup, e.g. "
                      f"KVGUARD_PATCHES=warmup,admission")

    faults = None
    raw = env.get("KVGUARD_FAULTS", "").strip()
    if raw and not enabled:
        errors.append(f"KVGUARD_FAULTS={raw!r} does nothing while KVGUARD is off; set "
                      f"KVGUARD=1 (with KVGUARD_PATCHES=none to see vLLM without the fixes)")
    elif raw:
        try:
            faults = parse_faults(raw)
        except ValueError as exc:
            errors.append(f"{exc}; fault injection stays off")

    liveness = 64
    raw = env.get("KVGUARD_LIVENESS_STEPS", "").strip()
    if raw:
        try:
            liveness = int(raw)
            if liveness < 1:
                raise ValueError
        except ValueError:
            errors.append(f"KVGUARD_LIVENESS_STEPS={raw!r} is not a whole number >= 1; using 64")
            liveness = 64

    stall = HEALTH_STALL_S
    raw = env.get("KVGUARD_HEALTH_STALL_S", "").strip()
    if raw:
        try:
            stall = float(raw)
            if not 1.0 <= stall < float("inf"):
                raise ValueError
        except ValueError:
            errors.append(f"KVGUARD_HEALTH_STALL_S={raw!r} is not a number of seconds >= 1; "
                          f"using {HEALTH_STALL_S:.0f}")
            stall = HEALTH_STALL_S

    complete = env.get("KVGUARD_CUDAGRAPH_COMPLETE", "").strip().lower()
    complete_force = complete == "force"
    if complete_force:
        env = {**env, "KVGUARD_CUDAGRAPH_COMPLETE": "1"}
    elif complete and complete not in ON + OFF:
        errors.append(f"KVGUARD_CUDAGRAPH_COMPLETE={complete!r} is not valid; use one of 1, on, "
                      f"force, 0, off (unset means off); treating it as off")
        env = {**env, "KVGUARD_CUDAGRAPH_COMPLETE": "0"}

    return Flags(
        enabled=enabled,
        patches=patches,
        force=_bool(env, "KVGUARD_FORCE", errors),
        audit=_bool(env, "KVGUARD_AUDIT", errors),
        faults=faults,
        liveness_steps=liveness,
        health_stall_s=stall,
        cudagraph_complete=_bool(env, "KVGUARD_CUDAGRAPH_COMPLETE", errors),
        cudagraph_complete_force=complete_force,
        errors=tuple(errors),
    )
