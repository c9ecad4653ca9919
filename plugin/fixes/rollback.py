"""Transactional ``KVCacheManager.allocate_slots``: a half-done allocation is undone.

vLLM checks the block budget once and then mutates group by group; when one group's
estimate is wrong (``MambaManager`` align on external tokens, vllm#46892) or anything
else raises half-way, the error escapes ``Scheduler.schedule`` and EngineCore dies. This
module makes the call atomic and keeps the scheduler's own contract: on failure every
group is restored and the call returns ``None`` ("no room now"), so the scheduler
preempts or waits and schedules the request once room exists.

How: an undo log, not a copy
    A snapshot of everything the call *might* touch costs more than the whole budget
    (5 % of a ~13 us call), so the transaction records what the call *does*, as it does
    it, into one ordered undo log, and costs nothing per call beyond switching the log
    on and off:

    * the per-request containers of every single-type manager (``req_to_blocks`` and
      the block lists in it, ``num_cached_block``, ``_partial_hit_reqs``; Mamba align's
      ``last_state_block_idx``, ``_num_retired_blocks``, ``_allocated_block_reqs``,
      ``_checkpoints``, ``_producer_partial_tail_reqs``, ``cached_blocks_this_step``)
      are swapped once for subclasses of dict/list/set whose mutators append the old
      value to the log while a transaction is open (reads run at C speed, as before);
    * the ``BlockPool`` gets instance attributes shadowing ``get_new_blocks``,
      ``touch``, ``free_blocks``, ``cache_full_blocks``, ``cache_partial_block`` and
      ``move_block_hashes``, which log the blocks, their ref counts and free-queue
      predecessors (O(blocks the call touches));
    * the lists vLLM replaces when it drains them get their length recorded
      (``new_block_ids`` when zeroing is on, Mamba align's
      ``_pending_boundary_state_offloads``); copy-on-write pairs added by the call are
      recognised by their copy block, which the call popped;
    * the extra reference a pending CoW copy holds on a block the call did not pop.

    On failure the log is replayed backwards. Ref counts, free-queue membership and
    order, request lists, dicts and sets end exactly as before the call, including what
    ``remove_skipped_blocks`` freed at its start.

What cannot be undone (and why it is safe)
    * prefix-cache hashes evicted when ``get_new_blocks`` popped a cached free block,
      and the ``BlockRemoved`` KV events already queued for them: the block returns to
      the free queue unhashed;
    * hashes the call registered on blocks it had not computed yet (``cache_blocks``
      runs before the forward pass) are evicted, not restored, and a block whose older
      partial hash was replaced in the call loses both (``BlockRemoved`` follows the
      ``BlockStored``); Mamba's ``_maybe_evict_cached_block`` on a checkpoint block
      stays evicted.
      The prefix cache therefore only ever *forgets* entries: a later request misses and
      recomputes, it never hits a block whose content is not there
      (``test_rollback_prefix_hits_stay_correct`` checks this);
    * KV-cache metrics callbacks and ``unpin_blocks`` reuse watchers already notified.

Not covered (vLLM's behaviour, logged once): coordinators and managers outside the
known set (HiSparse, out-of-tree ``KVCacheSpecRegistry`` managers), whose private state
this module does not know. ``allocate_slots``' own argument check (raised in its body
before anything changed) and ``BaseException`` s are re-raised untouched. If the undo cannot be completed
the original error is re-raised (never ``None`` over inconsistent state).
"""
from __future__ import annotations

import inspect
import logging
import threading
import weakref
from collections import defaultdict

from vllm_kvguard import report
from vllm_kvguard.hookspecs import hookimpl
from vllm_kvguard.log import once

_MISSING = object()

#: Managers whose per-request state this module knows (class names, exact match).
KNOWN_MANAGERS = frozenset({
    "FullAttentionManager", "SlidingWindowManager", "ChunkedLocalAttentionManager",
    "CrossAttentionManager", "SinkFullAttentionManager", "RSWAManager",
    "CircularBufferManager", "MambaManager",
})
KNOWN_COORDINATORS = frozenset({
    "KVCacheCoordinatorNoPrefixCache", "UnitaryKVCacheCoordinator", "HybridKVCacheCoordinator",
})
#: Per-request containers swapped for journaling ones (absent ones are skipped).
JOURNALED_ATTRS = ("req_to_blocks", "num_cached_block", "_partial_hit_reqs",
                   "last_state_block_idx", "_num_retired_blocks", "_allocated_block_reqs",
                   "_checkpoints", "_producer_partial_tail_reqs", "cached_blocks_this_step")


