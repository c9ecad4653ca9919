"""Runtime CUDA-graph fallback accounting: no eager fallback is silent.

A batch the configuration meant to graph that runs eager (``NONE``) or ``PIECEWISE`` is
counted by reason (:data:`REASONS`, exported as ``kvguard_cudagraph_fallbacks_total``) and
the first of each reason logs one warning naming the fix. :class:`Accounting` arms an
owner after a non-profile ``capture_model`` through the run-time changes the cudagraph
patch declares: a V1 dispatcher gets an instance ``dispatch`` closure that takes a slow
path only on a miss; V2 owners are seen from inside (:mod:`.fallbacks_v2`). Sleep
suspends and wake-up re-validates the armed state.
"""
from __future__ import annotations

import logging
import weakref

from vllm_kvguard import report
from vllm_kvguard.fixes.cudagraph import fallbacks_v2
from vllm_kvguard.fixes.cudagraph.graph_owners import (V1_SIGNATURE, V2_HEAD, V2_TAILS, dispatch_params,
                                             frame_locals, modes, owner_of, uniform_reason,
                                             v1_caller_code)
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


class Record:
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
        self.caller_code = v1_caller_code(runner) if self.kind == "V1" else None
        self.tail = 0                 # V2: dispatch params after num_active_loras
        self.closure = None           # V1: the instance ``dispatch``
        self.gates: list = []         # V2: gates placed in the owner's candidate lists
        self.last_gate = None
        self.suspended = False


