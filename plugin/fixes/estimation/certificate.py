"""Admission certificate: the two limits vLLM's own scheduler puts on one request.

A request gets the most room it can ever have when it is alone in an empty pool; what
the scheduler does then decides whether it can ever run:

* **prompt limit** ``P``: the longest sequence the scheduler admits and prefills. A
  WAITING or PREEMPTED request enters through ``KVCacheManager.allocate_slots`` with
  ``full_sequence_must_fit=scheduler_reserve_full_isl``: the whole sequence so far is
  counted at once with nothing computed, through per-spec admission caps. That count is
  vLLM's own ``get_num_blocks_to_allocate(..., apply_admission_cap=True)``, called here
  on the scheduler's real managers (:func:`gate_counter`), never re-derived. Then every
  prefill chunk (``min(remaining, token budget)`` when alone; ``long_prefill_token_threshold``
  is 0 for a lone request in 0.31+; Mamba align chunks are cut by vLLM's own
  ``_mamba_block_aligned_split``) must fit;
  those holdings are the reserved-block model (:mod:`.estimate`, fuzzed against the
  allocator), with the async scheduler's unsettled step kept (``num_in_flight_tokens``).
* **total limit** ``T``: the largest prompt + ``max_tokens`` that can complete: every
  decode step up to ``T - 1`` computed tokens fits (the least holding of any schedule).
* **start limit** ``S <= P``: the async scheduler takes a request's first decode step
  before its last prefill chunk settles; a prompt over ``S`` is preempted there, each
  time one token longer, so it completes only with a total of at most ``P + 1``.

A request admitted below ``P`` that grows past it completes unless it is preempted; a
preempted one can then never re-enter. The door refuses only ``prompt > P``,
``total > T``, or ``prompt > S`` with ``total > P + 1`` (refusing more would fail
requests that complete whenever they are not preempted); :mod:`.liveness` ends a
preempted one with :meth:`Certificate.never` when it is proven stuck. No prefix hit is
assumed (a hit can be evicted before the request runs), except, for ``S``, the blocks a
request has just freed by its own preemption.
"""
from __future__ import annotations

import bisect
import math
import weakref
from dataclasses import dataclass, field

from vllm_kvguard.fixes.estimation.estimate import (dcp_size, device_groups,
                                                    lookahead_tokens, manager_block_size,
                                                    num_spec, reserved_blocks)
from vllm_kvguard.fixes.estimation.schedule import (Schedule, build_scheduler,
                                                    checkpointing, gate_counter,
                                                    schedule_of)
from vllm_kvguard.hookspecs import hookimpl


#: prompts below the admission limits' bisected edge checked for holes
#: (:meth:`Certificate._below_first_failure`; 1.5 s for Nemotron-H at 8192 tokens)
SCAN_PROMPTS = 8192


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def describe(spec) -> str:
    """A group's kind as vLLM's spec names it, with its window or chunk."""
    name = type(spec).__name__.replace("Spec", "")
    if hasattr(spec, "mamba_cache_mode"):
        return f"Mamba ({spec.mamba_cache_mode})"
    if getattr(spec, "sliding_window", None):
        return f"sliding window {spec.sliding_window}"
    if getattr(spec, "attention_chunk_size", None):
        return f"chunked local {spec.attention_chunk_size}"
    return {"FullAttention": "full attention", "MLAAttention": "MLA"}.get(name, name)