class RollbackFailed(Exception):
    """Internal: the undo could not be completed (the original error is re-raised)."""


class _Unsupported(Exception):
    pass


# ------------------------------------------------------------------------- the undo log
# One transaction at a time per process (the scheduler is single-threaded); writes from
# other threads during a transaction are not logged.
_log: list | None = None
_log_thread: int | None = None
_get_ident = threading.get_ident

# record kinds
_D, _DC, _LN, _LI, _LC, _S, _SC, _POP, _TOUCH, _FREE, _CACHE, _MOVE = range(12)


def _logging() -> list | None:
    log = _log
    if log is not None and _log_thread == _get_ident():
        return log
    return None


class JDict(dict):
    """dict whose mutators log the old value while a transaction is open."""

    __slots__ = ()

    def __setitem__(self, key, value):
        if _log is not None and (log := _logging()) is not None:
            log.append((_D, self, key, dict.get(self, key, _MISSING)))
        dict.__setitem__(self, key, value)

    def __delitem__(self, key):
        if _log is not None and (log := _logging()) is not None and key in self:
            log.append((_D, self, key, dict.__getitem__(self, key)))
        dict.__delitem__(self, key)

    def pop(self, key, *default):
        if _log is not None and (log := _logging()) is not None and key in self:
            log.append((_D, self, key, dict.__getitem__(self, key)))
        return dict.pop(self, key, *default)

    def setdefault(self, key, default=None):
        if _log is not None and (log := _logging()) is not None and key not in self:
            log.append((_D, self, key, _MISSING))
        return dict.setdefault(self, key, default)

    def _copy_first(self):
        if _log is not None and (log := _logging()) is not None:
            log.append((_DC, self, dict(self)))

    def update(self, *args, **kwargs):
        self._copy_first()
        dict.update(self, *args, **kwargs)

    def clear(self):
        self._copy_first()
        dict.clear(self)

    def popitem(self):
        self._copy_first()
        return dict.popitem(self)

    def __ior__(self, other):
        self._copy_first()
        return dict.__ior__(self, other)


class JList(list):
    """list whose mutators log what they overwrite while a transaction is open."""

    __slots__ = ()

    def append(self, item):
        if _log is not None and (log := _logging()) is not None:
            log.append((_LN, self, len(self)))
        list.append(self, item)

    def extend(self, items):
        if _log is not None and (log := _logging()) is not None:
            log.append((_LN, self, len(self)))
        list.extend(self, items)

    def __iadd__(self, items):
        if _log is not None and (log := _logging()) is not None:
            log.append((_LN, self, len(self)))
        return list.__iadd__(self, items)

    def __setitem__(self, index, value):
        if _log is not None and (log := _logging()) is not None:
            if isinstance(index, int):
                n = len(self)
                log.append((_LI, self, index + n if index < 0 else index,
                            list.__getitem__(self, index)))
            else:
                log.append((_LC, self, list(self)))
        list.__setitem__(self, index, value)

    def _copy_first(self):
        if _log is not None and (log := _logging()) is not None:
            log.append((_LC, self, list(self)))

    def __delitem__(self, index):
        self._copy_first()
        list.__delitem__(self, index)

    def insert(self, index, item):
        self._copy_first()
        list.insert(self, index, item)

    def pop(self, *index):
        self._copy_first()
        return list.pop(self, *index)

    def remove(self, item):
        self._copy_first()
        list.remove(self, item)

    def clear(self):
        self._copy_first()
        list.clear(self)

    def sort(self, *args, **kwargs):
        self._copy_first()
        list.sort(self, *args, **kwargs)

    def reverse(self):
        self._copy_first()
        list.reverse(self)

    def __imul__(self, n):
        self._copy_first()
        return list.__imul__(self, n)


class JDefaultDict(defaultdict):
    """``defaultdict(list)`` that journals like :class:`JDict` and makes :class:`JList` s."""

    __slots__ = ()
    __setitem__ = JDict.__setitem__
    __delitem__ = JDict.__delitem__
    pop = JDict.pop
    setdefault = JDict.setdefault
    _copy_first = JDict._copy_first
    update = JDict.update
    clear = JDict.clear
    popitem = JDict.popitem

    def __ior__(self, other):
        self._copy_first()
        return defaultdict.__ior__(self, other)


