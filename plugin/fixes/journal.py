"""The pool journal: a log of what one ``allocate_slots`` call does to its ``BlockPool``.

A rollback must put back exactly the blocks, ref counts, free-queue positions and cache
hashes the call changed, and nothing else. The journal shadows five ``BlockPool``
methods on the pool object (declared instance attributes of the allocator patch); while
``log`` is a list each shadow records its operation, otherwise it is one test and the
class's own method. The shadows call ``type(pool)``'s attribute each time, so class-level
wrappers applied later (the fault injector) still run.
"""
from __future__ import annotations

import functools
import inspect
import operator

POP, TOUCH, CACHE, MOVE = range(4)
NAMES = ("get_new_blocks", "touch", "cache_full_blocks", "cache_partial_block",
         "move_block_hashes")
_MISSING = object()
_NO_KWARGS: dict = {}                  # never written: ``**`` unpacks it, nobody stores it
_ref_and_prev = operator.attrgetter("ref_cnt", "prev_free_block")


@functools.lru_cache(maxsize=64)
def _params(func) -> tuple[tuple[str, ...], tuple] | None:
    """``func``'s parameter names without ``self`` and its defaults (None: not plain)."""
    try:
        params = list(inspect.signature(func).parameters.values())
    except (TypeError, ValueError):
        return None
    if any(p.kind is not p.POSITIONAL_OR_KEYWORD for p in params):
        return None
    names = tuple(p.name for p in params)
    return (names[1:] if names and names[0] == "self" else names,
            getattr(func, "__defaults__", None) or ())


def _arg(args, kwargs, params, name):
    if name in kwargs:
        return kwargs[name]
    index = params.index(name) if params and name in params else None
    if index is not None and index < len(args):
        return args[index]
    return _MISSING