@dataclass(frozen=True)
class Certificate:
    """``groups``: (group index, spec); ``usable``: blocks one request can ever hold;
    ``gate``: :func:`gate_counter` (None: this vLLM admits by the first chunk only);
    ``checkpoints``: {group index: its managers' Mamba prefill-checkpoint numbers}."""

    groups: tuple
    usable: int
    max_model_len: int
    schedule: Schedule
    lookahead: int = 0
    draft_tokens: int = 0
    dcp: int = 1
    gate: object = field(default=None, compare=False, repr=False)
    checkpoints: dict = field(default_factory=dict, compare=False, repr=False)
    _cache: dict = field(default_factory=dict, compare=False, repr=False)

    # ------------------------------------------------------------- holdings, per group
    def _hold(self, tokens: int, start: int, settled: int | None = None,
              prefill_end: int = 0) -> list[tuple[int, int]]:
        """Per group, held after the step ``[start, tokens)`` with ``settled`` tokens
        settled (default: all); ``prefill_end``: the request's (Mamba checkpoints)."""
        out = []
        for i, spec in self.groups:
            ckpt = self.checkpoints.get(i)
            r = reserved_blocks(spec, tokens, num_lookahead_tokens=self.lookahead,
                                max_model_len=self.max_model_len, dcp=self.dcp,
                                num_computed_tokens=start, num_settled_tokens=settled,
                                checkpointing=ckpt and ckpt.at(prefill_end))
            out.append((i, 0 if r is None else r.physical))
        return out

    def holding(self, m: int) -> list[tuple[int, int]]:
        """Held at the step computing token ``m`` with the ones before computed: the least
        any schedule holds there. Synchronous: ``m`` tokens, ``m - 1`` computed. The
        async scheduler keeps one step unsettled (frees lag by it) and, with drafts,
        schedules ``k`` draft placeholders on top of the unsettled step's ``k``
        (``AsyncScheduler._update_after_schedule``; 0.34 async_scheduler.py 18-40):
        ``m + 2k`` tokens, ``m - 2`` processed (matched on the scheduler fuzz)."""
        k = self.draft_tokens if self.schedule.in_flight else 0
        if k:
            return self._hold(m + 2 * k, max(0, m + k - 1), max(0, m - 2))
        return self._hold(m, max(0, m - 1), max(0, m - 1 - self.schedule.in_flight))

    def _decode_total(self, m: int) -> int:
        key = ("d", m)
        got = self._cache.get(key)
        if got is None:
            if len(self._cache) > 8192:
                self._cache.clear()
            got = self._cache[key] = sum(b for _, b in self.holding(m))
        return got

    def _candidates(self, n: int) -> set[int]:
        """Steps on the way to ``n`` tokens where a decode holding can peak: the last
        ``lcm`` of block and chunk sizes before ``n`` (and before the lookahead meets
        ``max_model_len``); every group's holding repeats with that period. Every step of
        a short period; for a long one, the steps where a block table grows."""
        sizes = [manager_block_size(spec, self.dcp) for _, spec in self.groups] or [1]
        chunks = [getattr(spec, "attention_chunk_size", None) or 1 for _, spec in self.groups]
        period = _lcm(*sizes, *chunks)
        shift = 2 * self.draft_tokens + 2
        cap = self.max_model_len - self.lookahead
        points = {n}
        regions = [(max(1, n - period - shift), n)]
        if n > cap:
            regions.append((max(1, cap - period - shift), cap))
            points.update(range(max(1, cap + 1), n + 1))
        for lo, hi in regions:
            if hi - lo <= 4096:                 # every step of the last period
                points.update(range(lo, hi + 1))
                continue
            points.add(lo)
            for size in sizes:
                for rest in {(1 - self.lookahead) % size, 1 % size, 2 % size,
                             (1 - self.lookahead - 2 * self.draft_tokens) % size}:
                    points.update(range(lo + (rest - lo) % size, hi + 1, size))
        return points

    def decode_peak(self, n: int) -> int:
        """The step on the way to ``n`` computed tokens whose decode holding is largest."""
        n = max(1, min(int(n), self.max_model_len))
        return max(self._candidates(n), key=lambda m: (self._decode_total(m), m))

    def decode_need(self, n: int) -> int:
        """The least peak holding of a request that decodes up to ``n`` computed tokens."""
        return self._decode_total(self.decode_peak(n))

    def decode_fits(self, n: int) -> bool:
        """Whether decoding up to ``n`` computed tokens can ever be held (False is a
        proof whatever the prefix cache holds: these blocks must all be in the pool)."""
        return self.decode_need(n) <= self.usable

    # ---------------------------------------------------------------- admission, prefill
    def chunks(self, n: int, prompt: int | None = None, begin: tuple = (0, 0)):
        """(computed, new, previous new) per step of a lone request's (re)prefill of
        ``n`` tokens (``prompt``: its prompt, ``n`` for a new request); None as a chunk
        when the scheduler can never schedule the next one. ``begin``: (computed, previous
        new) to walk on from, a chunk start of the same walk."""
        s, (done, prev) = self.schedule, begin
        if not s.chunked and n > s.budget:
            yield None
            return
        while done < n:
            c = min(n - done, s.budget, self.max_model_len - done)
            if s.split is not None:
                c = s.split(done, c, n, n if prompt is None else prompt)
            if c <= 0:
                yield None
                return
            yield done, c, prev
            done, prev = done + c, c

    def admission(self, n: int, prefill_end: int | None = None) -> tuple[int, str]:
        """(blocks, what binds) the most a lone (re)admission of ``n`` tokens needs at
        once: vLLM's gate count, or the largest prefill chunk's holding."""
        n = max(1, min(int(n), self.max_model_len))
        key = ("a", n, prefill_end)
        got = self._cache.get(key)
        if got is not None:
            return got
        best = (0, "nothing")
        if self.schedule.gate and self.gate is not None:
            per = self.gate(n, n if prefill_end is None else prefill_end)
            best = (sum(per), "admission gate: " + self._parts(enumerate(per)))
        prompt = None if prefill_end is None else min(prefill_end, n)
        for chunk in self.chunks(n, prompt):
            if chunk is None:
                best = (self.usable + 1, f"token budget {self.schedule.budget}: no chunk "
                        "of it can be scheduled")
                break
            done, c, prev = chunk
            per = self._chunk_hold(done, c, prev,
                                   n if prefill_end is None else max(prefill_end, n - 1))
            total = sum(b for _, b in per)
            if total > best[0]:
                best = (total, f"prefill chunk {done}-{done + c}: " + self._parts(per))
        self._cache[key] = best
        return best

    def _chunk_hold(self, done: int, c: int, prev: int, prefill_end: int) -> list:
        """Per group, held by the prefill chunk ``[done, done + c)`` after one of ``prev``
        tokens: the async scheduler's unsettled chunk delays frees (``allocate_slots``
        frees on ``num_computed_tokens - num_in_flight_tokens``)."""
        lag = prev if self.schedule.in_flight else 0
        return self._hold(done + c, done, max(0, done - lag), prefill_end)

    def admits(self, n: int, prefill_end: int | None = None) -> bool:
        return self.admission(n, prefill_end)[0] <= self.usable

    def start(self, n: int) -> tuple[int, str]:
        """(blocks, what binds) the first decode step after a lone prefill of ``n`` tokens
        holds. The async scheduler schedules it before the last chunk ``c`` settles:
        ``allocate_slots`` frees on ``num_computed_tokens - num_in_flight_tokens`` (0.32
        kv_cache_manager.py 555-558, 0.34 584-588), so nothing below ``n - c`` is freed
        while ``1 + k`` new slots (the sampled token, ``k`` draft placeholders) are
        taken. Synchronous: the step frees first (a decode step, :meth:`decode_fits`)."""
        n = max(1, min(int(n), self.max_model_len))
        key = ("s", n)
        got = self._cache.get(key)
        if got is None:
            got, last = (0, "nothing"), None
            if self.schedule.in_flight:
                for last in self.chunks(n):
                    pass
            if last is not None:
                done = last[0]
                per = self._start_hold(n, done)
                got = (sum(b for _, b in per),
                       f"first decode step after prefill chunk {done}-{n}: "
                       + self._parts(per))
            self._cache[key] = got
        return got

    def _start_hold(self, n: int, done: int) -> list:
        """Per group, held by the first decode step after a prefill of ``n`` tokens whose
        last chunk starts at ``done`` and has not settled (:meth:`start`)."""
        return self._hold(n + 1 + self.draft_tokens, n, done, n)

    def starts(self, n: int) -> bool:
        """Whether a lone prompt of ``n`` tokens is admitted, prefilled and decodes its
        first token, or completes anyway: with prefix caching a request preempted there
        re-enters on the blocks it has just freed (a hit; measured on the scheduler),
        except where a Mamba ``align`` group keeps states only at checkpoints
        (:meth:`_unrescued`)."""
        return self.admits(n) and ((self.schedule.caching and not self._unrescued())
                                   or self.start(n)[0] <= self.usable)

    def _unrescued(self) -> bool:
        """Prefix caching with a Mamba ``align`` group: a request preempted at its first
        decode step re-enters on a hit that stops at the group's last checkpoint, and the
        re-entry is preempted again, or hangs (``full+chunked64+mamba[align] nb=13 B=512
        pc ngram:2 async``, vLLM 0.34.0: prompts 62-64 hang with totals of 65 and more,
        81 = ``P + 1`` included)."""
        return self.schedule.caching and any(
            getattr(spec, "mamba_cache_mode", None) == "align" for _, spec in self.groups)

    def _parts(self, per) -> str:
        kinds = dict(self.groups)
        return ", ".join(f"group {i} ({describe(kinds[i])}) {b}" for i, b in per
                         if i in kinds)

    # ------------------------------------------------------------------------ limits
    @property
    def prompt_limit(self) -> int:
        """The longest prompt the scheduler ever admits and prefills (0: none); at most
        ``max_model_len - 1``: a prompt must leave room for the token it samples. Where a
        preempted re-entry is not rescued by its hit (:meth:`_unrescued`), no prompt over
        the start limit is let through (its re-admissions are not the ones
        :attr:`start_limit` counts on)."""
        p = min(self._largest("prompt", self.admits), self.max_model_len - 1)
        if self._unrescued() and self.schedule.in_flight:
            p = min(p, self._largest("start", self.starts))
        return p

    @property
    def start_limit(self) -> int:
        """The longest prompt that also decodes its first token (at most
        :attr:`prompt_limit`). A longer one is preempted right after its prefill and
        re-admitted one token longer each time, so it completes only if its total is at
        most ``prompt_limit + 1`` (its last re-admission samples that token)."""
        return min(self._largest("start", self.starts), self.prompt_limit)

    def total_for(self, prompt: int) -> int:
        """The largest prompt + ``max_tokens`` that completes for a lone ``prompt``."""
        if prompt > self.prompt_limit:
            return 0
        if prompt > self.start_limit:
            return min(self.prompt_limit + 1, self.total_limit)
        return self.total_limit

    @property
    def decode_limit(self) -> int:
        """The most computed tokens any schedule can hold (``max_model_len``: all)."""
        return self._largest("decode", self.decode_fits)

    @property
    def total_limit(self) -> int:
        """The largest prompt + ``max_tokens`` that can complete: the last token is
        sampled, never computed, so one more than the decode limit."""
        if self.prompt_limit == 0:
            return 0
        # a step that cannot be held preempts the request; re-admitted and recomputed it
        # samples one more token, so every length the gate re-admits also progresses
        return min(max(self.decode_limit, self._largest("prompt", self.admits)) + 1,
                   self.max_model_len)

    def _largest(self, name: str, ok) -> int:
        """The largest ``n`` with ``ok(m)`` for every ``m <= n``: the edge a bisection finds,
        then, for admission (``prompt``, ``start``), the first hole below it
        (:meth:`_below_first_failure`)."""
        got = self._cache.get(name)
        if got is None:
            lo, hi = 0, self.max_model_len
            if ok(hi):
                lo = hi
            while hi - lo > 1:              # ok(lo) (or lo == 0), not ok(hi)
                mid = (lo + hi) // 2
                lo, hi = (mid, hi) if ok(mid) else (lo, mid)
            if name != "decode":
                lo = self._below_first_failure(name, ok, lo)
            got = self._cache[name] = lo
        return got

    def _below_first_failure(self, name: str, ok, top: int) -> int:
        """One below the smallest ``n < top`` that is not ``ok``, else ``top``. What
        admitting ``n`` holds is not monotone in ``n``: the last prefill chunks are cut
        where ``n`` falls (Mamba align chunks at block boundaries, a checkpoint block at the
        prompt's end), so a prompt can need more than a longer one (``full+mamba[align]
        nb=18 B=24 pc``, vLLM 0.32.0: 225-232 hang, 233-240 complete). vLLM's gate count and
        the chunks every longer prompt also takes only grow with ``n``, and ``ok(top)``
        holds, so only each prompt's last chunks (and, for the start limit, its first
        decode step) are held again here (:meth:`_tail`), for every prompt below ``top``,
        at most :data:`SCAN_PROMPTS` of them (the top ones)."""
        grid = [c[0] for c in self.chunks(top) if c is not None]
        budget, u = max(1, self.schedule.budget), self.usable
        for n in range(max(1, top - SCAN_PROMPTS), top):
            need, done = self._tail(n, grid, budget)
            if name == "start" and need <= u and self.schedule.in_flight and done is not None:
                need = sum(b for _, b in self._start_hold(n, done))
            if need > u and not ok(n):
                return n - 1
        return top

    def _tail(self, n: int, grid: list, budget: int) -> tuple[int, int | None]:
        """(the largest holding of a lone ``n``-token prompt's last prefill chunks, where
        its last chunk starts): walked from the last start of ``grid`` (the chunk starts
        of a longer prompt) at least two budgets below ``n``, where a prompt's chunks stop
        depending on its length; a chunk short of ``n`` holds the same for every prompt
        (cached)."""
        i = bisect.bisect_right(grid, n - 2 * budget) - 1
        begin = (grid[i], grid[i] - grid[i - 1]) if i >= 1 else (0, 0)
        best, done = 0, None
        for chunk in self.chunks(n, begin=begin):
            if chunk is None:
                return self.usable + 1, None
            done, c, prev = chunk
            key = ("h", done, c, prev)
            held = self._cache.get(key) if done + c < n else None
            if held is None:
                held = sum(b for _, b in self._chunk_hold(done, c, prev, n))
                if done + c < n:
                    self._cache[key] = held
            best = max(best, held)
        return best, done

    def binding(self) -> tuple[str, str]:
        """What binds each limit, in words."""
        p, t = self.prompt_limit, self.total_limit
        if p >= self.max_model_len - 1:
            prompt = "max_model_len"
        elif self.admits(p + 1) and p < self._largest("prompt", self.admits):
            prompt = self.start(p + 1)[1]         # lowered to the start limit
        else:
            prompt = self.admission(p + 1)[1]
        if t >= self.max_model_len:
            total = "max_model_len"
        else:
            m = self.decode_peak(t)
            total = f"decoding token {m}: " + self._parts(self.holding(m))
        return prompt, total

    def limits(self) -> dict:
        """The certificate as plain JSON numbers, for the door in another process."""
        prompt, total = self.binding()
        start = self.start_limit
        return {"prompt_limit": self.prompt_limit, "total_limit": self.total_limit,
                "start_limit": start, "max_model_len": self.max_model_len,
                "usable": self.usable, "prompt_group": prompt, "total_group": total,
                "start_group": (self.start(start + 1)[1] if start < self.prompt_limit
                                else "nothing"),
                "statement": self.statement()}

    def statement(self) -> str:
        p, start = self.prompt_limit, self.start_limit
        band = (f"; a prompt over {start} tokens only with prompt + max_tokens <= "
                f"{min(p + 1, self.total_limit)}" if start < p else "")
        return (f"admission limits: prompt <= {p} tokens, prompt + max_tokens <= "
                f"{self.total_limit} tokens{band} ({self.usable} usable blocks, "
                f"max_model_len={self.max_model_len}"
                + (f", lookahead {self.lookahead}" if self.lookahead else "") + ")")

    # ------------------------------------------------------------------- the liveness proof
    def never(self, num_tokens: int, num_prompt_tokens: int) -> str | None:
        """Why a WAITING or PREEMPTED request of ``num_tokens`` can never (re-)enter, or
        None when that is not proven. A sequence that can never be held is proof whatever
        the prefix cache holds; the admission count is proof when no hit can lower it
        (prefix caching off, or every group full attention: a hit block is either counted
        as taken from the free queue or held by another request)."""
        n = min(int(num_tokens), self.max_model_len)
        if n <= self._largest("prompt", self.admits):
            return None         # admitted and prefilled alone: nothing to prove (cheap:
            #                     the liveness guard asks for every new queue head)
        key = ("never", n, int(num_prompt_tokens))
        if key not in self._cache:
            self._cache[key] = self._never(n, int(num_prompt_tokens))
        return self._cache[key]

    def _never(self, n: int, num_prompt_tokens: int) -> str | None:
        # the least any way of computing the sequence holds: token m with all before it
        # computed, no drafts, nothing unsettled (a lower bound in every mode)
        peak = max(self._candidates(n),
                   key=lambda m: (sum(b for _, b in self._hold(m, m - 1, None, n)), m))
        per = self._hold(peak, peak - 1, None, n)
        if sum(b for _, b in per) > self.usable:
            return (f"computing token {peak} holds at least {sum(b for _, b in per)} blocks "
                    f"({self._parts(per)})")
        hit_proof = not self.schedule.caching or all(
            type(spec).__name__ in ("FullAttentionSpec", "MLAAttentionSpec")
            for _, spec in self.groups)
        if hit_proof:
            need, why = self.admission(n, max(int(num_prompt_tokens), n - 1))
            if need > self.usable:
                return f"(re-)admitting {n} tokens takes {need} blocks at once ({why})"
        return None