class JSet(set):
    """set whose mutators log membership while a transaction is open."""

    __slots__ = ()

    def add(self, item):
        if _log is not None and (log := _logging()) is not None:
            log.append((_S, self, item, item in self))
        set.add(self, item)

    def discard(self, item):
        if _log is not None and (log := _logging()) is not None:
            log.append((_S, self, item, item in self))
        set.discard(self, item)

    def remove(self, item):
        if _log is not None and (log := _logging()) is not None:
            log.append((_S, self, item, item in self))
        set.remove(self, item)

    def _copy_first(self):
        if _log is not None and (log := _logging()) is not None:
            log.append((_SC, self, set(self)))

    def pop(self):
        self._copy_first()
        return set.pop(self)

    def clear(self):
        self._copy_first()
        set.clear(self)

    def update(self, *others):
        self._copy_first()
        set.update(self, *others)

    def difference_update(self, *others):
        self._copy_first()
        set.difference_update(self, *others)

    def intersection_update(self, *others):
        self._copy_first()
        set.intersection_update(self, *others)

    def symmetric_difference_update(self, other):
        self._copy_first()
        set.symmetric_difference_update(self, other)

    def __ior__(self, other):
        self._copy_first()
        return set.__ior__(self, other)

    def __isub__(self, other):
        self._copy_first()
        return set.__isub__(self, other)

    def __iand__(self, other):
        self._copy_first()
        return set.__iand__(self, other)

    def __ixor__(self, other):
        self._copy_first()
        return set.__ixor__(self, other)


_JOURNALED_TYPES = (JDict, JDefaultDict, JSet)


def _journaled(value):
    """A journaling copy of ``value`` (None if its type is not one we journal)."""
    kind = type(value)
    if kind is defaultdict and value.default_factory is list:
        new = JDefaultDict(JList)
        for key, blocks in value.items():
            dict.__setitem__(new, key, JList(blocks))
        return new
    if kind is dict:
        return JDict(value)
    if kind is set:
        return JSet(value)
    return None


def _plain(value):
    if type(value) is JDefaultDict:
        return defaultdict(list, {k: list(v) for k, v in value.items()})
    if type(value) is JDict:
        return dict(value)
    if type(value) is JSet:
        return set(value)
    return value


# ------------------------------------------------------------------------- pool journal
def _param_index(func, name: str) -> int | None:
    """Positional index of ``name`` in ``func``'s signature without ``self`` (or None)."""
    try:
        params = list(inspect.signature(func).parameters)
    except (TypeError, ValueError):
        return None
    if params and params[0] == "self":
        params = params[1:]
    return params.index(name) if name in params else None


def _arg(args, kwargs, index, name):
    if name in kwargs:
        return kwargs[name]
    if index is not None and index < len(args):
        return args[index]
    return _MISSING


def _hash_state(block):
    return (block.block_hash, getattr(block, "block_hash_num_tokens", None))


