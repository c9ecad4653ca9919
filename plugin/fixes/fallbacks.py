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

Where, and what it costs (``benchmarks/bench_dispatch.py`` measures it)
    Nothing is armed for an owner whose configuration intends no graph (the CPU backend,
    ``enforce_eager``), and nothing is wrapped at class level on the dispatch path. After
    a non-profile ``capture_model``:

    * V1 ``CudagraphDispatcher`` (a dispatch costs microseconds): the runner's dispatcher
      gets an instance attribute ``dispatch``, a closure with the host's exact signature
      that calls the bound original and compares the returned mode with the intended one.
      Only a miss takes the slow path. V1 does not pass the batch shape to ``dispatch``; for
      a non-uniform batch the slow path reads ``num_reqs`` and ``max_num_scheduled_tokens``
      from the caller frame (``GPUModelRunner._determine_batch_execution_and_padding``,
      matched by code object).
    * V2 ``CudaGraphManager`` (a dispatch is a dict lookup, ~0.4 us: any wrapper frame would
      cost a quarter of it): no wrapper at all. A graphed batch returns a stored descriptor
      untouched. A miss constructs ``BatchExecutionDescriptor(cg_mode=NONE, ...)``: while a
      V2 owner is armed that name in ``cudagraph_utils`` is a transparent stand-in
      (:class:`_MissFactory`) that reads the arguments from ``dispatch``'s frame. A batch
      that falls from FULL to PIECEWISE passes a :class:`_Gate` placed in its candidate list
      between the FULL decode descriptors and the PIECEWISE ones.
    * Data parallel: ``dp_utils.sync_cudagraph_and_dp_padding`` (called only when
      ``dp_size > 1``) compares this rank's wish with the agreed mode.
Suspend / resume
    ``Worker.sleep`` suspends (closures and gates removed), ``Worker.wake_up`` resumes: each
    record is re-validated against its owner (same owner object, graphs still there) and
    re-installed, or released with one warning if that fails; the next capture re-arms.
"""
from __future__ import annotations

import inspect
import logging
import sys
import weakref

from vllm_kvguard import report
from vllm_kvguard.hookspecs import hookimpl
from vllm_kvguard.log import once

CATEGORY = "cudagraph_fallback"
REASONS = ("over_max_capture_size", "non_uniform_drafts", "not_captured_for_draft_length",
           "lora", "dp_sync_forced", "graphs_released")
report.declare(CATEGORY, REASONS)

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

V1_SIGNATURE = ("self", "num_tokens", "uniform_decode", "has_lora", "num_active_loras",
                "valid_modes", "invalid_modes")
#: V2 ``dispatch`` parameters after ``num_active_loras`` (0.27.1: none; 0.29: max_query_len;
#: 0.32+: max_query_len, num_ubatches).
V2_HEAD = ("self", "num_reqs", "num_tokens", "uniform_token_count", "num_active_loras")
V2_TAILS = {(): 0, ("max_query_len",): 1, ("max_query_len", "num_ubatches"): 2}


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
        self.orig = type(owner).dispatch.__get__(owner, type(owner))
        self.caller_code = _caller_code(runner) if self.kind == "V1" else None
        self.tail = 0                 # V2: dispatch params after num_active_loras
        self.closure = None           # V1: the instance ``dispatch``
        self.gates: list = []         # V2: (candidate list, gate)
        self.last_gate = None
        self.suspended = False


# ----------------------------------------------------------------------------- arming
def arm(runner, adapter) -> bool:
    """Start counting on ``adapter.obj`` (the graph owner of ``runner``).

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
    params = _params(type(owner).dispatch)
    if rec.kind == "V1":
        known = params == V1_SIGNATURE
    else:
        known = params[:5] == V2_HEAD and params[5:] in V2_TAILS
        rec.tail = V2_TAILS.get(params[5:], 0)
    if not known:
        once(logging.WARNING, ("fallback_signature", rec.kind),
             "vllm-kvguard: CUDA-graph fallback accounting is off for model runner %s: its "
             "dispatch() signature %s is not one this version of vllm-kvguard knows",
             rec.kind, params)
        return False
    if rec.kind == "V1":
        if rec.caller_code is None:
            once(logging.INFO, ("fallback_ragged_v1",),
                 "vllm-kvguard: V1 ragged-draft batches cannot be told from prefills on this "
                 "vLLM; they are not counted (other fallback reasons are)")
        rec.closure = _make_v1(rec)
    _records[id(owner)] = rec
    _install(rec)
    ARMED = True
    return True