class PoolJournal:
    """The log of one pool's operations during a transaction (``log`` is None outside)."""

    #: Signatures with a shadow of the exact parameters (no ``*args`` repacking on the
    #: hot path); other signatures get the generic shadow.
    EXACT = {
        "get_new_blocks": {(("num_blocks",), ()): "_get_new_blocks_exact"},
        "touch": {(("blocks",), ()): "_touch_exact"},
        "cache_full_blocks": {(("request", "blocks", "num_cached_blocks", "num_full_blocks",
                                "block_size", "kv_cache_group_id", "block_mask"), (None,)):
                              "_cache_full_blocks_exact"},
        "cache_partial_block": {
            (("request", "block", "num_tokens", "kv_cache_group_id", "block_size"), ()):
                "_cache_partial_block_exact5",
            (("request", "block", "num_tokens", "kv_cache_group_id", "block_size",
              "replace_existing_hashes"), (False,)): "_cache_partial_block_exact6"},
    }

    def __init__(self, pool, shadows: dict):
        self.pool = pool
        self.cls = type(pool)
        self.queue = pool.free_block_queue
        self.log: list | None = None
        self.broken: str | None = None
        self.free_at_start = 0          # free blocks when the call's first logged op ran
        self.shadows = shadows          # name -> the patch's InstanceAttr declaration
        self.params = {n: (_params(getattr(self.cls, n, None)) or ((), ()))[0] for n in NAMES}

    def install(self) -> bool:
        """Shadow the pool's methods; False (nothing left installed) if one cannot be."""
        done = []
        for name in NAMES:
            func = getattr(self.cls, name, None)
            if func is None:
                continue
            exact = self.EXACT.get(name, {}).get(_params(func))
            shadow = getattr(self, exact or "_" + name)
            if not self.shadows[name].set(self.pool, shadow):
                for n in done:
                    self.shadows[n].unset(self.pool)
                return False
            done.append(name)
        return True

    def uninstall(self) -> None:
        for name in NAMES:
            self.shadows[name].unset(self.pool)

    # -- get_new_blocks
    def _get_new_blocks_exact(self, num_blocks):
        if (log := self.log) is None:
            return self.cls.get_new_blocks(self.pool, num_blocks)
        before = self.queue.num_free_blocks          # the common signature: no second frame
        if not log:
            self.free_at_start = before
        try:
            blocks = self.cls.get_new_blocks(self.pool, num_blocks)
        except BaseException:
            self._pop_failed(before)
            raise
        log.append((POP, self, list(blocks)))
        return blocks

    def _get_new_blocks(self, *args, **kwargs):
        if (log := self.log) is None:
            return self.cls.get_new_blocks(self.pool, *args, **kwargs)
        return self._pop(log, args, kwargs)

    def _pop(self, log, args, kwargs):
        before = self.queue.num_free_blocks
        if not log:                     # the call's first logged operation
            self.free_at_start = before
        try:
            blocks = self.cls.get_new_blocks(self.pool, *args, **kwargs)
        except BaseException:
            self._pop_failed(before)
            raise
        log.append((POP, self, list(blocks)))
        return blocks

    def _pop_failed(self, before: int) -> None:
        if self.queue.num_free_blocks != before:
            self.broken = "get_new_blocks failed after popping blocks"

    # -- touch
    def _touch_exact(self, blocks):
        if (log := self.log) is None:
            return self.cls.touch(self.pool, blocks)
        return self._touched(log, blocks, (), _NO_KWARGS)

    def _touch(self, blocks, *args, **kwargs):
        if (log := self.log) is None:
            return self.cls.touch(self.pool, blocks, *args, **kwargs)
        return self._touched(log, blocks, args, kwargs)

    def _touched(self, log, blocks, args, kwargs):
        if not log:
            self.free_at_start = self.queue.num_free_blocks
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
            log.append((TOUCH, self, (flat, before)))

    # -- cache_full_blocks / cache_partial_block: the blocks whose hashes the call sets
    def _cache_full_blocks_exact(self, request, blocks, num_cached_blocks, num_full_blocks,
                                 block_size, kv_cache_group_id, block_mask=None):
        if (log := self.log) is not None:
            if not log:
                self.free_at_start = self.queue.num_free_blocks
            log.append((CACHE, self, blocks[num_cached_blocks:num_full_blocks]))
        return self.cls.cache_full_blocks(self.pool, request, blocks, num_cached_blocks,
                                          num_full_blocks, block_size, kv_cache_group_id,
                                          block_mask)

    def _cache_full_blocks(self, *args, **kwargs):
        if (log := self.log) is None:
            return self.cls.cache_full_blocks(self.pool, *args, **kwargs)
        if not log:
            self.free_at_start = self.queue.num_free_blocks
        params = self.params["cache_full_blocks"]
        blocks, start, end = (_arg(args, kwargs, params, n)
                              for n in ("blocks", "num_cached_blocks", "num_full_blocks"))
        if _MISSING in (blocks, start, end):
            self.broken = "cache_full_blocks arguments not recognised"
            cached = []
        else:
            cached = blocks[start:end]       # vLLM hashes only these (not yet cached) ones
        log.append((CACHE, self, cached))
        return self.cls.cache_full_blocks(self.pool, *args, **kwargs)

    def _cache_partial_block_exact5(self, request, block, num_tokens, kv_cache_group_id,
                                    block_size):
        if (log := self.log) is not None:
            if not log:
                self.free_at_start = self.queue.num_free_blocks
            log.append((CACHE, self, [block]))
        return self.cls.cache_partial_block(self.pool, request, block, num_tokens,
                                            kv_cache_group_id, block_size)

    def _cache_partial_block_exact6(self, request, block, num_tokens, kv_cache_group_id,
                                    block_size, replace_existing_hashes=False):
        if (log := self.log) is not None:
            if not log:
                self.free_at_start = self.queue.num_free_blocks
            log.append((CACHE, self, [block]))
        return self.cls.cache_partial_block(self.pool, request, block, num_tokens,
                                            kv_cache_group_id, block_size,
                                            replace_existing_hashes)

    def _cache_partial_block(self, *args, **kwargs):
        if (log := self.log) is None:
            return self.cls.cache_partial_block(self.pool, *args, **kwargs)
        if not log:
            self.free_at_start = self.queue.num_free_blocks
        block = _arg(args, kwargs, self.params["cache_partial_block"], "block")
        if block is _MISSING:
            self.broken = "cache_partial_block arguments not recognised"
        log.append((CACHE, self, [] if block is _MISSING else [block]))
        return self.cls.cache_partial_block(self.pool, *args, **kwargs)

    # -- move_block_hashes
    def _move_block_hashes(self, src, dst, *args, **kwargs):
        if (log := self.log) is None:
            return self.cls.move_block_hashes(self.pool, src, dst, *args, **kwargs)
        if not log:
            self.free_at_start = self.queue.num_free_blocks
        result = self.cls.move_block_hashes(self.pool, src, dst, *args, **kwargs)
        log.append((MOVE, self, (src, dst)))
        return result
