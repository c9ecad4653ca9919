"""Transactional ``KVCacheManager.allocate_slots``: a half-done allocation is undone.

vLLM checks the block budget once and then mutates group by group; when one group's
estimate is wrong (``MambaManager`` align on external tokens, vllm#46892) or anything
else raises half-way, the error escapes ``Scheduler.schedule`` and EngineCore dies. This
module makes the call atomic and keeps the scheduler's own contract: on failure every
group is restored and the call returns ``None`` ("no room now"), so the scheduler
preempts or waits and schedules the request once room exists.

The state a rollback restores
    exactly what vLLM itself leaves when ``allocate_slots`` returns None at its capacity
    check: ``remove_skipped_blocks`` (which frees blocks no step will read again) and the
    Mamba predictor's ``_checkpoints`` entry for this attempt are kept, as on vLLM's own
    "no room" path; everything the allocation did after the check is undone.

What is recorded (O(blocks the call touches); never a copy of a request's block list)
    * before the call, the request's entry in each group: the ``req_to_blocks`` list
      object and its length (lists only grow during the call), ``num_cached_block``,
      ``_partial_hit_reqs``; for ``MambaManager`` in align mode also its last
      ``num_speculative_blocks`` block-table entries (the only ones it rewrites in place:
      relocation), ``last_state_block_idx``, ``_allocated_block_reqs`` membership,
      ``_producer_partial_tail_reqs`` and the length of
      ``_pending_boundary_state_offloads``; ``new_block_ids`` lengths where vLLM zeroes
      new blocks;
    * during the call, a log of the block-pool operations it makes: the ``BlockPool``
      gets instance attributes shadowing ``get_new_blocks``, ``touch``,
      ``cache_full_blocks``, ``cache_partial_block`` and ``move_block_hashes``; they log
      the blocks, their ref counts and free-queue predecessors and the hash state they
      change (a global test outside a transaction);
    * copy-on-write pairs the call queued are recognised by their copy block, which the
      call popped; the extra ref such a pair holds on a block the call did not pop is
      dropped.

    On failure the pool log is replayed backwards (popped blocks back to the head of the
    free queue in pop order, touched eviction candidates back behind their old
    predecessors, ref counts exact) and the request's entries are put back.

What cannot be undone (and why it is safe)
    * prefix-cache hashes evicted when ``get_new_blocks`` popped a cached free block,
      and the ``BlockRemoved`` KV events already queued for them: the block returns to
      the free queue unhashed;
    * hashes the call registered on blocks it had not computed yet (``cache_blocks``
      runs before the forward pass) are evicted, not restored, and a block whose older
      partial hash was replaced in the call loses both (``BlockRemoved`` follows the
      ``BlockStored``); Mamba's ``_maybe_evict_cached_block`` on a checkpoint block
      stays evicted. The prefix cache therefore only ever *forgets* entries: a later
      request misses and recomputes, it never hits a block whose content is not there
      (``test_rollback_prefix_hits_stay_correct``);
    * additions to Mamba's ``cached_blocks_this_step`` (they only defer a same-step hit
      on those hashes to the next step), KV-cache metrics callbacks and ``unpin_blocks``
      reuse watchers already notified.

Not covered (vLLM's behaviour, logged once): coordinators and managers outside the
known set (HiSparse, out-of-tree ``KVCacheSpecRegistry`` managers), whose private state
this module does not know. ``allocate_slots``' own argument check (raised in its body
before anything changed) and ``BaseException`` s are re-raised untouched. If the undo
cannot be completed the original error is re-raised (never ``None`` over inconsistent
state).

Three forms of the same transaction
    :func:`transact` (the hook path, any caller), the per-manager Python function
    :func:`make_fast_path` generates, and the C accelerator's ``Transaction``
    (plugin/_txn.c, built at install when a compiler is there; ``KVGUARD_PURE_PYTHON=1``
    keeps the Python form). The C form does only the per-call part (gate, record, open
    the pool log, call vLLM, hand a failure to :func:`_recover_flat`); the undo and all
    its checks are this module's Python in every form. The unit suite runs the rollback
    tests and the property test on both fast-path forms.
"""
from __future__ import annotations

import functools
import inspect
import logging
import operator
import types
import weakref
from itertools import repeat

from vllm_kvguard import report
from vllm_kvguard.hookspecs import hookimpl
from vllm_kvguard.log import once

_txn = None

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