class PoolJournal:
    """Logs what a transaction does to one ``BlockPool``.

    Installed once per pool as instance attributes shadowing the class methods; they
    call the class attribute of ``type(pool)`` each time, so class-level wrappers
    applied later (the fault injector) still run. Outside a transaction each shadow is
    one global test plus the call.
    """

    NAMES = ("get_new_blocks", "touch", "free_blocks", "cache_full_blocks",
             "cache_partial_block", "move_block_hashes")

    def __init__(self, pool):
        self.pool = pool
        self.cls = type(pool)
        self.queue = pool.free_block_queue
        self.broken: str | None = None
        full = getattr(self.cls, "cache_full_blocks", None)
        self._full_idx = {n: _param_index(full, n)
                          for n in ("blocks", "num_cached_blocks", "num_full_blocks")}
        self._partial_idx = _param_index(getattr(self.cls, "cache_partial_block", None),
                                         "block")
        self._installed: list[str] = []

    def install(self) -> None:
        d = vars(self.pool)
        for name in self.NAMES:
            if hasattr(self.cls, name) and name not in d:
                d[name] = getattr(self, "_" + name)
                self._installed.append(name)

    def uninstall(self) -> None:
        d = vars(self.pool)
        for name in self._installed:
            if getattr(d.get(name), "__self__", None) is self:
                del d[name]
        self._installed.clear()

    # -- shadows
    def _get_new_blocks(self, *args, **kwargs):
        if _log is None or (log := _logging()) is None:
            return self.cls.get_new_blocks(self.pool, *args, **kwargs)
        before = self.queue.num_free_blocks
        try:
            blocks = self.cls.get_new_blocks(self.pool, *args, **kwargs)
        except BaseException:
            if self.queue.num_free_blocks != before:
                self.broken = "get_new_blocks failed after popping blocks"
            raise
        log.append((_POP, self, list(blocks)))
        return blocks

    def _touch(self, blocks, *args, **kwargs):
        if _log is None or (log := _logging()) is None:
            return self.cls.touch(self.pool, blocks, *args, **kwargs)
        flat = blocks
        if blocks and isinstance(blocks[0], (list, tuple)):     # older per-group form
            flat = [b for group in blocks for b in group]
        recs = [(b, b.ref_cnt, b.prev_free_block) for b in flat]
        try:
            self.cls.touch(self.pool, blocks, *args, **kwargs)
        except BaseException:
            recs = [r for r in recs if r[0].ref_cnt != r[1]]    # the part that happened
            raise
        finally:
            log.append((_TOUCH, self, recs))

    def _free_blocks(self, ordered_blocks, *args, **kwargs):
        if _log is None or (log := _logging()) is None:
            return self.cls.free_blocks(self.pool, ordered_blocks, *args, **kwargs)
        blocks = list(ordered_blocks)
        pool = self.pool
        recs = [(b, b.ref_cnt) for b in blocks
                if getattr(b, "pool", None) is None or b.pool is pool]
        try:
            return self.cls.free_blocks(pool, blocks, *args, **kwargs)
        except BaseException:
            self.broken = "free_blocks raised"
            raise
        finally:
            log.append((_FREE, self, recs))

    def _cache_full_blocks(self, *args, **kwargs):
        if _log is None or (log := _logging()) is None:
            return self.cls.cache_full_blocks(self.pool, *args, **kwargs)
        idx = self._full_idx
        blocks = _arg(args, kwargs, idx["blocks"], "blocks")
        start = _arg(args, kwargs, idx["num_cached_blocks"], "num_cached_blocks")
        end = _arg(args, kwargs, idx["num_full_blocks"], "num_full_blocks")
        if _MISSING in (blocks, start, end):
            self.broken = "cache_full_blocks arguments not recognised"
            recs = []
        else:
            recs = [(b, _hash_state(b)) for b in blocks[start:end]]
        try:
            return self.cls.cache_full_blocks(self.pool, *args, **kwargs)
        finally:
            log.append((_CACHE, self, recs))

    def _cache_partial_block(self, *args, **kwargs):
        if _log is None or (log := _logging()) is None:
            return self.cls.cache_partial_block(self.pool, *args, **kwargs)
        block = _arg(args, kwargs, self._partial_idx, "block")
        if block is _MISSING:
            self.broken = "cache_partial_block arguments not recognised"
            recs = []
        else:
            recs = [(block, _hash_state(block))]
        try:
            return self.cls.cache_partial_block(self.pool, *args, **kwargs)
        finally:
            log.append((_CACHE, self, recs))

    def _move_block_hashes(self, src, dst, *args, **kwargs):
        if _log is None or (log := _logging()) is None:
            return self.cls.move_block_hashes(self.pool, src, dst, *args, **kwargs)
        result = self.cls.move_block_hashes(self.pool, src, dst, *args, **kwargs)
        log.append((_MOVE, self, (src, dst)))
        return result

    # -- undo, one record at a time (newest first)
    def undo(self, kind, data) -> None:
        pool, queue = self.pool, self.queue
        if kind == _POP:
            hashed_extra = getattr(pool, "cached_block_hashes_by_block", {})
            for b in data:
                if b.block_hash is not None or b.block_id in hashed_extra:
                    pool._maybe_evict_cached_block(b)       # set during the call
                b.ref_cnt = 0
            _prepend(queue, data)
        elif kind == _TOUCH:
            for b, ref, _ in reversed(data):
                b.ref_cnt = ref
            _reinsert(queue, [(b, prev) for b, ref, prev in data
                              if ref == 0 and not b.is_null])
        elif kind == _FREE:
            for b, ref in reversed(data):
                if b.ref_cnt == 0 and ref > 0 and not b.is_null:
                    queue.remove(b)
                b.ref_cnt = ref
        elif kind == _CACHE:
            for b, state in data:
                if not b.is_null and _hash_state(b) != state:
                    pool._maybe_evict_cached_block(b)
        elif kind == _MOVE:
            src, dst = data
            if src.block_hash is None and dst.block_hash is not None:
                self.cls.move_block_hashes(pool, dst, src)


