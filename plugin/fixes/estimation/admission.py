"""Admission certificate: the largest request one engine's KV cache can ever hold.

A request has to hold, at the step that computes its last known token, the blocks of every
KV-cache group for that many tokens (plus the scheduler's lookahead) at once, on one shared
pool of ``num_blocks - 1`` usable blocks (block 0 is the null block). The smallest such
holding, per group, is the reserved-block model's figure for that step with everything
before it already computed (:func:`vllm_kvguard.fixes.estimation.estimate.reserved_blocks`: sliding
windows and chunked-local attention drop what they no longer need, Mamba holds its state
and speculative blocks). When the sum exceeds the pool, no schedule and no amount of
waiting makes the request fit: that is the proof the liveness guard acts on, and the only
one. Draft tokens are left out of the need (a step may propose none), the lookahead is not
(EAGLE-style drafting always reserves it).

The door: EngineCore publishes its certificate when its scheduler is built (in memory, and
pickled beside the metrics snapshots for a front end in another process: the directory is
the plugin's own, made by ``mkdtemp``); the front end's input processing refuses a request
whose prompt plus ``max_tokens`` can never fit with a ``ValueError`` naming its numbers
(``LLM.generate`` raises it, ``vllm serve`` answers HTTP 400), so it never reaches
EngineCore. No certificate published yet (or ``KVGUARD_ADMISSION=off``): vLLM's behaviour.
"""
from __future__ import annotations

import logging
import math
import os
import pickle
import tempfile
import weakref
from dataclasses import dataclass, field

from vllm_kvguard import metrics, report
from vllm_kvguard.fixes.estimation.estimate import (dcp_size, device_groups, lookahead_tokens,
                                         manager_block_size, num_spec, reserved_blocks)
from vllm_kvguard.hookspecs import hookimpl
from vllm_kvguard.hostcall import KvguardOutcome
from vllm_kvguard.log import once