# ------------------------------------------------------------------- instance attributes
# CPython 3.11 keeps an object's attributes in inline "values" until its ``__dict__`` is
# read; from then on the dict is materialised for good and every ``obj.method()`` on it
# loses its LOAD_METHOD specialisation (and attribute loads theirs): ~25 ns more per
# access. vLLM makes dozens of such accesses on the KVCacheManager and the BlockPool per
# allocate_slots, so vllm-kvguard never reads their ``__dict__``: instance attributes are
# set, read and deleted through the attribute protocol (``object.__setattr__`` and
# ``object.__delattr__``: no class ``__setattr__`` hook runs, as with a dict write).
def own_attr(obj, name, default=None):
    """``obj.__dict__.get(name, default)`` without reading ``obj.__dict__``.

    An instance value is told from the class attribute's by identity: a descriptor
    (function, wrapt wrapper) binds a fresh object on every access, an instance value
    is the same object each time.
    """
    value = getattr(obj, name, _MISSING)
    if value is _MISSING:
        return default
    cls = type(obj)
    for klass in cls.__mro__:
        attrs = vars(klass)
        if name in attrs:
            cls_attr = attrs[name]
            break
    else:
        return value                    # no class attribute: the instance's own
    get = getattr(type(cls_attr), "__get__", None)
    if get is None:
        return default if value is cls_attr else value
    if value is not getattr(obj, name, _MISSING):
        return default                  # bound afresh: the class attribute's
    return default if value is get(cls_attr, obj, cls) else value


def set_own_attr(obj, name, value) -> None:
    object.__setattr__(obj, name, value)


def del_own_attr(obj, name) -> bool:
    """``obj.__dict__.pop(name, None)``: whether ``obj`` had an instance value to delete."""
    if own_attr(obj, name, _MISSING) is _MISSING:
        return False
    object.__delattr__(obj, name)
    return True


class RollbackFailed(Exception):
    """Internal: the undo could not be completed (the original error is re-raised)."""


# One transaction at a time per process: vLLM mutates a scheduler's KV manager and pool
# only from the scheduler's thread, and allocate_slots does not nest.
_log: list | None = None
_POP, _TOUCH, _CACHE, _MOVE = range(4)
_NO_KWARGS: dict = {}                  # never written: ``**`` unpacks it, nobody stores it


# ------------------------------------------------------------------------- pool journal
@functools.lru_cache(maxsize=64)
def _params(func) -> tuple[str, ...] | None:
    """``func``'s parameter names without ``self`` (None: not introspectable or not plain)."""
    try:
        params = list(inspect.signature(func).parameters.values())
    except (TypeError, ValueError):
        return None
    if any(p.kind is not p.POSITIONAL_OR_KEYWORD for p in params):
        return None
    names = tuple(p.name for p in params)
    return names[1:] if names and names[0] == "self" else names


@functools.lru_cache(maxsize=64)
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


_ref_and_prev = operator.attrgetter("ref_cnt", "prev_free_block")