def _prepend(queue, blocks) -> None:
    if not blocks:
        return
    prepend = getattr(queue, "prepend_n", None)
    if prepend is not None:
        prepend(blocks)
        return
    head = queue.fake_free_list_head
    for b in reversed(blocks):
        _insert_after(queue, head, b)


def _reinsert(queue, recs) -> None:
    """Put touched eviction candidates back behind their old predecessors.

    ``recs`` holds (block, predecessor before the touch); a predecessor is either in the
    queue again or itself in ``recs``, so each chain is rebuilt from its root.
    """
    if not recs:
        return
    removed = {id(b) for b, _ in recs}
    after = {id(prev): b for b, prev in recs if prev is not None}
    for b, prev in recs:
        if prev is not None and id(prev) in removed:
            continue
        _insert_after(queue, prev, b)
        nxt = after.get(id(b))
        while nxt is not None:
            _insert_after(queue, b, nxt)
            b, nxt = nxt, after.get(id(nxt))


def _insert_after(queue, prev, block) -> None:
    """Link ``block`` into the free queue right behind ``prev`` (else at the tail)."""
    if prev is None or (prev is not queue.fake_free_list_head
                        and prev.prev_free_block is None):
        queue.append(block)
        return
    nxt = prev.next_free_block
    block.prev_free_block = prev
    block.next_free_block = nxt
    prev.next_free_block = block
    nxt.prev_free_block = block
    queue.num_free_blocks += 1


# ------------------------------------------------------------------------- per-manager plan
class Plan:
    """What the transaction needs for one ``KVCacheManager`` (built once, cached on it)."""

    __slots__ = ("manager", "managers", "gids", "journal", "queue", "swapped", "record_ids",
                 "offloads", "__weakref__")

    def __init__(self, manager, managers, journal):
        self.manager = manager
        self.managers = managers
        self.gids = {id(m): getattr(m, "kv_cache_group_id", i) for i, m in enumerate(managers)}
        self.journal = journal
        self.queue = journal.queue
        self.swapped: list[tuple[object, str]] = []
        #: managers whose ``new_block_ids`` list (replaced when drained) is appended to
        self.record_ids = tuple(m for m in managers if getattr(m, "_record_new_block_ids", False)
                                and isinstance(getattr(m, "new_block_ids", None), list))
        self.offloads = tuple(m for m in managers
                              if getattr(m, "mamba_cache_mode", None) == "align"
                              and isinstance(getattr(m, "_pending_boundary_state_offloads",
                                                     None), list))

    def swap_containers(self) -> None:
        for m in self.managers:
            for name in JOURNALED_ATTRS:
                value = getattr(m, name, None)
                if isinstance(value, _JOURNALED_TYPES):
                    continue
                new = _journaled(value)
                if new is not None:
                    setattr(m, name, new)
                    self.swapped.append((m, name))

    def containers_intact(self) -> bool:
        return all(isinstance(getattr(m, name, None), _JOURNALED_TYPES)
                   for m, name in self.swapped)

    def restore_containers(self) -> None:
        for m, name in self.swapped:
            setattr(m, name, _plain(getattr(m, name)))
        self.swapped.clear()


_ATTR = "_kvguard_rollback_plan"
_UNSUPPORTED = "unsupported"
_plans: "weakref.WeakSet[Plan]" = weakref.WeakSet()
_disabled: list[str] = []        # set on an internal error: rollback is off in this process


def plan_for(manager) -> Plan | None:
    """The cached plan for ``manager``, built on first use; None if not supported."""
    plan = manager.__dict__.get(_ATTR)
    if plan is None:
        plan = _build_plan(manager)
        manager.__dict__[_ATTR] = plan
    return None if plan is _UNSUPPORTED else plan