@dataclass(frozen=True)
class Certificate:
    """``groups``: (group index, spec); ``usable``: blocks one request can ever hold."""

    groups: tuple
    usable: int
    max_model_len: int
    lookahead: int = 0
    draft_tokens: int = 0
    dcp: int = 1
    _cache: dict = field(default_factory=dict, compare=False, repr=False)

    def _at(self, m: int) -> list[tuple[int, int]]:
        """(group index, blocks) held at the step that computes token ``m`` with every
        earlier token computed: the least any schedule holds there."""
        out = []
        for i, spec in self.groups:
            r = reserved_blocks(spec, m, num_lookahead_tokens=self.lookahead,
                                max_model_len=self.max_model_len, dcp=self.dcp,
                                num_computed_tokens=m - 1)
            out.append((i, 0 if r is None else r.physical))
        return out

    def _total(self, m: int) -> int:
        got = self._cache.get(m)
        if got is None:
            if len(self._cache) > 4096:
                self._cache.clear()
            got = self._cache[m] = sum(b for _, b in self._at(m))
        return got

    def _candidates(self, n: int) -> set[int]:
        """The steps on the way to ``n`` tokens where the holding can peak. Each group's
        holding rises only where its block table grows (token ``m + lookahead`` opens a
        block) or Mamba align enters a block (``m`` opens one), and a ``lcm`` of block
        (and local-attention chunk) sizes later every group holds at least as much, until the lookahead meets
        ``max_model_len``. So the last ``lcm`` steps before ``n``, the last ones before
        that cap and the few after it hold the peak."""
        sizes = [manager_block_size(spec, self.dcp) for _, spec in self.groups] or [1]
        chunks = [getattr(spec, "attention_chunk_size", None) or 1 for _, spec in self.groups]
        period = math.lcm(*sizes, *chunks)          # chunked local frees a chunk at a time
        cap = self.max_model_len - self.lookahead
        points = {n}
        regions = [(max(1, n - period + 1), n)]
        if n > cap:
            regions.append((max(1, cap - period + 1), cap))
            points.update(range(max(1, cap + 1), n + 1))
        for lo, hi in regions:
            if lo > hi:
                continue
            points.add(lo)
            for size in sizes:
                for rest in {(1 - self.lookahead) % size, 1 % size}:
                    points.update(range(lo + (rest - lo) % size, hi + 1, size))
        return points

    def peak(self, num_tokens: int) -> int:
        """The last step on the way to ``num_tokens`` computed tokens that holds the most."""
        n = max(1, min(int(num_tokens), self.max_model_len))
        return max(self._candidates(n), key=lambda m: (self._total(m), m))

    def group_needs(self, num_tokens: int) -> list[tuple[int, int]]:
        """(group index, blocks) a request holds at least, at the :meth:`peak` step on its
        way to ``num_tokens`` tokens."""
        return self._at(self.peak(num_tokens))

    def need(self, num_tokens: int) -> int:
        """The least peak holding of a request that reaches ``num_tokens`` tokens."""
        return self._total(self.peak(num_tokens))

    def fits(self, num_tokens: int) -> bool:
        """Whether a request whose sequence reaches ``num_tokens`` computed tokens can ever
        be held (False is a proof; True is only "not excluded")."""
        return self.need(num_tokens) <= self.usable

    @property
    def largest(self) -> int:
        """The most computed tokens a request can reach (0: not even one token fits);
        ``max_model_len`` when the whole length fits. Binary search: the peak holding on
        the way to ``n`` tokens never falls as ``n`` grows."""
        if self.fits(self.max_model_len):
            return self.max_model_len
        lo, hi = 0, self.max_model_len          # fits(lo) (or lo == 0), not fits(hi)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self.fits(mid):
                lo = mid
            else:
                hi = mid
        return lo

    @property
    def max_total(self) -> int:
        """The largest prompt + ``max_tokens``: the last token is sampled, never computed,
        so one more than :attr:`largest`, up to ``max_model_len``."""
        return min(self.largest + 1, self.max_model_len)

    def bounding_group(self, num_tokens: int) -> tuple[int, int]:
        """The group holding the most blocks at ``num_tokens``: (index, blocks)."""
        return max(self.group_needs(num_tokens), key=lambda g: g[1])

    def statement(self) -> str:
        return (f"largest admissible request: prompt + max_tokens <= {self.max_total} tokens at "
                f"{self.draft_tokens} draft tokens (lookahead {self.lookahead}), "
                f"max_model_len={self.max_model_len}, {self.usable} usable blocks")

    def refusal(self, request_id: str, num_tokens: int) -> str:
        """The message for a request that can never fit, with its numbers."""
        need, where = self.need(num_tokens), self.peak(num_tokens)
        group, blocks = self.bounding_group(num_tokens)
        parts = ", ".join(f"group {i}: {b}" for i, b in self.group_needs(num_tokens))
        at = f"{where} tokens" + (f" (on its way to {num_tokens})" if where != num_tokens else "")
        return (f"vllm-kvguard: request {request_id} can never fit the KV cache: at "
                f"{at} it holds at least {need} blocks ({parts}; group "
                f"{group} bounds it with {blocks}) and the pool has {self.usable} usable "
                f"blocks in all; {self.statement()}. Lower the prompt or max_tokens, or "
                f"give the KV cache more room (gpu_memory_utilization, "
                f"kv_cache_memory_bytes or VLLM_CPU_KVCACHE_SPACE).")


def from_configs(vllm_config, kv_cache_config) -> Certificate:
    """The certificate of an engine from its ``VllmConfig`` and ``KVCacheConfig``."""
    return Certificate(groups=tuple(device_groups(kv_cache_config)),
                       usable=int(kv_cache_config.num_blocks) - 1,
                       max_model_len=int(vllm_config.model_config.max_model_len),
                       lookahead=lookahead_tokens(vllm_config),
                       draft_tokens=num_spec(vllm_config), dcp=dcp_size(vllm_config))


_by_scheduler: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def of_scheduler(scheduler) -> Certificate:
    """The certificate of ``scheduler``'s KV cache (computed once per scheduler)."""
    cert = _by_scheduler.get(scheduler)
    if cert is None:
        cert = _by_scheduler[scheduler] = from_configs(scheduler.vllm_config,
                                                       scheduler.kv_cache_config)
    return cert