class PoolJournal:
    """Logs what a transaction does to one ``BlockPool``.

    Installed once per pool as instance attributes shadowing the class methods; they
    call the class attribute of ``type(pool)`` each time, so class-level wrappers
    applied later (the fault injector) still run. Outside a transaction each shadow is
    one global test plus the call.
    """

    NAMES = ("get_new_blocks", "touch", "cache_full_blocks", "cache_partial_block",
             "move_block_hashes")

    def __init__(self, pool):
        self.pool = pool
        self.cls = type(pool)
        self.queue = pool.free_block_queue
        self.broken: str | None = None
        self.free_at_start = 0          # free blocks when the call's first logged op ran
        full = getattr(self.cls, "cache_full_blocks", None)
        self._full_idx = {n: _param_index(full, n)
                          for n in ("blocks", "num_cached_blocks", "num_full_blocks")}
        self._partial_idx = _param_index(getattr(self.cls, "cache_partial_block", None),
                                         "block")
        self._installed: list[str] = []

    #: Shadows with the class method's exact parameters and defaults (a plain call, no
    #: ``*args``/``**kwargs`` repacking, on the hot path), used when the installed vLLM's
    #: signature matches one of them: name -> [(parameters, defaults, shadow suffix)].
    EXACT = {
        "get_new_blocks": [(("num_blocks",), None, "_exact")],
        "touch": [(("blocks",), None, "_exact")],
        "cache_full_blocks": [(("request", "blocks", "num_cached_blocks", "num_full_blocks",
                                "block_size", "kv_cache_group_id", "block_mask"), (None,),
                               "_exact")],
        "cache_partial_block": [
            (("request", "block", "num_tokens", "kv_cache_group_id", "block_size"), None,
             "_exact5"),
            (("request", "block", "num_tokens", "kv_cache_group_id", "block_size",
              "replace_existing_hashes"), (False,), "_exact6")],
    }

    def _exact_shadow(self, name):
        func = getattr(self.cls, name)
        params = _params(func)
        defaults = getattr(func, "__defaults__", _MISSING)
        for exact, exact_defaults, suffix in self.EXACT.get(name, ()):
            if params == exact and defaults == exact_defaults and not getattr(
                    func, "__kwdefaults__", None):
                return getattr(self, "_" + name + suffix)
        return None

    def install(self) -> None:
        pool = self.pool
        for name in self.NAMES:
            if hasattr(self.cls, name) and own_attr(pool, name, _MISSING) is _MISSING:
                shadow = self._exact_shadow(name) or getattr(self, "_" + name)
                set_own_attr(pool, name, shadow)
                self._installed.append(name)

    def uninstall(self) -> None:
        pool = self.pool
        for name in self._installed:
            if getattr(own_attr(pool, name), "__self__", None) is self:
                object.__delattr__(pool, name)
        self._installed.clear()

    # -- shadows
    def _get_new_blocks_exact(self, num_blocks):
        if (log := _log) is None:
            return self.cls.get_new_blocks(self.pool, num_blocks)
        return self._logged_pop(log, (num_blocks,), _NO_KWARGS)

    def _get_new_blocks(self, *args, **kwargs):
        if (log := _log) is None:
            return self.cls.get_new_blocks(self.pool, *args, **kwargs)
        return self._logged_pop(log, args, kwargs)

    def _logged_pop(self, log, args, kwargs):
        before = self.queue.num_free_blocks
        if not log:
            self.free_at_start = before
        try:
            blocks = self.cls.get_new_blocks(self.pool, *args, **kwargs)
        except BaseException:
            if self.queue.num_free_blocks != before:
                self.broken = "get_new_blocks failed after popping blocks"
            raise
        log.append((_POP, self, list(blocks)))
        return blocks

    def _touch_exact(self, blocks):
        if (log := _log) is None:
            return self.cls.touch(self.pool, blocks)
        return self._logged_touch(log, blocks, (), _NO_KWARGS)

    def _touch(self, blocks, *args, **kwargs):
        if (log := _log) is None:
            return self.cls.touch(self.pool, blocks, *args, **kwargs)
        return self._logged_touch(log, blocks, args, kwargs)

    def _logged_touch(self, log, blocks, args, kwargs):
        if not log:
            self.free_at_start = self.queue.num_free_blocks
        flat = blocks
        if blocks and isinstance(blocks[0], (list, tuple)):     # older per-group form
            flat = [b for group in blocks for b in group]
        flat = list(flat)
        before = list(map(_ref_and_prev, flat))                 # C loop, no frames
        try:
            self.cls.touch(self.pool, blocks, *args, **kwargs)
        except BaseException:
            keep = [i for i, b in enumerate(flat) if b.ref_cnt != before[i][0]]
            flat, before = [flat[i] for i in keep], [before[i] for i in keep]
            raise
        finally:
            log.append((_TOUCH, self, (flat, before)))

    def _cache_full_blocks(self, *args, **kwargs):
        if (log := _log) is None:
            return self.cls.cache_full_blocks(self.pool, *args, **kwargs)
        if not log:
            self.free_at_start = self.queue.num_free_blocks
        if "blocks" in kwargs and "num_cached_blocks" in kwargs and "num_full_blocks" in kwargs:
            blocks, start, end = (kwargs["blocks"], kwargs["num_cached_blocks"],
                                  kwargs["num_full_blocks"])
        else:
            idx = self._full_idx
            blocks = _arg(args, kwargs, idx["blocks"], "blocks")
            start = _arg(args, kwargs, idx["num_cached_blocks"], "num_cached_blocks")
            end = _arg(args, kwargs, idx["num_full_blocks"], "num_full_blocks")
        if _MISSING in (blocks, start, end):
            self.broken = "cache_full_blocks arguments not recognised"
            cached = []
        else:
            cached = blocks[start:end]       # vLLM hashes only these (not yet cached) ones
        try:
            return self.cls.cache_full_blocks(self.pool, *args, **kwargs)
        finally:
            log.append((_CACHE, self, cached))

    def _cache_full_blocks_exact(self, request, blocks, num_cached_blocks, num_full_blocks,
                                 block_size, kv_cache_group_id, block_mask=None):
        if (log := _log) is None:
            return self.cls.cache_full_blocks(self.pool, request, blocks, num_cached_blocks,
                                              num_full_blocks, block_size, kv_cache_group_id,
                                              block_mask)
        if not log:                                     # _cache_full_blocks, inline
            self.free_at_start = self.queue.num_free_blocks
        cached = blocks[num_cached_blocks:num_full_blocks]
        try:
            return self.cls.cache_full_blocks(self.pool, request, blocks, num_cached_blocks,
                                              num_full_blocks, block_size, kv_cache_group_id,
                                              block_mask)
        finally:
            log.append((_CACHE, self, cached))

    def _cache_partial_block_exact5(self, request, block, num_tokens, kv_cache_group_id,
                                    block_size):
        if (log := _log) is None:
            return self.cls.cache_partial_block(self.pool, request, block, num_tokens,
                                                kv_cache_group_id, block_size)
        if not log:                                     # _cache_partial_block, inline
            self.free_at_start = self.queue.num_free_blocks
        try:
            return self.cls.cache_partial_block(self.pool, request, block, num_tokens,
                                                kv_cache_group_id, block_size)
        finally:
            log.append((_CACHE, self, [block]))

    def _cache_partial_block_exact6(self, request, block, num_tokens, kv_cache_group_id,
                                    block_size, replace_existing_hashes=False):
        if (log := _log) is None:
            return self.cls.cache_partial_block(self.pool, request, block, num_tokens,
                                                kv_cache_group_id, block_size,
                                                replace_existing_hashes)
        if not log:                                     # _cache_partial_block, inline
            self.free_at_start = self.queue.num_free_blocks
        try:
            return self.cls.cache_partial_block(self.pool, request, block, num_tokens,
                                                kv_cache_group_id, block_size,
                                                replace_existing_hashes)
        finally:
            log.append((_CACHE, self, [block]))

    def _cache_partial_block(self, *args, **kwargs):
        if (log := _log) is None:
            return self.cls.cache_partial_block(self.pool, *args, **kwargs)
        if not log:
            self.free_at_start = self.queue.num_free_blocks
        block = _arg(args, kwargs, self._partial_idx, "block")
        if block is _MISSING:
            self.broken = "cache_partial_block arguments not recognised"
        try:
            return self.cls.cache_partial_block(self.pool, *args, **kwargs)
        finally:
            log.append((_CACHE, self, [] if block is _MISSING else [block]))

    def _move_block_hashes(self, src, dst, *args, **kwargs):
        if (log := _log) is None:
            return self.cls.move_block_hashes(self.pool, src, dst, *args, **kwargs)
        if not log:
            self.free_at_start = self.queue.num_free_blocks
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
            blocks, before = data
            for b, (ref, _) in zip(reversed(blocks), reversed(before)):
                b.ref_cnt = ref
            _reinsert(queue, [(b, prev) for b, (ref, prev) in zip(blocks, before)
                              if ref == 0 and not b.is_null])
        elif kind == _CACHE:
            # Hashes on blocks vLLM was caching for tokens the forward pass never
            # computed: evicted (a partial entry such a block held before goes with them).
            hashed_extra = getattr(pool, "cached_block_hashes_by_block", {})
            for b in data:
                if not b.is_null and (b.block_hash is not None or b.block_id in hashed_extra):
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
    """What the transaction needs for one ``KVCacheManager`` (built once, cached on it).

    ``rtbs``: each group's ``req_to_blocks``; ``dicts``: the per-request dicts whose entry
    for the request is recorded (``num_cached_block``, ``_partial_hit_reqs``, and for
    Mamba align ``last_state_block_idx``, ``_producer_partial_tail_reqs``);
    ``align``: ``(group index, manager, _allocated_block_reqs, num_speculative_blocks)``
    per Mamba align group. vLLM creates these containers once and never replaces them;
    :meth:`intact` checks that before an undo relies on it.
    """

    __slots__ = ("manager", "managers", "gids", "journal", "queue", "rtbs", "dicts", "sparse",
                 "align", "record_ids", "containers", "__weakref__")

    #: Per-request dicts that hold an entry only for a request in a rare state (a partial
    #: prefix hit, a partial tail being produced): usually empty, so the record tests the
    #: dict before looking the request up.
    SPARSE = frozenset({"_partial_hit_reqs", "_producer_partial_tail_reqs"})

    def __init__(self, manager, managers, journal):
        self.manager = manager
        self.managers = managers
        self.gids = {id(m): getattr(m, "kv_cache_group_id", i) for i, m in enumerate(managers)}
        self.journal = journal
        self.queue = journal.queue
        containers, dicts, sparse, align = [], [], [], []
        for i, m in enumerate(managers):
            names = ["num_cached_block", "_partial_hit_reqs"]
            if getattr(m, "mamba_cache_mode", None) == "align":
                names += ["last_state_block_idx", "_producer_partial_tail_reqs"]
                align.append((i, m, m._allocated_block_reqs,
                              int(getattr(m, "num_speculative_blocks", 0) or 0),
                              isinstance(getattr(m, "_pending_boundary_state_offloads", None),
                                         list)))
                containers.append((m, "_allocated_block_reqs", m._allocated_block_reqs))
            containers.append((m, "req_to_blocks", m.req_to_blocks))
            for name in names:
                d = getattr(m, name, None)
                if isinstance(d, dict):
                    dicts.append(d)
                    sparse.append(name in self.SPARSE)
                    containers.append((m, name, d))
        self.rtbs = tuple(m.req_to_blocks for m in managers)
        self.dicts = tuple(dicts)
        self.sparse = tuple(sparse)
        self.align = tuple(align)
        self.containers = tuple(containers)
        #: managers whose ``new_block_ids`` (replaced when drained) get appended to
        self.record_ids = tuple(m for m in managers if getattr(m, "_record_new_block_ids", False)
                                and isinstance(getattr(m, "new_block_ids", None), list))

    def intact(self) -> bool:
        return all(getattr(m, name, None) is obj for m, name, obj in self.containers)


