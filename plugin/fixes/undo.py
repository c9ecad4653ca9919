"""The undo: put one manager and its pool back as they were before a failed call.

The target state is vLLM's own "no room now": what ``allocate_slots`` leaves when it
returns None at its capacity check. Everything is validated before anything changes; if
the state cannot be restored exactly, :class:`RollbackFailed` is raised and the caller
re-raises vLLM's error (never None over inconsistent state). Prefix-cache hashes the call
evicted or set are forgotten, never restored: a later request misses and recomputes, it
never hits a block whose content is not there.
"""
from __future__ import annotations

from vllm_kvguard.fixes.journal import CACHE, MOVE, POP, TOUCH


class RollbackFailed(Exception):
    """The undo could not be completed (the original error is re-raised)."""


def rollback(plan, rec: tuple, log: list, rid: str) -> bool:
    """Undo one failed call from its record and pool log; return whether anything had
    changed. Raises RollbackFailed when the state cannot be restored."""
    journal = plan.journal
    if journal.broken:
        why, journal.broken = journal.broken, None
        raise RollbackFailed(why)
    if not plan.intact():
        raise RollbackFailed("a per-request container of a KV manager was replaced")
    popped = {id(b) for kind, _, data in log if kind == POP for b in data}
    pooled = set(popped)
    returning = len(popped)
    for kind, _, data in log:
        if kind == TOUCH:
            for b, (ref, _prev) in zip(*data):
                pooled.add(id(b))
                if ref == 0 and not b.is_null:
                    returning += 1
    changed = any(data[0] if kind == TOUCH else data for kind, _, data in log)

    # Validate before changing anything.
    lists, lens, vals, rare_vals, align_rec, id_lens = rec
    vals = vals + (rare_vals if rare_vals is not None else [None] * len(plan.rare))
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
        undo_pool_op(owner, kind, data)
    if log and journal.queue.num_free_blocks != journal.free_at_start:
        raise RollbackFailed(f"{journal.queue.num_free_blocks} free blocks after the undo, "
                             f"{journal.free_at_start} before the call")
    return changed


def undo_pool_op(journal, kind, data) -> None:
    """Undo one logged pool operation."""
    pool, queue = journal.pool, journal.queue
    if kind == POP:
        hashed_extra = getattr(pool, "cached_block_hashes_by_block", {})
        for b in data:
            if b.block_hash is not None or b.block_id in hashed_extra:
                pool._maybe_evict_cached_block(b)       # set during the call
            b.ref_cnt = 0
        _prepend(queue, data)
    elif kind == TOUCH:
        blocks, before = data
        for b, (ref, _) in zip(reversed(blocks), reversed(before)):
            b.ref_cnt = ref
        _reinsert(queue, [(b, prev) for b, (ref, prev) in zip(blocks, before)
                          if ref == 0 and not b.is_null])
    elif kind == CACHE:
        # Hashes on blocks vLLM was caching for tokens the forward pass never computed:
        # evicted (a partial entry such a block held before goes with them).
        hashed_extra = getattr(pool, "cached_block_hashes_by_block", {})
        for b in data:
            if not b.is_null and (b.block_hash is not None or b.block_id in hashed_extra):
                pool._maybe_evict_cached_block(b)
    elif kind == MOVE:
        src, dst = data
        if src.block_hash is None and dst.block_hash is not None:
            journal.cls.move_block_hashes(pool, dst, src)


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


def failing_group(plan, error: BaseException):
    """KV-cache group id of the innermost manager frame in ``error``'s traceback."""
    group = None
    tb = error.__traceback__
    while tb is not None:
        local = tb.tb_frame.f_locals
        for name in ("self", "manager"):            # a manager's method, or the
            gid = plan.gids.get(id(local.get(name)))  # coordinator's loop over managers
            if gid is not None:
                group = gid
                break
        tb = tb.tb_next
    return group


def raised_by_itself(error: BaseException, manager) -> bool:
    """Whether ``allocate_slots`` raised in its own body (its argument check), not in
    anything it called."""
    tb = error.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    frame = tb.tb_frame
    return frame.f_code.co_name == "allocate_slots" and frame.f_locals.get("self") is manager