# ------------------------------------------------------------------------------ the door
SUFFIX = ".admission"                  # beside the metrics snapshots (<pid>.json)
_published: list = []                  # this process's own engine (in-process LLM)


def _validation_error() -> tuple:
    """vLLM's own request-validation error, where it has one: the API server maps it to
    HTTP 400 and ``AsyncLLM`` re-raises it as is (any other error from input processing
    becomes ``EngineGenerateError``, an HTTP 500)."""
    try:
        from vllm.exceptions import VLLMValidationError
    except ImportError:
        return ()
    return (VLLMValidationError,)


_VALIDATION = _validation_error()


class Refused(KvguardOutcome, *_VALIDATION, ValueError):
    """A request that can never fit, refused before it reaches EngineCore."""


def publish(cert: Certificate) -> None:
    """Make ``cert`` the door's certificate, here and for a front end in another process."""
    _published[:] = [cert]
    directory = metrics.directory()
    if not directory:
        return
    try:
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-")
        with os.fdopen(fd, "wb") as f:
            pickle.dump(cert, f)
        os.replace(tmp, os.path.join(directory, f"{os.getpid()}{SUFFIX}"))
    except (OSError, pickle.PickleError, TypeError, AttributeError) as exc:
        once(logging.INFO, ("admission-publish", type(exc).__name__),
             "vllm-kvguard: the admission certificate could not be handed to the front end "
             "(%s: %s); requests are not checked at the door", type(exc).__name__, exc)


def published() -> Certificate | None:
    """This process's certificate, else the tightest one an EngineCore published (read
    once: every EngineCore publishes while it starts, before the front end serves)."""
    if _published:
        return _published[0]
    directory = metrics.directory()
    if not directory:
        return None
    best = None
    try:
        names = [n for n in os.listdir(directory) if n.endswith(SUFFIX)]
    except OSError:
        return None
    for name in names:
        try:
            with open(os.path.join(directory, name), "rb") as f:
                cert = pickle.load(f)
        except Exception:               # a half-written or foreign file: not ours to trust
            continue
        if isinstance(cert, Certificate) and (best is None or cert.largest < best.largest):
            best = cert
    if best is not None:
        _published[:] = [best]
    return best


def clear_published() -> None:
    _published.clear()


def door_check(request_id: str, prompt_len: int, max_tokens: int | None) -> None:
    """Raise :class:`Refused` when ``prompt_len + max_tokens`` can never fit."""
    cert = published()
    if cert is None:
        return
    total = min(prompt_len + (max_tokens or 1), cert.max_model_len)
    computed = max(total - 1, prompt_len)       # the last token is sampled, not computed
    if cert.fits(computed):
        return
    report.count("admission", "refused")
    room = max(0, cert.max_total - prompt_len)
    message = (f"{cert.refusal(request_id, computed)} This request: prompt {prompt_len} "
               f"+ max_tokens {max_tokens} tokens; "
               + (f"max_tokens <= {room} would fit." if room else
                  "its prompt alone cannot fit."))
    if _VALIDATION:                         # vLLM's validation error: name the parameter
        raise Refused(message, parameter="max_tokens", value=max_tokens)
    raise Refused(message)


@hookimpl
def kvguard_startup_report(vllm_config, kv_cache_config):
    cert = from_configs(vllm_config, kv_cache_config)
    publish(cert)
    return ["  " + cert.statement()]


class Door:
    """The front end's check, registered by the ``admission`` patch (the process that
    takes requests need not be the one that builds a scheduler, so the door does not
    ride on the startup report that publishes the certificate)."""

    @hookimpl
    def kvguard_admit(self, request):
        """One ``EngineCoreRequest`` (generation requests only)."""
        params = getattr(request, "sampling_params", None)
        tokens = getattr(request, "prompt_token_ids", None)
        if params is None or tokens is None:
            return
        door_check(request.request_id, len(tokens), getattr(params, "max_tokens", None))


DOOR = Door()