_ATTR = "_kvguard_rollback_plan"
_UNSUPPORTED = "unsupported"
_plans: "weakref.WeakSet[Plan]" = weakref.WeakSet()
_disabled: list[str] = []        # set on an internal error: rollback is off in this process


def plan_for(manager) -> Plan | None:
    """The cached plan for ``manager``, built on first use; None if not supported."""
    plan = getattr(manager, _ATTR, None)
    if plan is None:
        plan = _build_plan(manager)
        set_own_attr(manager, _ATTR, plan)
    return None if plan is _UNSUPPORTED else plan


def _unsupported_reason(coord, managers) -> str | None:
    if coord is None or managers is None:
        return "a KVCacheManager without coordinator.single_type_managers"
    if type(coord).__name__ not in KNOWN_COORDINATORS:
        return f"coordinator {type(coord).__name__}"
    unknown = sorted({type(m).__name__ for m in managers} - KNOWN_MANAGERS)
    if unknown:
        return f"manager(s) {', '.join(unknown)}"
    if len({id(getattr(m, "block_pool", None)) for m in managers}) != 1:
        return "managers on more than one block pool"
    for m in managers:
        if not isinstance(getattr(m, "req_to_blocks", None), dict) or not isinstance(
                getattr(m, "num_cached_block", None), dict):
            return f"{type(m).__name__} without req_to_blocks/num_cached_block dicts"
        if getattr(m, "mamba_cache_mode", None) == "align" and not (
                isinstance(getattr(m, "last_state_block_idx", None), dict)
                and isinstance(getattr(m, "_allocated_block_reqs", None), set)):
            return "a Mamba align manager of an unknown shape"
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
    journal = getattr(pool, "_kvguard_journal", None)
    if journal is None:
        journal = PoolJournal(pool)
        journal.install()
        set_own_attr(pool, "_kvguard_journal", journal)
    plan = Plan(manager, tuple(managers), journal)
    _plans.add(plan)
    return plan