def _lcm(*values: int) -> int:
    return math.lcm(*values)


def from_scheduler(scheduler) -> Certificate:
    """The certificate of ``scheduler``'s KV cache (vLLM's gate, its lone schedule)."""
    vc, kcc = scheduler.vllm_config, scheduler.kv_cache_config
    try:
        gate = gate_counter(scheduler)
    except AttributeError:              # a vLLM whose manager has no coordinator gate
        gate = None
    return Certificate(groups=tuple(device_groups(kcc)), usable=int(kcc.num_blocks) - 1,
                       max_model_len=int(getattr(scheduler, "max_model_len", 0)
                                         or vc.model_config.max_model_len),
                       schedule=schedule_of(scheduler), lookahead=lookahead_tokens(vc),
                       draft_tokens=num_spec(vc), dcp=dcp_size(vc), gate=gate,
                       checkpoints=checkpointing(scheduler.kv_cache_manager))


_by_scheduler: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def of_scheduler(scheduler) -> Certificate:
    """The certificate of ``scheduler`` (computed once per scheduler)."""
    cert = _by_scheduler.get(scheduler)
    if cert is None:
        cert = _by_scheduler[scheduler] = from_scheduler(scheduler)
    return cert


@hookimpl
def kvguard_startup_report(scheduler):
    """EngineCore's scheduler is built: state its limits and hand them to the door."""
    if scheduler is None:
        return None
    from vllm_kvguard.fixes.estimation import admission

    cert = of_scheduler(scheduler)
    admission.publish(cert.limits())
    return ["  " + cert.statement()]


def from_configs(vllm_config, kv_cache_config) -> Certificate:
    """The certificate of an engine that is not running (``kvguard plan``): vLLM's own
    ``Scheduler`` built from the same configs, then :func:`from_scheduler`."""
    cache = vllm_config.cache_config
    before = cache.num_gpu_blocks             # as vLLM sets it once the pool is sized
    cache.num_gpu_blocks = int(kv_cache_config.num_blocks)
    try:
        return from_scheduler(build_scheduler(vllm_config, kv_cache_config))
    finally:
        cache.num_gpu_blocks = before
