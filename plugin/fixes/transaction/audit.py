"""Audit mode (``KVGUARD_AUDIT=1``): verify the block pool's invariants after every step.

:func:`audit_manager` checks one ``KVCacheManager`` (what tests and the A/B tool call to
count leaked blocks); :func:`audit_scheduler` adds what only the scheduler knows (blocks
whose free is deferred, which request ids are alive). The hookimpl runs the latter after
each ``Scheduler.schedule()`` when audit mode is on and reports every violation with the
request ids involved (one log line per kind and request, counter ``audit_violation``).

Invariants (null block excluded: vLLM does not maintain its ref count)
    * the free queue is a consistent doubly linked list whose length is
      ``num_free_blocks``, holding no block twice, no null block, only ``ref_cnt == 0``;
    * every other block is held: its ``ref_cnt`` equals the number of its holders
      (request block lists of every group, pending copy-on-write pairs, deferred frees),
      and no block is both free and held;
    * so free + held + null = total; a block that is neither free nor held is *leaked*;
    * per request and group: no block twice in one list, ``num_cached_block`` only for a
      request that has a list and never beyond its length;
    * no request id the scheduler no longer knows still holds blocks, and no request
      waiting with nothing computed (WAITING/PREEMPTED, ``num_computed_tokens == 0``: the
      state a half-done allocation leaves behind) holds any.
"""
from __future__ import annotations

import logging
import weakref
from collections import Counter
from dataclasses import dataclass, field

from vllm_kvguard import report
from vllm_kvguard.hookspecs import hookimpl
from vllm_kvguard.log import once


@dataclass(frozen=True)
class Violation:
    kind: str
    detail: str
    request_ids: tuple[str, ...] = ()
    block_id: int | None = None

    def __str__(self) -> str:
        reqs = f" (requests {', '.join(self.request_ids)})" if self.request_ids else ""
        return f"{self.kind}: {self.detail}{reqs}"


@dataclass
class AuditResult:
    total: int = 0          # blocks in the pool, null block included
    free: int = 0           # in the free queue (eviction candidates included)
    held: int = 0           # neither free nor null
    leaked: int = 0         # held by nobody the audit knows of
    violations: list[Violation] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.violations

    def summary(self) -> str:
        head = (f"total {self.total} = free {self.free} + held {self.held} + null 1; "
                f"leaked {self.leaked}")
        return head if self.ok else head + "; " + "; ".join(map(str, self.violations[:5]))


_GONE = object()     # the pool of a block whose weakly referenced pool is gone


def _pool_of(block):
    """The pool a block belongs to (None: vLLM does not say): vLLM 0.34 keeps it as a
    ``weakref.ref``, older releases as the pool itself."""
    pool = getattr(block, "pool", None)
    if isinstance(pool, weakref.ReferenceType):
        pool = pool()
        return _GONE if pool is None else pool
    return pool


def _free_list(pool, result: AuditResult) -> set[int]:
    queue = pool.free_block_queue
    head, tail = queue.fake_free_list_head, queue.fake_free_list_tail
    seen: set[int] = set()
    prev, cur = head, head.next_free_block
    limit = len(pool.blocks) + 1
    while cur is not None and cur is not tail and len(seen) <= limit:
        if cur.prev_free_block is not prev:
            result.violations.append(Violation("free_list_broken", "prev/next links disagree",
                                               block_id=cur.block_id))
            break
        if cur.block_id in seen:
            result.violations.append(Violation("free_list_cycle", "block twice in the queue",
                                               block_id=cur.block_id))
            break
        seen.add(cur.block_id)
        prev, cur = cur, cur.next_free_block
    if cur is None:
        result.violations.append(Violation("free_list_broken", "queue not closed by its tail"))
    if len(seen) != queue.num_free_blocks:
        result.violations.append(Violation(
            "free_count", f"num_free_blocks={queue.num_free_blocks} but the queue holds "
                          f"{len(seen)}"))
    return seen