def uninstall_all() -> None:
    """Remove every shadow and cached plan this module installed (the patch's teardown)."""
    for plan in list(_plans):
        del_own_attr(plan.manager, _ATTR)
        journal = plan.journal
        journal.uninstall()
        del_own_attr(journal.pool, "_kvguard_journal")
    _plans.clear()
    _disabled.clear()


# ------------------------------------------------------------------------- transaction
_dict_get = dict.get


def record(plan: Plan, rid: str) -> tuple:
    """The request's entries before the call: (block lists per group (None: absent),
    their lengths (-1), values of ``plan.dicts`` (None: absent), per Mamba align group
    (member of ``_allocated_block_reqs``, length of ``_pending_boundary_state_offloads``,
    its last ``num_speculative_blocks`` table entries), ``new_block_ids`` lengths)."""
    lists = tuple(map(_dict_get, plan.rtbs, repeat(rid)))
    lens = tuple(-1 if b is None else len(b) for b in lists)
    return (lists, lens, tuple(map(_dict_get, plan.dicts, repeat(rid))),
            tuple((rid in alloc, len(m._pending_boundary_state_offloads) if offl else 0,
                   tuple(lists[i][max(lens[i] - nsb, 0):lens[i]]) if nsb and lens[i] > 0
                   else ()) for i, m, alloc, nsb, offl in plan.align),
            tuple(len(m.new_block_ids) for m in plan.record_ids))


def transact(manager, request, fn, args=(), kwargs=None):
    """Run ``fn(*args, **kwargs)`` (vLLM's ``allocate_slots``) as a transaction.

    Returns its result, or None after rolling back a failure; re-raises vLLM's error when
    it came from ``allocate_slots``' own argument check or the undo failed. Never raises
    an error of its own. (The hook path; the allocator patch's hot path runs the same
    steps in the function :func:`make_fast_path` generates.)
    """
    global _log
    if kwargs is None:
        kwargs = {}
    plan = getattr(manager, _ATTR, None)
    if plan is None or plan is _UNSUPPORTED or _disabled or _log is not None:
        if plan is not None or _disabled or _log is not None:
            return fn(*args, **kwargs)        # unsupported, off, or nested: unprotected
        return _first_call(manager, request, fn, args, kwargs)
    try:
        rid = request.request_id
        rec = record(plan, rid)
    except Exception as exc:
        _disable(exc)
        return fn(*args, **kwargs)
    log = _log = []
    try:
        return fn(*args, **kwargs)
    except Exception as error:
        _log = None
        return _recover(plan, rec, log, rid, manager, request, error)
    finally:
        _log = None


