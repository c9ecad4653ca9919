"""Model runner V2 fallback accounting, with no wrapper on ``CudaGraphManager.dispatch``.

A V2 dispatch is a dict lookup, so a wrapper frame around it would be a large share of its
cost. A graphed batch returns a stored descriptor untouched. Two places see the rest:

* A miss constructs ``BatchExecutionDescriptor(cg_mode=NONE, ...)``: while a V2 owner is
  armed that name in ``cudagraph_utils`` is a transparent stand-in (:class:`MissFactory`)
  that reads the arguments from ``dispatch``'s frame (found up the stack by code object).
* A batch that falls from FULL to PIECEWISE passes a :class:`Gate` placed in its candidate
  list between the FULL decode descriptors and the PIECEWISE ones (0.29+, where
  ``_is_compatible`` compares ``max_query_len``; 0.34 keeps decode graphs in separate
  request-indexed tables, so the gate leads the token-keyed list).

Data parallel: ``dp_utils.sync_cudagraph_and_dp_padding`` (called only when
``dp_size > 1``) compares this rank's wish with the agreed mode (:func:`after_dp_sync`).
Every change goes through the declarations the accounting
(:class:`vllm_kvguard.fixes.cudagraph.fallbacks.Accounting`) holds.
"""
from __future__ import annotations

import inspect
import logging

from vllm_kvguard.fixes.cudagraph.graph_owners import (frame_locals, is_quiet, modes, quiet,
                                             uniform_reason, v2_dispatch_code)
from vllm_kvguard.log import once

#: How many frames above the descriptor's construction ``dispatch`` may be.
MISS_FRAME_LIMIT = 3


class MissFactory:
    """Stands in for ``BatchExecutionDescriptor`` in ``vllm.v1.worker.gpu.cudagraph_utils``
    while a V2 owner is armed. At runtime only ``CudaGraphManager.dispatch``'s miss path
    constructs a descriptor there (a graphed batch returns a stored one), so hits cost
    nothing. Transparent: builds the real class, answers ``isinstance`` and attribute
    lookups for it."""

    def __init__(self, accounting, cls, dispatch_code, none):
        self.accounting, self.cls, self.code, self.none = accounting, cls, dispatch_code, none
        self.decode_max = 0          # widest decode batch of any armed V2 owner, in tokens

    def __call__(self, *args, **kwargs):
        desc = self.cls(*args, **kwargs)
        if (kwargs.get("cg_mode") is self.none
                and 0 < kwargs.get("num_tokens", 0) <= self.decode_max):
            f_locals = frame_locals(self.code, MISS_FRAME_LIMIT)
            if f_locals is not None:
                v2_miss(self.accounting, f_locals)
        return desc

    def __instancecheck__(self, obj) -> bool:
        return isinstance(obj, self.cls)

    def __getattr__(self, name):
        return getattr(self.cls, name)


def install_factory(accounting) -> MissFactory:
    """The accounting's stand-in, put in place through its ``descriptor_global``."""
    decl = accounting.descriptor_global
    if accounting.factory is not None:
        return accounting.factory
    from vllm.v1.worker.gpu import cudagraph_utils as cu

    real = decl.original(cu.BatchExecutionDescriptor)
    real = getattr(real, "cls", real) if isinstance(real, MissFactory) else real
    factory = MissFactory(accounting, real, v2_dispatch_code(cu.CudaGraphManager), modes().NONE)
    if decl.replace(factory):
        accounting.factory = factory
    return factory


def remove_factory(accounting) -> None:
    if accounting.factory is not None:
        accounting.descriptor_global.restore()
        accounting.factory = None


def v2_miss(accounting, f_locals: dict) -> None:
    rec = accounting.record_of(f_locals.get("self"))
    if rec is None or is_quiet():
        return
    args = (f_locals.get("num_tokens"), f_locals.get("uniform_token_count"),
            f_locals.get("max_query_len"))
    if rec.last_gate == args:           # this batch was already counted at its gate
        rec.last_gate = None
        return
    v2_slow(accounting, rec, modes().NONE, f_locals.get("num_reqs"), args[0], args[1],
            f_locals.get("num_active_loras", 0), args[2], f_locals.get("num_ubatches", 1))


