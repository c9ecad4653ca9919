"""The pool journal: what one ``allocate_slots`` call did to its ``BlockPool``.

A rollback gives back the blocks the call took, restores the ref counts and free-queue
places of the blocks it touched and forgets the prefix-cache hashes it set. The journal
sees the pool through three seams, declared instance attributes of the allocator patch:

* the free queue's ``popleft_n``: logs the blocks ``get_new_blocks`` takes, in pop order,
  as it takes them (one frame per call, not per block). The pool's ``metrics_collector``
  is left alone: vLLM 0.34's ``get_new_blocks`` has a faster path taken only without one;
* ``touch``: logs each touched block with its ref count and free-queue predecessor;
* ``_insert_block_hash``: logs each block that gains a hash (full, partial or moved).

The log is one list per pool. A transaction empties it as it starts, so after a failure
it holds that call's operations, in order: a popped block as itself, the rest as tuples.
Calls that run unrecorded (the fast path) need only the pops (a fault there gives back
the blocks the call took): while they run, ``touch`` and ``_insert_block_hash`` are off
(:meth:`PoolJournal.cool`) and a recorded call puts them back first (:meth:`heat`).
"""
from __future__ import annotations

import inspect
import operator

TOUCH, HASHED = "touch", "hashed"
_ref_and_prev = operator.attrgetter("ref_cnt", "prev_free_block")
#: ``_insert_block_hash``'s parameters after ``self`` (the shadow has the same ones).
INSERT_PARAMS = ("block_hash_with_group_id", "block", "num_tokens")
#: ``FreeKVCacheBlockQueue.popleft_n``'s parameters after ``self``.
POP_PARAMS = ("n",)
#: The seams a call with room does not need (:meth:`PoolJournal.cool`).
COOLED = ("touch", "_insert_block_hash")


def _params(fn) -> tuple | None:
    try:
        return tuple(inspect.signature(fn).parameters)[1:]
    except (TypeError, ValueError):
        return None


class PoolJournal:
    """The log of one pool's operations during a transaction."""

    def __init__(self, pool, changes: dict):
        self.pool = pool
        self.cls = type(pool)
        self.queue = pool.free_block_queue
        self.log: list = []
        self.changes = changes          # seam name -> the patch's InstanceAttr declaration
        self.hot = False                # touch and _insert_block_hash are installed
        self._seams: dict = {}

    def unsupported(self) -> str | None:
        """Why this pool's seams are not the ones the journal knows (None: they are)."""
        params = _params(getattr(self.cls, "_insert_block_hash", None))
        if params is None:
            return "a BlockPool without _insert_block_hash"
        if params != INSERT_PARAMS:
            return "a BlockPool._insert_block_hash with other parameters"
        if _params(getattr(type(self.queue), "popleft_n", None)) != POP_PARAMS \
                or not type(self.queue).__dictoffset__:      # no instance attributes
            return "a free block queue without popleft_n(n)"
        return None

    def install(self) -> bool:
        """Put the seams on the pool and its free queue; False (nothing left installed) if
        one cannot be."""
        self._seams = {"popleft_n": (self.queue, self._popping()),
                       "touch": (self.pool, self._touch),
                       "_insert_block_hash": (self.pool, self._inserting())}
        self.hot = self._set(self._seams)
        return self.hot

    def _set(self, seams: dict) -> bool:
        done = []
        for name, (obj, value) in seams.items():
            if not self.changes[name].set(obj, value):
                for n, o in done:
                    self.changes[n].unset(o)
                return False
            done.append((name, obj))
        return True

    def cool(self) -> None:
        """Take ``touch`` and ``_insert_block_hash`` off (calls with room log only pops)."""
        self.hot = False
        for name in COOLED:
            self.changes[name].unset(self.pool)

    def heat(self) -> bool:
        """Put them back before a recorded call; False if one cannot be (then none is)."""
        self.hot = self._set({n: self._seams[n] for n in COOLED})
        return self.hot

    def uninstall(self) -> None:
        self.hot = False
        for name, change in self.changes.items():
            change.unset(self.queue if name == "popleft_n" else self.pool)

    # -- the shadows (``touch`` calls the class attribute each time: wrappers applied later
    # run; nothing wraps the private ``_insert_block_hash`` or the queue's ``popleft_n``)
    def _popping(self):
        """The ``popleft_n`` shadow: a closure, so a pop costs one frame and an extend."""
        extend, queue, pop = self.log.extend, self.queue, type(self.queue).popleft_n

        def popleft_n(n):
            blocks = pop(queue, n)
            extend(blocks)
            return blocks

        return popleft_n

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