def _unsupported_reason(coord, managers) -> str | None:
    if coord is None or managers is None:
        return "a KVCacheManager without coordinator.single_type_managers"
    if type(coord).__name__ not in KNOWN_COORDINATORS:
        return f"coordinator {type(coord).__name__}"
    unknown = sorted({type(m).__name__ for m in managers} - KNOWN_MANAGERS)
    if unknown:
        return f"manager(s) {', '.join(unknown)}"
    pools = {id(getattr(m, "block_pool", None)) for m in managers}
    if len(pools) != 1 or getattr(managers[0], "block_pool", None) is None:
        return f"{len(pools)} block pools"
    return None


def _build_plan(manager):
    coord = getattr(manager, "coordinator", None)
    managers = getattr(coord, "single_type_managers", None)
    why = _unsupported_reason(coord, managers)
    if why is not None:
        once(logging.WARNING, ("rollback-unsupported", why),
             "vllm-kvguard: transactional allocate_slots is not available for %s; "
             "allocation errors there are not rolled back (vLLM's behaviour)", why)
        return _UNSUPPORTED
    pool = managers[0].block_pool
    journal = pool.__dict__.get("_kvguard_journal")
    if journal is None:
        journal = PoolJournal(pool)
        journal.install()
        pool.__dict__["_kvguard_journal"] = journal
    plan = Plan(manager, tuple(managers), journal)
    plan.swap_containers()
    _plans.add(plan)
    return plan


def uninstall_all() -> None:
    """Undo every swap and shadow this module installed (the allocator patch's teardown)."""
    for plan in list(_plans):
        plan.restore_containers()
        plan.manager.__dict__.pop(_ATTR, None)
        journal = plan.journal
        journal.uninstall()
        journal.pool.__dict__.pop("_kvguard_journal", None)
    _plans.clear()
    _disabled.clear()


# ------------------------------------------------------------------------- transaction
def transact(manager, request, fn, args=(), kwargs=None):
    """Run ``fn(*args, **kwargs)`` (vLLM's ``allocate_slots``) as a transaction.

    Returns its result, or None after rolling back a failure; re-raises vLLM's error when
    there was nothing to roll back or the undo failed. Never raises an error of its own.
    """
    global _log, _log_thread
    if kwargs is None:
        kwargs = {}
    if _disabled or _log is not None:          # off, or nested: run unprotected
        return fn(*args, **kwargs)
    try:
        plan = manager.__dict__.get(_ATTR)
        if plan is None:
            plan = plan_for(manager) or _UNSUPPORTED
        lens = offl = None
        if plan is _UNSUPPORTED:
            raise _Unsupported
        if plan.record_ids:
            lens = []
            for m in plan.record_ids:
                lens.append(len(m.new_block_ids))
        if plan.offloads:
            offl = []
            for m in plan.offloads:
                offl.append(len(m._pending_boundary_state_offloads))
        free_before = plan.queue.num_free_blocks
        ok = True
    except _Unsupported:
        ok = False
    except Exception as exc:
        _disable(exc)
        ok = False
    if not ok:
        return fn(*args, **kwargs)
    log = []
    _log_thread = _get_ident()
    _log = log
    try:
        return fn(*args, **kwargs)
    except Exception as error:
        _log = None
        return _recover(plan, log, lens, offl, free_before, manager, request, error)
    finally:
        _log = None


def _disable(exc: Exception) -> None:
    _disabled.append(type(exc).__name__)
    report.count("internal_error", "rollback")
    once(logging.ERROR, ("rollback-internal",),
         "vllm-kvguard: internal error in the allocator rollback (%s: %s); allocation "
         "errors are no longer rolled back in this process (vLLM's behaviour)",
         type(exc).__name__, exc)


