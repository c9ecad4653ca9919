"""Runtime CUDA-graph fallback accounting: no eager fallback is silent.

Every dispatch that runs eager (``NONE``) or ``PIECEWISE`` for a batch the configuration
meant to graph is counted by reason (``report.count("cudagraph_fallback", reason)``,
exported as ``kvguard_cudagraph_fallbacks_total{reason=...}`` by
:mod:`vllm_kvguard.metrics`); the first of each reason logs one warning naming the fix.

Reasons (:data:`REASONS`)
    ``over_max_capture_size``        a uniform decode wider than ``max_cudagraph_capture_size``
    ``non_uniform_drafts``           a decode-only batch whose requests carry different draft
                                     counts (ngram/suffix misses, drafts cut near max_tokens)
    ``not_captured_for_draft_length`` no graph for this size at this draft length (dynamic-SD
                                     tier, zero-draft step, a hole in an explicit size list)
    ``lora``                         the LoRA case has no graph where the non-LoRA one has
    ``dp_sync_forced``               another data-parallel rank ran eager, so this one did
    ``graphs_released``              graphs were released (elastic EP) and not recaptured

Where, and what it costs
    Nothing is wrapped at class level on the hot path. After a non-profile
    ``capture_model`` the runner's own graph owner (V1 ``CudagraphDispatcher``, V2
    ``CudaGraphManager``) gets an instance attribute ``dispatch``: a closure with the
    host's exact signature that calls the bound original and compares the returned mode
    with the intended one (one identity test). Only a batch that did not get the intended
    mode takes the slow path (classification, hook call). Owners whose mode is ``NONE``
    (the CPU backend, ``enforce_eager``) get nothing. V1 does not pass the batch shape to
    ``dispatch``; for a non-uniform batch the slow path reads ``num_reqs`` and
    ``max_num_scheduled_tokens`` from the caller frame
    (``GPUModelRunner._determine_batch_execution_and_padding``, matched by code object).
    ``benchmarks/bench_dispatch.py`` measures the closure against the bare dispatcher.
Suspend / resume
    ``Worker.sleep`` suspends (closures removed), ``Worker.wake_up`` resumes: each record
    is re-validated against its owner (same owner object, graphs still there) and
    re-installed, or released with one warning if that fails; the next capture re-arms.
"""
from __future__ import annotations

import inspect
import logging
import sys
import weakref

from vllm_kvguard.hookspecs import hookimpl
from vllm_kvguard.log import logger, once

CATEGORY = "cudagraph_fallback"
REASONS = ("over_max_capture_size", "non_uniform_drafts", "not_captured_for_draft_length",
           "lora", "dp_sync_forced", "graphs_released")

FIXES = {
    "over_max_capture_size":
        "capture wider graphs: set compilation_config max_cudagraph_capture_size to at least "
        "max_num_seqs x (1 + num_speculative_tokens), or KVGUARD_CUDAGRAPH_COMPLETE=1 (the "
        "startup coverage table names the exact value)",
    "non_uniform_drafts":
        "requests carried different draft counts; cudagraph_mode=FULL_AND_PIECEWISE runs "
        "such steps PIECEWISE instead of eager, a drafter that always proposes "
        "num_speculative_tokens keeps them uniform",
    "not_captured_for_draft_length":
        "no graph for this batch size at this draft length: see the startup coverage table "
        "for the capture sizes that cover it, or set KVGUARD_CUDAGRAPH_COMPLETE=1",
    "lora":
        "LoRA batches have no graph for this adapter count: keep cudagraph_specialize_lora "
        "on (the default) and check max_loras",
    "dp_sync_forced":
        "another data-parallel rank ran eager this step, so every rank did: fix that rank's "
        "own fallback reason (its log and metrics)",
    "graphs_released":
        "CUDA graphs were released (elastic EP reconfigure) and not captured again yet; "
        "steps run eager until capture_model runs",
}

#: Set while at least one owner is armed (read by the DP-sync wrapper's fast path).
ARMED = False
_records: dict[int, "_Record"] = {}