class Probe:
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


class Gate:
    """Sits in a V2 candidate list after the FULL decode descriptors, before the first
    PIECEWISE one. Dispatch reaches it only when no FULL graph matched. For a batch with a
    prefill (``max_query_len`` None) its comparisons are C-level and fail at once; for a
    decode-only batch they hand it ``max_query_len`` and ``num_reqs``, then fail, so
    dispatch goes on to the PIECEWISE descriptor exactly as before."""

    __slots__ = ("accounting", "rec", "num_tokens", "mql", "uniform_token_count",
                 "max_query_len", "num_reqs", "cg_mode")

    def __init__(self, accounting, rec, num_tokens):
        self.accounting, self.rec, self.num_tokens, self.mql = accounting, rec, num_tokens, None
        self.uniform_token_count = None          # passes for any batch
        self.max_query_len = Probe(self, "max_query_len")
        self.num_reqs = Probe(self, "num_reqs")
        self.cg_mode = None

    def passed(self, num_reqs) -> None:
        rec, mql, n = self.rec, self.mql, self.num_tokens
        if is_quiet() or mql is None or mql > rec.qmax:
            return
        try:
            u = mql if n == num_reqs * mql else None     # uniform, or ragged drafts
            reason = "non_uniform_drafts" if u is None else "not_captured_for_draft_length"
            rec.last_gate = (n, u, mql)
            shape = f"{u} tokens each" if u is not None else f"1..{mql} tokens each"
            self.accounting.report(rec, reason, modes().PIECEWISE, n,
                                   f"decode of {num_reqs} requests, {shape} ({n} tokens)")
        except Exception as exc:
            self.accounting.trip(rec, exc)


def place_gates(accounting, rec, owner) -> list:
    """A gate in every candidate list that holds FULL decode descriptors followed by
    PIECEWISE ones (FULL_AND_PIECEWISE): the FULL -> PIECEWISE fall-through point."""
    piecewise = modes().PIECEWISE
    placed = []
    if rec.tail == 0:          # 0.27.1: _is_compatible has no max_query_len to read
        return placed
    # 0.34: FULL decode graphs sit in their own request-indexed tables (``_decode_descs``)
    # and dispatch tries the batch's entry before the token-keyed list, so the list's
    # first PIECEWISE descriptor is the fall-through point itself.
    decode_tables = bool(getattr(owner, "_decode_descs", None))
    for key, candidates in list(owner._candidates.items()):
        idx = next((i for i, d in enumerate(candidates) if d.cg_mode == piecewise), None)
        if idx is None or not (decode_tables or any(
                getattr(d, "uniform_token_count", None) is not None
                or getattr(d, "max_query_len", None) is not None for d in candidates[:idx])):
            continue
        gate = Gate(accounting, rec, key[0])
        accounting.candidate_items.insert(owner, idx, gate, path=(key,))
        placed.append(gate)
    return placed


def v2_slow(accounting, rec, mode, num_reqs, num_tokens, uniform_token_count,
            num_active_loras, max_query_len, num_ubatches) -> None:
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
            reason = uniform_reason(rec, num_tokens, num_active_loras > 0, unlora)
        shape = f"{u} tokens each" if u is not None else f"1..{max_query_len} tokens each"
        accounting.report(rec, reason, mode, num_tokens, f"decode of {num_reqs} requests, {shape}")
    except Exception as exc:
        accounting.trip(rec, exc)


# ----------------------------------------------------------------------------- DP
def after_dp_sync(accounting, args: tuple, kwargs: dict, result) -> None:
    """``sync_cudagraph_and_dp_padding`` returned: count a rank the agreement forced eager."""
    try:
        bound = _bind_dp(args, kwargs)
        rec = accounting.record_of(bound.get("cudagraph_manager"))
        if rec is None:
            return
        none = modes().NONE
        wanted = bound["desired_batch_desc"].cg_mode
        if result[0].cg_mode is none and wanted is not none:
            accounting.report(rec, "dp_sync_forced", none, bound["num_tokens"],
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