def rollback(plan: Plan, log: list, lens, offl, free_before: int) -> bool:
    """Replay ``log`` backwards. Returns whether anything had changed; raises
    RollbackFailed when the state cannot be restored (nothing is guaranteed then)."""
    journal = plan.journal
    if journal.broken:
        why, journal.broken = journal.broken, None
        raise RollbackFailed(why)
    if not plan.containers_intact():
        plan.swap_containers()
        raise RollbackFailed("a per-request container was replaced; re-journaled it")
    popped = {id(b) for rec in log if rec[0] == _POP for b in rec[2]}
    pooled = set(popped)
    for rec in log:
        if rec[0] in (_TOUCH, _FREE):
            pooled.update(id(r[0]) for r in rec[2])
    changed = bool(log)
    # copy-on-write pairs the call queued: their copy block was popped by the call
    for m in plan.managers:
        pending = getattr(m, "_pending_cow_copies", None)
        if not pending:
            continue
        n = len(pending)
        while n and id(pending[n - 1][1]) in popped:
            n -= 1
        for src, cow in pending[n:]:
            changed = True
            for b in (src, cow):
                if id(b) not in pooled:      # the copy's extra ref on a block held before
                    b.ref_cnt -= 1
        del pending[n:]
    for m, n in zip(plan.record_ids, lens or ()):
        del m.new_block_ids[n:]
    for m, n in zip(plan.offloads, offl or ()):
        del m._pending_boundary_state_offloads[n:]
    undo = journal.undo
    for rec in reversed(log):
        kind = rec[0]
        if kind == _D:
            if rec[3] is _MISSING:
                dict.pop(rec[1], rec[2], None)
            else:
                dict.__setitem__(rec[1], rec[2], rec[3])
        elif kind == _LN:
            list.__delitem__(rec[1], slice(rec[2], None))
        elif kind == _LI:
            list.__setitem__(rec[1], rec[2], rec[3])
        elif kind == _S:
            (set.add if rec[3] else set.discard)(rec[1], rec[2])
        elif kind == _DC:
            dict.clear(rec[1])
            dict.update(rec[1], rec[2])
        elif kind == _LC:
            list.__setitem__(rec[1], slice(None), rec[2])
        elif kind == _SC:
            set.clear(rec[1])
            set.update(rec[1], rec[2])
        else:
            undo(kind, rec[2])
    if journal.queue.num_free_blocks != free_before:
        raise RollbackFailed(f"{journal.queue.num_free_blocks} free blocks after the undo, "
                             f"{free_before} before the call")
    return changed


def failing_group(plan: Plan, error: BaseException):
    """KV-cache group id of the innermost manager frame in ``error``'s traceback."""
    group = None
    tb = error.__traceback__
    while tb is not None:
        local = tb.tb_frame.f_locals
        for name in ("self", "manager"):           # a manager's method, or the
            gid = plan.gids.get(id(local.get(name)))  # coordinator's loop over managers
            if gid is not None:
                group = gid
                break
        tb = tb.tb_next
    return group


def _raised_by_itself(error: BaseException, manager) -> bool:
    """Whether ``allocate_slots`` raised in its own body (its argument check), not in
    anything it called."""
    tb = error.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    frame = tb.tb_frame
    return frame.f_code.co_name == "allocate_slots" and frame.f_locals.get("self") is manager


def _recover(plan, log, lens, offl, free_before, manager, request, error):
    rid = getattr(request, "request_id", request)
    try:
        changed = rollback(plan, log, lens, offl, free_before)
    except Exception as exc:
        report.count("rollback_failed", type(error).__name__)
        once(logging.ERROR, ("rollback-failed", type(exc).__name__),
             "vllm-kvguard: could not roll back the failed KV allocation of request %s "
             "(%s: %s); re-raising vLLM's error %s: %s", rid, type(exc).__name__, exc,
             type(error).__name__, error)
        raise error from None
    if not changed and _raised_by_itself(error, manager):
        raise error                   # allocate_slots' own argument check: vLLM's error
    cause = type(error).__name__
    group = failing_group(plan, error)
    report.count("rollback", cause)
    once(logging.WARNING, ("rollback", cause),
         "vllm-kvguard: rolled back a half-done KV allocation of request %s (KV-cache "
         "group %s, %s: %s); the scheduler sees 'no room now' and retries later. Further "
         "rollbacks with this cause are counted (report category 'rollback'), not logged",
         rid, group, cause, error)
    _notify(manager, request, group, error)
    return None


def _notify(manager, request, group, error) -> None:
    from vllm_kvguard.manager import hook

    try:
        hook().kvguard_allocation_rolled_back(manager=manager, request=request,
                                              group=group, error=error)
    except Exception as exc:   # a listener's bug must not turn a rollback into a crash
        once(logging.ERROR, ("rolled-back-listener", type(exc).__name__),
             "vllm-kvguard: a kvguard_allocation_rolled_back hook raised %s: %s",
             type(exc).__name__, exc)


# ------------------------------------------------------------------------- the hookimpl
@hookimpl
def kvguard_allocate_slots(manager, request, call):
    return transact(manager, request, call)


#: Lets the allocator patch call :func:`transact` directly while this is the only
#: ``kvguard_allocate_slots`` implementation (see patches/allocator.py, "Hot path").
kvguard_allocate_slots.kvguard_direct = transact