def audit_manager(manager, *, extra_holders=(), known_requests=None, idle_requests=(),
                  attribute_refs: bool = True) -> AuditResult:
    """Check ``manager``'s pool and per-request bookkeeping; see the module docstring.

    ``extra_holders``: blocks referenced outside the manager (each occurrence holds one
    ref). ``known_requests``: the live request ids (None: any id may hold blocks).
    ``idle_requests``: ids that must hold no block (waiting with nothing computed).
    ``attribute_refs=False`` skips the ref-count equality (refs held by a KV connector).
    """
    pool = manager.block_pool
    result = AuditResult(total=len(pool.blocks))
    free = _free_list(pool, result)
    holders: Counter[int] = Counter()
    owners: dict[int, set[str]] = {}
    for group, m in enumerate(manager.coordinator.single_type_managers):
        ncb = getattr(m, "num_cached_block", {})
        for rid, blocks in m.req_to_blocks.items():
            ids = [b.block_id for b in blocks
                   if not b.is_null and _pool_of(b) in (None, pool)]
            for bid, n in Counter(ids).items():
                if n > 1:
                    result.violations.append(Violation(
                        "duplicate_block", f"group {group} lists block {bid} {n} times",
                        (rid,), bid))
            holders.update(ids)
            for bid in ids:
                owners.setdefault(bid, set()).add(rid)
            if ids and known_requests is not None and rid not in known_requests:
                result.violations.append(Violation(
                    "orphaned_request", f"group {group}: {len(ids)} blocks held by a request "
                                        f"the scheduler no longer knows", (rid,)))
            elif ids and rid in idle_requests:
                result.violations.append(Violation(
                    "waiting_request_holds_blocks", f"group {group}: {len(ids)} blocks held "
                    f"by a request waiting with nothing computed (a half-done allocation)",
                    (rid,)))
            cached = ncb.get(rid)
            if cached is not None and cached > len(blocks):
                result.violations.append(Violation(
                    "num_cached_block", f"group {group}: {cached} cached > {len(blocks)} "
                                        f"blocks", (rid,)))
        for rid, cached in ncb.items():
            # a count of 0 claims nothing (vLLM 0.34's HiSparse hot group sets it so for a
            # request it holds no blocks for)
            if cached and rid not in m.req_to_blocks:
                result.violations.append(Violation(
                    "num_cached_block", f"group {group}: cached count without a block list",
                    (rid,)))
        for pair in getattr(m, "_pending_cow_copies", ()):
            holders.update(b.block_id for b in pair if not b.is_null)
    holders.update(b.block_id for b in extra_holders if not b.is_null)

    for block in pool.blocks:
        if block.is_null:
            if block.block_id in free:
                result.violations.append(Violation("null_free", "null block in the free queue",
                                                   block_id=block.block_id))
            continue
        bid, n = block.block_id, holders.get(block.block_id, 0)
        rids = tuple(sorted(owners.get(bid, ())))
        if bid in free:
            result.free += 1
            if n:
                result.violations.append(Violation(
                    "free_and_held", f"block {bid} is free and held {n} times", rids, bid))
            if block.ref_cnt != 0:
                result.violations.append(Violation(
                    "free_with_refs", f"free block {bid} has ref_cnt {block.ref_cnt}",
                    rids, bid))
            continue
        result.held += 1
        if n == 0:
            result.leaked += 1
            result.violations.append(Violation(
                "leaked", f"block {bid} (ref_cnt {block.ref_cnt}) is neither free nor held",
                block_id=bid))
        elif attribute_refs and block.ref_cnt != n:
            result.violations.append(Violation(
                "ref_mismatch", f"block {bid} has ref_cnt {block.ref_cnt} but {n} holders",
                rids, bid))
    return result


def _idle(requests) -> set[str]:
    from vllm.v1.request import RequestStatus

    waiting = (RequestStatus.WAITING, RequestStatus.PREEMPTED)
    return {rid for rid, r in requests.items()
            if r.status in waiting and r.num_computed_tokens == 0}


def audit_scheduler(scheduler) -> AuditResult:
    """:func:`audit_manager` plus the scheduler's deferred frees and live request ids."""
    extra = [b for _, blocks in getattr(scheduler, "deferred_frees", ()) for b in blocks]
    requests = getattr(scheduler, "requests", None)
    return audit_manager(scheduler.kv_cache_manager, extra_holders=extra,
                         known_requests=requests,
                         idle_requests=_idle(requests) if requests is not None else (),
                         attribute_refs=getattr(scheduler, "connector", None) is None)


def audit_kv_cache_manager(manager, scheduler=None) -> list[Violation]:
    """The violations in ``manager`` (its scheduler's view too when given): the entry
    point of the workload runner and the A/B tool; empty when the pool is consistent."""
    if scheduler is not None and getattr(scheduler, "kv_cache_manager", None) is manager:
        return audit_scheduler(scheduler).violations
    return audit_manager(manager).violations


def report_violations(result: AuditResult, where: str = "after schedule") -> None:
    """Count every violation; log one line per kind and request (per kind without one)."""
    for v in result.violations:
        report.count("audit_violation", v.kind)
    by_kind: dict[str, list[Violation]] = {}
    for v in result.violations:
        by_kind.setdefault(v.kind, []).append(v)
    for kind, found in by_kind.items():
        for rid in sorted({r for v in found for r in v.request_ids}) or [None]:
            mine = [v for v in found if rid is None or rid in v.request_ids]
            once(logging.ERROR, ("audit", kind, rid),
                 "vllm-kvguard audit (%s): %d x %s%s; e.g. %s [%s]", where, len(mine), kind,
                 f" for request {rid}" if rid else "", mine[0].detail,
                 result.summary().split(";")[0])


class Audit:
    """Audit mode as a hookimpl object (registered only with ``KVGUARD_AUDIT=1``)."""

    @hookimpl
    def kvguard_after_schedule(self, scheduler, output):
        try:
            result = audit_scheduler(scheduler)
        except Exception as exc:       # fail open: the audit never takes the engine down
            once(logging.ERROR, ("audit-internal", type(exc).__name__),
                 "vllm-kvguard: internal error in the audit (%s: %s); audit skipped",
                 type(exc).__name__, exc)
            return
        report.count("audit", "steps")
        if not result.ok:
            report_violations(result)