_FAST_TEMPLATE = """
def factory({cells}):
    def {name}({params}):
        global _log
        if tripped or _disabled or _log is not None:
            return fallback({forward_kw})
        try:
            rid = request.request_id
{record}
        except Exception as exc:
            _disable(exc)
            return fn({forward})
        log = _log = []
        try:
            return fn({forward})
        except Exception as error:
            _log = None
            return _recover_flat(plan, rec, log, rid, manager, request, error)
        finally:
            _log = None
    return {name}
"""


def _nest(plan: Plan, flat: tuple) -> tuple:
    """The fast path's flat record in :func:`record`'s form: (block list, length) per
    group, the ``plan.dicts`` values, (member, offload count, window) per align group,
    the ``new_block_ids`` lengths."""
    r2 = 2 * len(plan.rtbs)
    d = r2 + len(plan.dicts)
    a = d + 3 * len(plan.align)
    return (flat[0:r2:2], flat[1:r2:2], flat[r2:d],
            tuple(flat[k:k + 3] for k in range(d, a, 3)), flat[a:])


def _recover_flat(plan, flat, log, rid, manager, request, error):
    return _recover(plan, _nest(plan, flat), log, rid, manager, request, error)


def _plain_method(fn):
    """``fn.__func__`` when ``fn`` is a bound plain function whose signature is its own
    code's (cacheable by identity and defaults); else None."""
    if type(fn) is not types.MethodType:
        return None
    func = fn.__func__
    if type(func) is not types.FunctionType or hasattr(func, "__signature__") or hasattr(
            func, "__wrapped__"):
        return None
    return func


@functools.lru_cache(maxsize=32)
def _fast_source(func, defaults, kwdefaults, shape):
    """(source, {default cell: value}) of the transaction function for a bound ``func``
    and a plan of ``shape`` (see :func:`_build_fast`); None if the signature is not plain.
    ``defaults``/``kwdefaults`` are part of the key only (a changed default: a new
    entry)."""
    return _build_fast(inspect.signature(func), shape, func.__name__,
                       drop_self=True)


def _plan_shape(plan: Plan) -> tuple:
    return (len(plan.rtbs), plan.sparse,
            tuple((i, nsb, bool(offl)) for i, _m, _a, nsb, offl in plan.align),
            len(plan.record_ids))


def _build_fast(sig, shape, name, drop_self=False):
    params = list(sig.parameters.values())
    if drop_self:
        if not params or params[0].kind not in (params[0].POSITIONAL_ONLY,
                                                params[0].POSITIONAL_OR_KEYWORD):
            return None
        params = params[1:]
    if not params or params[0].name != "request" or any(
            p.kind not in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) for p in params):
        return None
    n_rtbs, dict_sparse, align_shape, n_ids = shape
    defaults = {}
    names = ["fn", "fallback", "plan", "manager", "tripped"]
    decl, forward, forward_kw, star = [], [], [], False
    for p in params:
        if p.kind is p.KEYWORD_ONLY and not star:
            decl.append("*")
            star = True
        if p.default is p.empty:
            decl.append(p.name)
        else:
            defaults[f"d_{p.name}"] = p.default
            names.append(f"d_{p.name}")
            decl.append(f"{p.name}=d_{p.name}")
        forward.append(f"{p.name}={p.name}" if p.kind is p.KEYWORD_ONLY else p.name)
        forward_kw.append(f"{p.name}={p.name}")
    # The record, flat (one tuple; _nest() gives record()'s form for an undo): each
    # entry one ``dict.get`` through a pre-bound method (one lookup, no attribute load);
    # a usually-empty dict is tested first (no call while it is empty).
    items = []
    for i in range(n_rtbs):
        names.append(f"rtb{i}_get")
        items += [f"(b{i} := rtb{i}_get(rid))", f"(n{i} := -1 if b{i} is None else len(b{i}))"]
    for k, sparse in enumerate(dict_sparse):
        names.append(f"d{k}_get")
        if sparse:
            names.append(f"d{k}")
            items.append(f"(d{k}_get(rid) if d{k} else None)")
        else:
            items.append(f"d{k}_get(rid)")
    for i, nsb, offl in align_shape:
        names += [f"m{i}", f"alloc{i}"]
        window = f"tuple(b{i}[max(n{i} - {nsb}, 0):n{i}]) if n{i} > 0 else ()" if nsb else "()"
        items += [f"rid in alloc{i}",
                  f"len(m{i}._pending_boundary_state_offloads)" if offl else "0", window]
    for k in range(n_ids):
        names.append(f"ids{k}")
        items.append(f"len(ids{k}.new_block_ids)")
    source = _FAST_TEMPLATE.format(
        cells=", ".join(names), name=name,
        params=", ".join(decl), forward=", ".join(forward),
        forward_kw=", ".join(forward_kw),
        record=" " * 12 + f"rec = ({', '.join(items)}{',' if len(items) == 1 else ''})")
    return source, defaults