class _Record:
    """One armed graph owner: what it intends and how to classify a miss."""

    def __init__(self, owner, runner, adapter):
        self.owner_ref = weakref.ref(owner)
        self.runner_ref = weakref.ref(runner) if runner is not None else (lambda: None)
        self.kind = adapter.kind
        self.mode = adapter.mode
        self.best = adapter.intended()
        self.qs = frozenset(adapter.query_lens())
        self.qmax = max(self.qs)
        self.max_size = adapter.max_capture_size
        self.max_num_reqs = int(adapter.vllm_config.scheduler_config.max_num_seqs)
        self.max_decode_tokens = self.max_num_reqs * self.qmax
        self.graphs = adapter.num_graphs()
        self.orig = type(owner).dispatch.__get__(owner, type(owner))
        self.caller_code = _caller_code(runner) if self.kind == "V1" else None
        self.closure = None
        self.tail = 0                 # V2 dispatch's params after num_active_loras:
        #                               0.27.1 none, 0.29 max_query_len, 0.32+ num_ubatches too
        self.suspended = False


# ----------------------------------------------------------------------------- arming
def arm(runner, adapter) -> bool:
    """Install the counting ``dispatch`` on ``adapter.obj`` (a graph owner of ``runner``).

    Returns False (and installs nothing) when the owner intends no graph, or its
    ``dispatch`` signature is not one this module knows (logged once).
    """
    global ARMED
    owner = adapter.obj
    if adapter.intended() == _none():
        return False
    old = _records.pop(id(owner), None)
    if old is not None:
        _uninstall(old)
    rec = _Record(owner, runner, adapter)
    make = _V1_SIGNATURES.get(_params(type(owner).dispatch)) if rec.kind == "V1" else \
        _V2_SIGNATURES.get(_params(type(owner).dispatch))
    if make is None:
        once(logging.WARNING, ("fallback_signature", rec.kind),
             "vllm-kvguard: CUDA-graph fallback accounting is off for model runner %s: its "
             "dispatch() signature %s is not one this version of vllm-kvguard knows",
             rec.kind, _params(type(owner).dispatch))
        return False
    if rec.kind == "V1" and rec.caller_code is None:
        once(logging.INFO, ("fallback_ragged_v1",),
             "vllm-kvguard: V1 ragged-draft batches cannot be told from prefills on this "
             "vLLM; they are not counted (other fallback reasons are)")
    rec.tail = {_make_v2: 2, _make_v2_029: 1}.get(make, 0)
    rec.closure = make(rec)
    _records[id(owner)] = rec
    _install(rec)
    ARMED = True
    return True


def _install(rec: _Record) -> None:
    owner = rec.owner_ref()
    if owner is not None:
        owner.dispatch = rec.closure
        rec.suspended = False


def _uninstall(rec: _Record) -> None:
    owner = rec.owner_ref()
    if owner is not None and owner.__dict__.get("dispatch") is rec.closure:
        del owner.__dict__["dispatch"]


def disarm_all() -> None:
    """Remove every counting closure (patch teardown, tests)."""
    global ARMED
    for rec in list(_records.values()):
        _uninstall(rec)
    _records.clear()
    ARMED = False


def armed_owners() -> list:
    return [o for o in (r.owner_ref() for r in _records.values() if not r.suspended) if o]