class Accounting:
    """The armed owners of this process and the changes that count their fallbacks.

    ``dispatch_attr`` (an ``InstanceAttr`` on ``CudagraphDispatcher.dispatch``),
    ``descriptor_global`` (a ``ModuleGlobal`` on ``cudagraph_utils.BatchExecutionDescriptor``)
    and ``candidate_items`` (a ``ContainerItem`` on ``CudaGraphManager._candidates``) are
    the declarations every change goes through.
    """

    def __init__(self, dispatch_attr, descriptor_global, candidate_items):
        self.dispatch_attr = dispatch_attr
        self.descriptor_global = descriptor_global
        self.candidate_items = candidate_items
        self.records: dict[int, Record] = {}
        self.armed = False            # read by the DP-agreement wrapper's fast path
        self.factory = None           # the V2 descriptor stand-in, while installed

    # ------------------------------------------------------------------------- arming
    def arm(self, runner, adapter) -> bool:
        """Start counting on ``adapter.obj`` (the graph owner of ``runner``).

        Returns False (and installs nothing) when the owner intends no graph, or its
        ``dispatch`` signature is not one this module knows (logged once).
        """
        owner = adapter.obj
        if adapter.intended() == modes().NONE:
            return False
        old = self.records.pop(id(owner), None)
        if old is not None:
            self._uninstall(old)
        rec = Record(owner, runner, adapter)
        params = dispatch_params(type(owner))
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
                     "vllm-kvguard: V1 ragged-draft batches cannot be told from prefills on "
                     "this vLLM; they are not counted (other fallback reasons are)")
            rec.closure = self._make_v1(rec)
        if not self._install(rec):
            once(logging.INFO, ("fallback_dispatch_taken", rec.kind),
                 "vllm-kvguard: CUDA-graph fallback accounting is off for a %s graph owner "
                 "whose dispatch another plugin already replaced", rec.kind)
            return False
        self.records[id(owner)] = rec
        self.armed = True
        return True

    def _install(self, rec: Record) -> bool:
        owner = rec.owner_ref()
        if owner is None:
            return False
        if rec.kind == "V1":
            if not self.dispatch_attr.set(owner, rec.closure):
                return False
        else:
            factory = fallbacks_v2.install_factory(self)
            factory.decode_max = max(factory.decode_max, rec.max_decode_tokens)
            rec.gates = fallbacks_v2.place_gates(self, rec, owner)
        rec.suspended = False
        return True

    def _uninstall(self, rec: Record) -> None:
        owner = rec.owner_ref()
        if rec.kind == "V1":
            if owner is not None and self.dispatch_attr.get(owner) is rec.closure:
                self.dispatch_attr.unset(owner)
            return
        if owner is not None:
            for gate in rec.gates:
                self.candidate_items.remove(owner, gate)
        rec.gates = []

    def disarm_all(self) -> None:
        """Remove every closure, gate and stand-in (patch teardown, tests)."""
        for rec in list(self.records.values()):
            self._uninstall(rec)
        self.records.clear()
        fallbacks_v2.remove_factory(self)
        self.armed = False

    def armed_owners(self) -> list:
        return [o for o in (r.owner_ref() for r in self.records.values() if not r.suspended)
                if o]

    def record_of(self, owner) -> Record | None:
        """The live record of ``owner`` (None if not armed, suspended or another object)."""
        rec = self.records.get(id(owner))
        if rec is None or rec.suspended or rec.owner_ref() is not owner:
            return None
        return rec

    # ------------------------------------------------------------------------- V1
    def _make_v1(self, rec: Record):
        orig, best, slow, decode_max = rec.orig, rec.best, self._v1_slow, rec.max_decode_tokens

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

    def _v1_slow(self, rec, mode, num_tokens, uniform_decode, has_lora, num_active_loras,
                 valid_modes, invalid_modes) -> None:
        try:
            if invalid_modes:      # encoder outputs / fast-prefill logits: FULL excluded by design
                return
            none = modes().NONE
            if valid_modes is not None:
                # A DP re-dispatch with the agreed mode, or a forced-eager (profile/dummy) run.
                if mode is not none or set(valid_modes) != {none}:
                    return
                ctx = frame_locals(rec.caller_code)
                if ctx is None or ctx.get("force_eager"):
                    return
                local = ctx.get("num_tokens", num_tokens)
                wanted = rec.orig(local, uniform_decode, has_lora, num_active_loras)[0]
                if wanted is not none:
                    self.report(rec, "dp_sync_forced", mode, num_tokens,
                                f"this rank's batch ({local} tokens) would have run {wanted.name}")
                return
            if uniform_decode:
                q = min(rec.qs)
                reason = uniform_reason(rec, num_tokens, has_lora,
                                         lambda: rec.orig(num_tokens, True, False, 0)[0])
                self.report(rec, reason, mode, num_tokens,
                            f"uniform decode of {num_tokens // q} requests x {q} tokens")
                return
            if num_tokens > rec.max_decode_tokens:
                return
            batch = getattr(rec.runner_ref(), "input_batch", None)
            n = getattr(batch, "num_reqs", None)
            if isinstance(n, int) and num_tokens > n * rec.qmax:
                return                 # some request has more than a decode step's tokens
            ctx = frame_locals(rec.caller_code)
            if ctx is None:
                return
            num_reqs, widest = ctx.get("num_reqs"), ctx.get("max_num_scheduled_tokens")
            if (num_reqs is None or widest is None or widest > rec.qmax
                    or num_tokens > num_reqs * widest):
                return                 # a prefill chunk wider than a decode step
            self.report(rec, "non_uniform_drafts", mode, num_tokens,
                        f"decode of {num_reqs} requests with 1..{widest} tokens each "
                        f"({num_tokens} tokens; uniform decode is {rec.qmax} per request)")
        except Exception as exc:
            self.trip(rec, exc)

    # ------------------------------------------------------------------------- DP
    def after_dp_sync(self, args: tuple, kwargs: dict, result) -> None:
        """V2 ``sync_cudagraph_and_dp_padding`` returned: count a rank the agreement forced
        eager. Fails open (one error line)."""
        fallbacks_v2.after_dp_sync(self, args, kwargs, result)

    # ------------------------------------------------------------------------- reporting
    def report(self, rec, reason, mode, num_tokens, detail) -> None:
        from vllm_kvguard.manager import hook

        hook().kvguard_cudagraph_fallback(owner=rec.owner_ref(), reason=reason, mode=mode.name,
                                          num_tokens=num_tokens, detail=detail)

    def trip(self, rec: Record, exc: Exception) -> None:
        """Fail open: an internal error stops counting on this owner; vLLM is unchanged."""
        self.records.pop(id(rec.owner_ref()), None)
        self._uninstall(rec)
        once(logging.ERROR, ("internal", "cudagraph_fallback"),
             "vllm-kvguard: internal error in CUDA-graph fallback accounting (%s: %s); "
             "counting is off for this model runner, vLLM's dispatch is unchanged",
             type(exc).__name__, exc)

    # ------------------------------------------------------------------------- sleep / wake
    def records_of(self, worker) -> list[Record]:
        runner = getattr(worker, "model_runner", None)
        return [r for r in self.records.values() if runner is None or r.runner_ref() is runner]

    def suspend(self, worker) -> None:
        for rec in self.records_of(worker):
            self._uninstall(rec)
            rec.suspended = True

    def resume(self, worker, error) -> None:
        for rec in [r for r in self.records_of(worker) if r.suspended]:
            why = still_valid(rec) if error is None else f"wake_up raised {type(error).__name__}"
            if why is None and self._install(rec):
                continue
            why = why or "its dispatch was replaced meanwhile"
            self.records.pop(id(rec.owner_ref()), None)
            once(logging.WARNING, ("fallback_released", why),
                 "vllm-kvguard: CUDA-graph fallback accounting released after wake-up (%s); it "
                 "is armed again at the next graph capture", why)


def still_valid(rec: Record) -> str | None:
    """Why the armed state no longer matches its owner after a resume, or None."""
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