def make_fast_path(manager, fn, tripped: set | None = None, fallback=None):
    """A transaction for ``fn`` (vLLM's ``allocate_slots`` bound to ``manager``), like
    :func:`transact` but built for this manager; or None when rollback is not available
    for ``manager`` or the signature is not plain.

    The C accelerator's ``Transaction`` when :func:`accelerated`, else a function with
    ``fn``'s signature generated per manager, straight-line: the parameters are forwarded
    as they were bound (no ``*args``/``**kwargs`` repacking) and the record is one flat
    tuple of pre-bound ``dict.get`` calls and ``in`` tests (:func:`_nest` restores
    :func:`record`'s form for an undo). The source and its compiled code are cached per
    vLLM function and plan shape, so installing on another manager only binds cells.
    While ``tripped`` (a set) is not empty, calls go to ``fallback`` (default ``fn``)
    unchanged. This is the allocator patch's hot path: ``allocate_slots`` runs once per
    scheduled request per step.
    """
    if _disabled:
        return None
    plan = plan_for(manager)
    if plan is None:
        return None
    tripped = set() if tripped is None else tripped
    if accelerated():
        return _txn.Transaction(
            fn=fn, fallback=fallback or fn, recover=_recover_flat, disable=_disable, plan=plan,
            manager=manager, globals=globals(), disabled=_disabled, tripped=tripped,
            ops=_txn_ops(plan))
    shape = _plan_shape(plan)
    built = None
    func = _plain_method(fn)
    if func is not None:
        kwdefaults = func.__kwdefaults__
        key = (func, func.__defaults__,
               None if kwdefaults is None else tuple(sorted(kwdefaults.items())), shape)
        try:
            hash(key)
        except TypeError:
            func = None
        else:
            built = _fast_source(*key)
    if func is None:
        try:
            sig = inspect.signature(fn)
        except (TypeError, ValueError):
            return None
        built = _build_fast(sig, shape, getattr(fn, "__name__", "allocate_slots"))
    if built is None:
        return None
    source, defaults = built
    cells = {"fn": fn, "fallback": fallback or fn, "plan": plan, "manager": manager,
             "tripped": tripped}
    cells.update(defaults)
    for i, rtb in enumerate(plan.rtbs):
        cells[f"rtb{i}_get"] = rtb.get
    for k, d in enumerate(plan.dicts):
        cells[f"d{k}_get"] = d.get
        if plan.sparse[k]:
            cells[f"d{k}"] = d
    for i, m, alloc, _nsb, _offl in plan.align:
        cells[f"m{i}"], cells[f"alloc{i}"] = m, alloc
    for k, m in enumerate(plan.record_ids):
        cells[f"ids{k}"] = m
    namespace: dict = {}
    exec(_compiled(source), globals(), namespace)
    return namespace["factory"](**cells)


def accelerated() -> bool:
    """Whether :func:`make_fast_path` builds the C ``Transaction`` (same steps as the
    generated Python; plugin/_txn.c): it was built at install and ``KVGUARD_PURE_PYTHON``
    does not turn it off."""
    return False


def _txn_ops(plan: Plan) -> tuple:
    """The C ``Transaction``'s record recipe: the items of the generated Python record, in
    the same order (:func:`_build_fast`), so both give the same flat tuple."""
    ops = [(_txn.RTB, rtb, i) for i, rtb in enumerate(plan.rtbs)]
    ops += [(_txn.GET, d, None) for d in plan.dicts]
    for i, m, alloc, nsb, offl in plan.align:
        ops.append((_txn.IN, alloc, None))
        ops.append((_txn.LENATTR, m, "_pending_boundary_state_offloads") if offl
                   else (_txn.CONST, 0, None))
        ops.append((_txn.WINDOW, i, nsb) if nsb else (_txn.CONST, (), None))
    ops += [(_txn.LENATTR, m, "new_block_ids") for m in plan.record_ids]
    return tuple(ops)


def is_fast_path(obj) -> bool:
    """Whether ``obj`` is a transaction :func:`make_fast_path` built (C or Python)."""
    if _txn is not None and type(obj) is _txn.Transaction:
        return True
    return getattr(getattr(obj, "__code__", None), "co_filename", None) == _FAST_FILE


_FAST_FILE = "<kvguard allocate_slots transaction>"


@functools.lru_cache(maxsize=32)
def _compiled(source: str):
    return compile(source, _FAST_FILE, "exec")