def _install(rec: _Record) -> None:
    owner = rec.owner_ref()
    if owner is None:
        return
    if rec.kind == "V1":
        owner.dispatch = rec.closure
    else:
        _MissFactory.install(owner)
        factory = _MissFactory.installed
        factory.decode_max = max(factory.decode_max, rec.max_decode_tokens)
        rec.gates = _place_gates(rec, owner)
    rec.suspended = False


def _uninstall(rec: _Record) -> None:
    owner = rec.owner_ref()
    if rec.kind == "V1":
        if owner is not None and owner.__dict__.get("dispatch") is rec.closure:
            del owner.__dict__["dispatch"]
        return
    for candidates, gate in rec.gates:
        if gate in candidates:
            candidates.remove(gate)
    rec.gates = []


def disarm_all() -> None:
    """Remove every closure, gate and stand-in (patch teardown, tests)."""
    global ARMED
    for rec in list(_records.values()):
        _uninstall(rec)
    _records.clear()
    _MissFactory.remove()
    ARMED = False


def armed_owners() -> list:
    return [o for o in (r.owner_ref() for r in _records.values() if not r.suspended) if o]


def _params(fn) -> tuple[str, ...]:
    try:
        return tuple(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return ()


_MODES: list = []


def _none():
    if not _MODES:
        from vllm.config import CUDAGraphMode

        _MODES[:] = [CUDAGraphMode.NONE, CUDAGraphMode.PIECEWISE]
    return _MODES[0]


def _caller_code(runner):
    """The code object of the V1 runner method that calls ``dispatch`` with the batch shape."""
    fn = getattr(type(runner), "_determine_batch_execution_and_padding", None) if runner else None
    fn = inspect.unwrap(fn) if fn is not None else None
    code = getattr(fn, "__code__", None)
    if code is None or not {"num_reqs", "max_num_scheduled_tokens"} <= set(code.co_varnames):
        return None
    return code


# ----------------------------------------------------------------------------- V1
def _make_v1(rec: _Record):
    orig, best, slow, decode_max = rec.orig, rec.best, _v1_slow, rec.max_decode_tokens

    def dispatch(num_tokens, uniform_decode=False, has_lora=False, num_active_loras=0,
                 valid_modes=None, invalid_modes=None):
        result = orig(num_tokens, uniform_decode, has_lora, num_active_loras, valid_modes,
                      invalid_modes)
        # Only a decode-sized batch that missed its intended graph goes further.
        if result[0] is not best and (uniform_decode or num_tokens <= decode_max):
            slow(rec, result[0], num_tokens, uniform_decode, has_lora, num_active_loras,
                 valid_modes, invalid_modes)
        return result

    return dispatch


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
            reason = _uniform_reason(rec, num_tokens, has_lora,
                                     lambda: rec.orig(num_tokens, True, False, 0)[0])
            _report(rec, reason, mode, num_tokens,
                    f"uniform decode of {num_tokens // q} requests x {q} tokens")
            return
        if num_tokens > rec.max_decode_tokens:
            return
        batch = getattr(rec.runner_ref(), "input_batch", None)
        n = getattr(batch, "num_reqs", None)
        if isinstance(n, int) and num_tokens > n * rec.qmax:
            return                     # some request has more than a decode step's tokens
        ctx = _caller_locals(rec)
        if ctx is None:
            return
        num_reqs, widest = ctx.get("num_reqs"), ctx.get("max_num_scheduled_tokens")
        if (num_reqs is None or widest is None or widest > rec.qmax
                or num_tokens > num_reqs * widest):
            return                     # a prefill chunk wider than a decode step
        _report(rec, "non_uniform_drafts", mode, num_tokens,
                f"decode of {num_reqs} requests with 1..{widest} tokens each "
                f"({num_tokens} tokens; uniform decode is {rec.qmax} per request)")
    except Exception as exc:
        _trip(rec, exc)


def _uniform_reason(rec, num_tokens, has_lora, without_lora) -> str:
    if has_lora and without_lora() is rec.best:
        return "lora"
    if num_tokens > rec.max_size:
        return "over_max_capture_size"
    return "not_captured_for_draft_length"


# ----------------------------------------------------------------------------- V2
class _MissFactory:
    """Stands in for ``BatchExecutionDescriptor`` in ``vllm.v1.worker.gpu.cudagraph_utils``
    while a V2 owner is armed. At runtime only ``CudaGraphManager.dispatch``'s miss path
    constructs a descriptor there (a graphed batch returns a stored one), so hits cost
    nothing. Transparent: builds the real class, answers ``isinstance`` and attribute
    lookups for it."""

    installed: "_MissFactory | None" = None

    def __init__(self, cls, dispatch_code, none):
        self.cls, self.code, self.none = cls, dispatch_code, none
        self.decode_max = 0          # widest decode batch of any armed V2 owner, in tokens

    def __call__(self, *args, **kwargs):
        desc = self.cls(*args, **kwargs)
        if (kwargs.get("cg_mode") is self.none
                and 0 < kwargs.get("num_tokens", 0) <= self.decode_max):
            frame = sys._getframe(1)
            if frame.f_code is self.code:
                _v2_miss(frame.f_locals)
        return desc

    def __instancecheck__(self, obj) -> bool:
        return isinstance(obj, self.cls)

    def __getattr__(self, name):
        return getattr(self.cls, name)

    @classmethod
    def install(cls, owner) -> None:
        if cls.installed is not None:
            return
        from vllm.v1.worker.gpu import cudagraph_utils as cu

        code = inspect.unwrap(cu.CudaGraphManager.dispatch).__code__
        cls.installed = cls(cu.BatchExecutionDescriptor, code, _none())
        cu.BatchExecutionDescriptor = cls.installed

    @classmethod
    def remove(cls) -> None:
        if cls.installed is None:
            return
        from vllm.v1.worker.gpu import cudagraph_utils as cu

        if cu.BatchExecutionDescriptor is cls.installed:
            cu.BatchExecutionDescriptor = cls.installed.cls
        cls.installed = None


_quiet = [0]


class quiet:
    """Dispatches made inside this block (probes, re-dispatches of ours) are not counted."""

    def __enter__(self):
        _quiet[0] += 1

    def __exit__(self, *exc):
        _quiet[0] -= 1
        return False


def _v2_miss(f_locals: dict) -> None:
    owner = f_locals.get("self")
    rec = _records.get(id(owner))
    if rec is None or rec.suspended or _quiet[0] or rec.owner_ref() is not owner:
        return
    args = (f_locals.get("num_tokens"), f_locals.get("uniform_token_count"),
            f_locals.get("max_query_len"))
    if rec.last_gate == args:           # this batch was already counted at its gate
        rec.last_gate = None
        return
    _v2_slow(rec, _none(), f_locals.get("num_reqs"), args[0], args[1],
             f_locals.get("num_active_loras", 0), args[2], f_locals.get("num_ubatches", 1))


class _Probe:
    """A gate field that ``_is_compatible`` compares with ``>=``."""

    __slots__ = ("gate", "field")

    def __init__(self, gate, field):
        self.gate, self.field = gate, field

    def __ge__(self, value):
        gate = self.gate
        if self.field == "max_query_len":      # desc.max_query_len >= max_query_len
            gate.mql = value
            return True                        # go on to the num_reqs comparison
        gate.passed(value)                     # desc.num_reqs >= num_reqs
        return False                           # never compatible: PIECEWISE is tried next


class _Gate:
    """Sits in a V2 candidate list after the FULL decode descriptors, before the first
    PIECEWISE one (0.29+, where ``_is_compatible`` checks ``max_query_len``). Dispatch reaches
    it only when no FULL graph matched. For a batch with a prefill (``max_query_len`` None)
    its comparisons are C-level and fail at once; for a decode-only batch they hand it
    ``max_query_len`` and ``num_reqs``, then fail, so dispatch goes on to the PIECEWISE
    descriptor exactly as before."""

    __slots__ = ("rec", "num_tokens", "mql", "uniform_token_count", "max_query_len",
                 "num_reqs", "cg_mode")

    def __init__(self, rec, num_tokens):
        self.rec, self.num_tokens, self.mql = rec, num_tokens, None
        self.uniform_token_count = None          # passes for any batch
        self.max_query_len = _Probe(self, "max_query_len")
        self.num_reqs = _Probe(self, "num_reqs")
        self.cg_mode = None

    def passed(self, num_reqs) -> None:
        rec, mql, n = self.rec, self.mql, self.num_tokens
        if _quiet[0] or mql is None or mql > rec.qmax:
            return
        try:
            u = mql if n == num_reqs * mql else None     # uniform, or ragged drafts
            reason = "non_uniform_drafts" if u is None else "not_captured_for_draft_length"
            rec.last_gate = (n, u, mql)
            shape = f"{u} tokens each" if u is not None else f"1..{mql} tokens each"
            _report(rec, reason, _piecewise(), n,
                    f"decode of {num_reqs} requests, {shape} ({n} tokens)")
        except Exception as exc:
            _trip(rec, exc)


def _piecewise():
    _none()
    return _MODES[1]


def _place_gates(rec, owner) -> list:
    """A gate in every candidate list that holds FULL decode descriptors followed by
    PIECEWISE ones (FULL_AND_PIECEWISE): the FULL -> PIECEWISE fall-through point."""
    piecewise = _piecewise()
    placed = []
    if rec.tail == 0:          # 0.27.1: _is_compatible has no max_query_len to read
        return placed
    for (num_tokens, _loras), candidates in owner._candidates.items():
        idx = next((i for i, d in enumerate(candidates) if d.cg_mode == piecewise), None)
        if idx is None or not any(
                getattr(d, "uniform_token_count", None) is not None
                or getattr(d, "max_query_len", None) is not None for d in candidates[:idx]):
            continue
        gate = _Gate(rec, num_tokens)
        candidates.insert(idx, gate)
        placed.append((candidates, gate))
    return placed


def _v2_slow(rec, mode, num_reqs, num_tokens, uniform_token_count, num_active_loras,
             max_query_len, num_ubatches) -> None:
    try:
        if not num_tokens or num_ubatches != 1 or num_reqs is None or num_reqs > rec.max_num_reqs:
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
                with quiet():
                    return rec.orig(*args).cg_mode
            reason = _uniform_reason(rec, num_tokens, num_active_loras > 0, unlora)
        shape = f"{u} tokens each" if u is not None else f"1..{max_query_len} tokens each"
        _report(rec, reason, mode, num_tokens, f"decode of {num_reqs} requests, {shape}")
    except Exception as exc:
        _trip(rec, exc)


# ----------------------------------------------------------------------------- DP
def after_dp_sync(args: tuple, kwargs: dict, result) -> None:
    """``sync_cudagraph_and_dp_padding`` returned: count a rank the agreement forced eager."""
    try:
        bound = _bind_dp(args, kwargs)
        manager = bound.get("cudagraph_manager")
        rec = _records.get(id(manager))
        if rec is None or rec.suspended or rec.owner_ref() is not manager:
            return
        none = _none()
        wanted = bound["desired_batch_desc"].cg_mode
        if result[0].cg_mode is none and wanted is not none:
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

        fn = inspect.unwrap(dp_utils.sync_cudagraph_and_dp_padding)
        _dp_signature.append(inspect.signature(fn))
    return dict(_dp_signature[0].bind(*args, **kwargs).arguments)


# ----------------------------------------------------------------------------- reporting
def _report(rec, reason, mode, num_tokens, detail) -> None:
    from vllm_kvguard.manager import hook

    hook().kvguard_cudagraph_fallback(owner=rec.owner_ref(), reason=reason, mode=mode.name,
                                      num_tokens=num_tokens, detail=detail)


def _trip(rec: _Record, exc: Exception) -> None:
    """Fail open: an internal error stops counting on this owner; vLLM is unchanged."""
    _records.pop(id(rec.owner_ref()), None)
    _uninstall(rec)
    once(logging.ERROR, ("internal", "cudagraph_fallback"),
         "vllm-kvguard: internal error in CUDA-graph fallback accounting (%s: %s); counting "
         "is off for this model runner, vLLM's dispatch is unchanged", type(exc).__name__, exc)


@hookimpl
def kvguard_cudagraph_fallback(owner, reason, mode, num_tokens, detail):
    from vllm_kvguard import report

    report.count(CATEGORY, reason)       # reaches /metrics through metrics.changed
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
