"""The pool journal: what one ``allocate_slots`` call did to its ``BlockPool``.

A rollback gives back the blocks the call took, restores the ref counts and free-queue
places of the blocks it touched and forgets the prefix-cache hashes it set. The journal
sees the pool through three seams, declared instance attributes of the allocator patch:

* ``metrics_collector``: vLLM reports each block ``get_new_blocks`` hands out, in pop
  order; ours reports it into the log with ``list.append`` itself (no Python frame on
  the hot path) and passes every report on to vLLM's own collector when there is one;
* ``touch``: logs each touched block with its ref count and free-queue predecessor;
* ``_insert_block_hash``: logs each block that gains a hash (full, partial or moved).

The log is one list per pool. A transaction empties it as it starts, so after a failure
it holds that call's operations, in order: a popped block as itself, the rest as tuples.
"""
from __future__ import annotations

import inspect
import operator

TOUCH, HASHED = "touch", "hashed"
_ref_and_prev = operator.attrgetter("ref_cnt", "prev_free_block")
#: ``_insert_block_hash``'s parameters after ``self`` (the shadow has the same ones).
INSERT_PARAMS = ("block_hash_with_group_id", "block", "num_tokens")


#: What the collector does with evictions and accesses when vLLM has no collector: a C
#: callable of one argument without effect (``id`` would raise an audit event per call).
_IGNORE = ().count


class Collector:
    """``BlockPool.metrics_collector`` while the journal is installed and vLLM has no
    collector of its own: the hot report is the log's ``append`` and the two others do
    nothing, C callables taking one argument, so a report costs no Python frame. No
    ``__getattr__``: with one, every attribute vLLM reads from it takes the slow path."""

    __slots__ = ("on_block_allocated", "on_block_evicted", "on_block_accessed")

    def __init__(self, log: list):
        self.on_block_allocated = log.append
        self.on_block_evicted = self.on_block_accessed = _IGNORE

    def reset(self) -> None:
        pass


class ForwardingCollector:
    """The same, around vLLM's own collector: every report also goes to it, and anything
    else vLLM asks (``sample_rate``, ``drain_events``) is answered by it."""

    __slots__ = ("on_block_allocated", "on_block_evicted", "on_block_accessed", "inner")

    def __init__(self, log: list, inner):
        self.inner = inner
        report = inner.on_block_allocated

        def on_block_allocated(block):
            log.append(block)
            report(block)

        self.on_block_allocated = on_block_allocated
        self.on_block_evicted = inner.on_block_evicted
        self.on_block_accessed = inner.on_block_accessed

    def reset(self) -> None:
        self.inner.reset()

    def __getattr__(self, name):
        return getattr(self.inner, name)


def collector(log: list, inner):
    """The journal's ``metrics_collector`` for a pool whose own is ``inner``."""
    return Collector(log) if inner is None else ForwardingCollector(log, inner)


class PoolJournal:
    """The log of one pool's operations during a transaction."""

    def __init__(self, pool, changes: dict):
        self.pool = pool
        self.cls = type(pool)
        self.queue = pool.free_block_queue
        self.log: list = []
        self.changes = changes          # seam name -> the patch's InstanceAttr declaration

    def unsupported(self) -> str | None:
        """Why this pool's seams are not the ones the journal knows (None: they are)."""
        try:
            params = tuple(inspect.signature(self.cls._insert_block_hash).parameters)[1:]
        except (AttributeError, TypeError, ValueError):
            return "a BlockPool without _insert_block_hash"
        if params != INSERT_PARAMS:
            return "a BlockPool._insert_block_hash with other parameters"
        if not hasattr(self.pool, "metrics_collector"):
            return "a BlockPool without metrics_collector"
        return None

    def install(self) -> bool:
        """Put the seams on the pool; False (nothing left installed) if one cannot be."""
        seams = {"metrics_collector": collector(self.log, self.pool.metrics_collector),
                 "touch": self._touch, "_insert_block_hash": self._inserting()}
        done = []
        for name, value in seams.items():
            if not self.changes[name].set(self.pool, value):
                for n in done:
                    self.changes[n].unset(self.pool)
                return False
            done.append(name)
        return True

    def uninstall(self) -> None:
        for change in self.changes.values():
            change.unset(self.pool)

    # -- the shadows (``touch`` calls the class attribute each time: wrappers applied later
    # run; nothing wraps the private ``_insert_block_hash``)
    def _touch(self, blocks, *args, **kwargs):
        flat = blocks
        if blocks and isinstance(blocks[0], (list, tuple)):     # older per-group form
            flat = [b for group in blocks for b in group]
        flat = list(flat)
        before = list(map(_ref_and_prev, flat))
        try:
            self.cls.touch(self.pool, blocks, *args, **kwargs)
        except BaseException:
            keep = [i for i, b in enumerate(flat) if b.ref_cnt != before[i][0]]
            flat, before = [flat[i] for i in keep], [before[i] for i in keep]
            raise
        finally:
            self.log.append((TOUCH, flat, before))

    def _inserting(self):
        """The ``_insert_block_hash`` shadow: a closure over what it needs (it runs for
        every block a call caches)."""
        append, pool, insert = self.log.append, self.pool, self.cls._insert_block_hash

        def _insert_block_hash(block_hash_with_group_id, block, num_tokens=None):
            append((HASHED, block))
            return insert(pool, block_hash_with_group_id, block, num_tokens)

        return _insert_block_hash


def popped(log: list) -> list:
    """The blocks the logged call took from the free queue, in pop order."""
    return [entry for entry in log if type(entry) is not tuple]