def _first_call(manager, request, fn, args, kwargs):
    try:
        plan_for(manager)
    except Exception as exc:
        _disable(exc)
        return fn(*args, **kwargs)
    return transact(manager, request, fn, args, kwargs)


def _disable(exc: Exception) -> None:
    _disabled.append(type(exc).__name__)
    report.count("internal_error", "rollback")
    once(logging.ERROR, ("rollback-internal",),
         "vllm-kvguard: internal error in the allocator rollback (%s: %s); allocation "
         "errors are no longer rolled back in this process (vLLM's behaviour)",
         type(exc).__name__, exc)


def rollback(plan: Plan, rec: list, log: list, rid: str) -> bool:
    """Undo one failed call from its record and pool log. Returns whether anything had
    changed; raises RollbackFailed when the state cannot be restored."""
    journal = plan.journal
    if journal.broken:
        why, journal.broken = journal.broken, None
        raise RollbackFailed(why)
    if not plan.intact():
        raise RollbackFailed("a per-request container of a KV manager was replaced")
    popped = {id(b) for kind, _, data in log if kind == _POP for b in data}
    pooled = set(popped)
    returning = len(popped)
    for kind, _, data in log:
        if kind == _TOUCH:
            for b, (ref, _prev) in zip(*data):
                pooled.add(id(b))
                if ref == 0 and not b.is_null:
                    returning += 1
    changed = any(data[0] if kind == _TOUCH else data for kind, _, data in log)

    # Validate before changing anything.
    lists, lens, vals, align_rec, id_lens = rec
    relocs = []
    windows = {g[0]: r[2] for g, r in zip(plan.align, align_rec)}
    for i, (rtb, blocks, n) in enumerate(zip(plan.rtbs, lists, lens)):
        cur = rtb.get(rid)
        relocated = []
        relocs.append(relocated)
        if blocks is None:
            changed = changed or cur is not None
            continue
        if cur is not blocks:
            raise RollbackFailed("a request's block list was replaced during the call")
        appended = blocks[n:]
        changed = changed or bool(appended)
        window = windows.get(i, ())
        if window:
            appended_ids = {id(b) for b in appended}
            for j, orig in enumerate(window, start=n - len(window)):
                if blocks[j] is not orig and id(orig) in appended_ids:
                    relocated.append((j, orig))     # moved to the end by the call
        known = pooled | {id(orig) for _, orig in relocated}
        for b in appended:
            if not b.is_null and id(b) not in known:
                raise RollbackFailed(f"block {b.block_id} joined a request list without "
                                     f"a logged pool operation")
    if log and journal.queue.num_free_blocks + returning != journal.free_at_start:
        raise RollbackFailed("the free queue changed outside the logged operations")

    # Copy-on-write pairs the call queued: their copy block was popped by the call.
    for m in plan.managers:
        pending = getattr(m, "_pending_cow_copies", None)
        if not pending:
            continue
        k = len(pending)
        while k and id(pending[k - 1][1]) in popped:
            k -= 1
        for pair in pending[k:]:
            changed = True
            for b in pair:
                if id(b) not in pooled:       # the copy's extra ref on a block held before
                    b.ref_cnt -= 1
        del pending[k:]
    for m, n in zip(plan.record_ids, id_lens):
        del m.new_block_ids[n:]

    # The request's entries.
    for rtb, blocks, n, relocated in zip(plan.rtbs, lists, lens, relocs):
        if blocks is None:
            rtb.pop(rid, None)
        else:
            for j, orig in relocated:
                blocks[j] = orig
            del blocks[n:]
    for d, value in zip(plan.dicts, vals):
        now = d.get(rid)
        if now is not value:
            changed = changed or now != value
            if value is None:
                d.pop(rid, None)
            else:
                d[rid] = value
    for (_, m, alloc, _, has_offl), (member, n_offl, _) in zip(plan.align, align_rec):
        changed = changed or (rid in alloc) != member
        (alloc.add if member else alloc.discard)(rid)
        if has_offl:
            offl = m._pending_boundary_state_offloads
            changed = changed or len(offl) != n_offl
            del offl[n_offl:]

    # The pool, newest operation first.
    for kind, owner, data in reversed(log):
        owner.undo(kind, data)
    if log and journal.queue.num_free_blocks != journal.free_at_start:
        raise RollbackFailed(f"{journal.queue.num_free_blocks} free blocks after the undo, "
                             f"{journal.free_at_start} before the call")
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


def _recover(plan, rec, log, rid, manager, request, error):
    try:
        changed = rollback(plan, rec, log, rid)
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


#: Lets the allocator patch install :func:`make_fast_path`'s function on a manager while
#: this is the only ``kvguard_allocate_slots`` implementation (patches/allocator.py).
kvguard_allocate_slots.kvguard_direct = make_fast_path