def _params(fn) -> tuple[str, ...]:
    try:
        return tuple(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return ()


def _none():
    from vllm.config import CUDAGraphMode

    return CUDAGraphMode.NONE


def _caller_code(runner):
    """The code object of the V1 runner method that calls ``dispatch`` with the batch shape."""
    fn = getattr(type(runner), "_determine_batch_execution_and_padding", None) if runner else None
    fn = inspect.unwrap(fn) if fn is not None else None
    code = getattr(fn, "__code__", None)
    if code is None or not {"num_reqs", "max_num_scheduled_tokens"} <= set(code.co_varnames):
        return None
    return code


# ----------------------------------------------------------------------------- closures
def _make_v1(rec: _Record):
    orig, best, slow = rec.orig, rec.best, _v1_slow

    def dispatch(num_tokens, uniform_decode=False, has_lora=False, num_active_loras=0,
                 valid_modes=None, invalid_modes=None):
        result = orig(num_tokens, uniform_decode, has_lora, num_active_loras, valid_modes,
                      invalid_modes)
        if result[0] is not best:
            slow(rec, result[0], num_tokens, uniform_decode, has_lora, num_active_loras,
                 valid_modes, invalid_modes)
        return result

    return dispatch


def _make_v2(rec: _Record):
    orig, best, slow = rec.orig, rec.best, _v2_slow

    def dispatch(num_reqs, num_tokens, uniform_token_count, num_active_loras,
                 max_query_len=None, num_ubatches=1):
        desc = orig(num_reqs, num_tokens, uniform_token_count, num_active_loras, max_query_len,
                    num_ubatches)
        if desc.cg_mode is not best and max_query_len is not None:
            slow(rec, desc.cg_mode, num_reqs, num_tokens, uniform_token_count,
                 num_active_loras, max_query_len, num_ubatches)
        return desc

    return dispatch


def _make_v2_029(rec: _Record):
    """0.29: ``dispatch(num_reqs, num_tokens, uniform_token_count, num_active_loras,
    max_query_len=None)``."""
    orig, best, slow = rec.orig, rec.best, _v2_slow

    def dispatch(num_reqs, num_tokens, uniform_token_count, num_active_loras,
                 max_query_len=None):
        desc = orig(num_reqs, num_tokens, uniform_token_count, num_active_loras, max_query_len)
        if desc.cg_mode is not best and max_query_len is not None:
            slow(rec, desc.cg_mode, num_reqs, num_tokens, uniform_token_count,
                 num_active_loras, max_query_len, 1)
        return desc

    return dispatch


def _make_v2_027(rec: _Record):
    """0.27.1: ``dispatch(num_reqs, num_tokens, uniform_token_count, num_active_loras)``."""
    orig, best, slow = rec.orig, rec.best, _v2_slow

    def dispatch(num_reqs, num_tokens, uniform_token_count, num_active_loras):
        desc = orig(num_reqs, num_tokens, uniform_token_count, num_active_loras)
        if desc.cg_mode is not best and uniform_token_count is not None:
            slow(rec, desc.cg_mode, num_reqs, num_tokens, uniform_token_count,
                 num_active_loras, None, 1)
        return desc

    return dispatch


_V1_SIGNATURES = {("self", "num_tokens", "uniform_decode", "has_lora", "num_active_loras",
                   "valid_modes", "invalid_modes"): _make_v1}
_V2_SIGNATURES = {
    ("self", "num_reqs", "num_tokens", "uniform_token_count", "num_active_loras",
     "max_query_len", "num_ubatches"): _make_v2,
    ("self", "num_reqs", "num_tokens", "uniform_token_count", "num_active_loras",
     "max_query_len"): _make_v2_029,
    ("self", "num_reqs", "num_tokens", "uniform_token_count", "num_active_loras"): _make_v2_027,
}


# ----------------------------------------------------------------------------- slow paths
def _caller_locals(rec: _Record) -> dict | None:
    """Locals of the V1 runner frame that called ``dispatch`` (None if not found)."""
    code = rec.caller_code
    if code is None:
        return None
    frame = sys._getframe(3)             # _caller_locals <- _v1_slow <- closure <- caller
    for _ in range(4):
        if frame is None:
            return None
        if frame.f_code is code:
            return frame.f_locals
        frame = frame.f_back
    return None


def _v1_slow(rec, mode, num_tokens, uniform_decode, has_lora, num_active_loras,
             valid_modes, invalid_modes) -> None:
    try:
        if invalid_modes:          # encoder outputs / fast-prefill logits: FULL excluded by design
            return
        none = _none()
        if valid_modes is not None:
            # A DP re-dispatch with the agreed mode, or a forced-eager (profile/dummy) run.
            if mode is not none or set(valid_modes) != {none}:
                return
            ctx = _caller_locals(rec)
            if ctx is None or ctx.get("force_eager"):
                return
            local = ctx.get("num_tokens", num_tokens)
            wanted = rec.orig(local, uniform_decode, has_lora, num_active_loras)[0]
            if wanted is not none:
                _report(rec, "dp_sync_forced", mode, num_tokens,
                        f"this rank's batch ({local} tokens) would have run {wanted.name}")
            return
        if uniform_decode:
            q = min(rec.qs)
            reason = _uniform_reason(rec, mode, num_tokens, has_lora,
                                     lambda: rec.orig(num_tokens, True, False, 0)[0])
            _report(rec, reason, mode, num_tokens,
                    f"uniform decode of {num_tokens // q} requests x {q} tokens")
            return
        if num_tokens > rec.max_decode_tokens:
            return
        ctx = _caller_locals(rec)
        if ctx is None:
            return
        num_reqs, widest = ctx.get("num_reqs"), ctx.get("max_num_scheduled_tokens")
        if num_reqs is None or widest is None or widest > rec.qmax or num_tokens > num_reqs * widest:
            return                     # a prefill chunk wider than a decode step
        _report(rec, "non_uniform_drafts", mode, num_tokens,
                f"decode of {num_reqs} requests with 1..{widest} tokens each "
                f"({num_tokens} tokens; uniform decode is {rec.qmax} per request)")
    except Exception as exc:
        _trip(rec, exc)


def _v2_slow(rec, mode, num_reqs, num_tokens, uniform_token_count, num_active_loras,
             max_query_len, num_ubatches) -> None:
    try:
        if num_ubatches != 1 or num_reqs > rec.max_num_reqs:
            return
        u = uniform_token_count
        if rec.tail:                     # the runner passes max_query_len=None with a prefill
            if max_query_len is None or max_query_len > rec.qmax:
                return
        elif u is None or u > rec.qmax:  # 0.27.1: only uniform batches can be told apart
            return
        owner = rec.owner_ref()
        if owner is None:
            return
        if not getattr(owner, "_graphs_captured", True):
            reason = "graphs_released"
        elif u is None:
            reason = "non_uniform_drafts"
        elif u not in rec.qs:
            reason = "not_captured_for_draft_length"
        else:
            def unlora():
                args = (num_reqs, num_tokens, u, 0) + (max_query_len, num_ubatches)[:rec.tail]
                return rec.orig(*args).cg_mode
            reason = _uniform_reason(rec, mode, num_tokens, num_active_loras > 0, unlora)
        shape = f"{u} tokens each" if u is not None else f"1..{max_query_len} tokens each"
        _report(rec, reason, mode, num_tokens, f"decode of {num_reqs} requests, {shape}")
    except Exception as exc:
        _trip(rec, exc)


def _uniform_reason(rec, mode, num_tokens, has_lora, without_lora) -> str:
    if has_lora and without_lora() is rec.best:
        return "lora"
    if num_tokens > rec.max_size:
        return "over_max_capture_size"
    return "not_captured_for_draft_length"


def after_dp_sync(args: tuple, kwargs: dict, result) -> None:
    """``dispatch_cg_and_sync_dp`` returned with a DP sync: count a rank forced eager."""
    try:
        desc = result[0]
        none = _none()
        if desc.cg_mode is not none:
            return
        bound = _bind_dp(args, kwargs)
        if bound.get("need_eager") or getattr(bound.get("dp_sync_state"), "eager", False):
            return
        manager = bound.get("cudagraph_manager")
        rec = _records.get(id(manager)) if manager is not None else None
        if rec is None or rec.suspended:
            return
        local = (bound["num_reqs"], bound["num_tokens"], bound["uniform_token_count"],
                 bound.get("num_active_loras", 0))
        local += (bound.get("max_query_len"), 1)[:rec.tail]
        wanted = rec.orig(*local).cg_mode
        if wanted is not none:
            _report(rec, "dp_sync_forced", none, bound["num_tokens"],
                    f"this rank's batch would have run {wanted.name}")
    except Exception as exc:
        once(logging.ERROR, ("internal", "cudagraph_dp"),
             "vllm-kvguard: internal error in DP fallback accounting (%s: %s); DP-forced "
             "fallbacks are no longer counted", type(exc).__name__, exc)


_dp_signature: list = []


def _bind_dp(args, kwargs) -> dict:
    if not _dp_signature:
        from vllm.v1.worker.gpu import dp_utils

        fn = inspect.unwrap(dp_utils.dispatch_cg_and_sync_dp)
        _dp_signature.append(inspect.signature(fn))
    bound = _dp_signature[0].bind(*args, **kwargs)
    return dict(bound.arguments)


# ----------------------------------------------------------------------------- reporting
def _report(rec, reason, mode, num_tokens, detail) -> None:
    from vllm_kvguard.manager import hook

    hook().kvguard_cudagraph_fallback(owner=rec.owner_ref(), reason=reason, mode=mode.name,
                                      num_tokens=num_tokens, detail=detail)


def _trip(rec: _Record, exc: Exception) -> None:
    """Fail open: an internal error removes this owner's counting closure."""
    _records.pop(id(rec.owner_ref()), None)
    _uninstall(rec)
    once(logging.ERROR, ("internal", "cudagraph_fallback"),
         "vllm-kvguard: internal error in CUDA-graph fallback accounting (%s: %s); counting "
         "is off for this model runner, vLLM's dispatch is unchanged", type(exc).__name__, exc)


@hookimpl
def kvguard_cudagraph_fallback(owner, reason, mode, num_tokens, detail):
    from vllm_kvguard import metrics, report

    report.count(CATEGORY, reason)
    metrics.changed()
    once(logging.WARNING, (CATEGORY, reason),
         "vllm-kvguard: a batch the CUDA-graph configuration meant to graph ran %s (%s: %s). "
         "Fix: %s. Counted in kvguard_cudagraph_fallbacks_total{reason=\"%s\"}; this warning "
         "is logged once per reason", "eager" if mode == "NONE" else mode, reason, detail,
         FIXES.get(reason, "see the startup coverage table"), reason)


# ----------------------------------------------------------------------------- hookimpls
@hookimpl
def kvguard_cudagraph_captured(runner, profile_only):
    if profile_only:
        return
    from vllm_kvguard.fixes.coverage import owner_of

    adapter = owner_of(runner)
    if adapter is not None:
        arm(runner, adapter)


def _records_of(worker) -> list[_Record]:
    runner = getattr(worker, "model_runner", None)
    return [r for r in _records.values() if runner is None or r.runner_ref() is runner]


@hookimpl
def kvguard_cudagraph_reinit(worker, phase, error):
    if phase == "suspend":
        for rec in _records_of(worker):
            _uninstall(rec)
            rec.suspended = True
        return
    for rec in [r for r in _records_of(worker) if r.suspended]:
        why = _still_valid(rec) if error is None else f"wake_up raised {type(error).__name__}"
        if why is None:
            _install(rec)
            continue
        _records.pop(id(rec.owner_ref()), None)
        once(logging.WARNING, ("fallback_released", why),
             "vllm-kvguard: CUDA-graph fallback accounting released after wake-up (%s); it "
             "is armed again at the next graph capture", why)


def _still_valid(rec: _Record) -> str | None:
    """Why the armed state no longer matches its owner after a resume, or None."""
    from vllm_kvguard.fixes.coverage import owner_of

    owner, runner = rec.owner_ref(), rec.runner_ref()
    if owner is None:
        return "the graph owner is gone"
    current = owner_of(runner) if runner is not None else None
    if current is not None and current.obj is not owner:
        return "the model runner has a new graph owner"
    if rec.kind == "V2" and not getattr(owner, "_graphs_captured", False):
        return "the graphs were not captured again"
    if owner.cudagraph_mode != rec.mode:
        return f"cudagraph mode changed to {owner.cudagraph_mode.name}"
    return None
