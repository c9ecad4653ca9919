"""The undo: put one manager and its pool back as they were before a failed call.

The target state is vLLM's own "no room now": what ``allocate_slots`` leaves when it
returns None at its capacity check. The transaction's record holds the values the call
may have overwritten; everything else is read from the pool journal and the state the
call left: the blocks a group's table gained are the ones the call popped or touched (and
in Mamba align groups the speculative blocks it moved to the end), the ids it queued for
zeroing and the copy-on-write pairs and boundary offloads it queued are those of blocks
it popped. Everything is validated before anything changes; if the state cannot be
restored exactly, :class:`RollbackFailed` is raised and the caller falls back (never None
over inconsistent state). Prefix-cache hashes the call evicted or set are forgotten,
never restored: a later request misses and recomputes, it never hits a block whose
content is not there.
"""
from __future__ import annotations

from collections import Counter

from vllm_kvguard.fixes.transaction.journal import HASHED, TOUCH


class RollbackFailed(Exception):
    """The undo could not be completed (the original error is re-raised)."""


def rollback(plan, rec: tuple, log: list, rid: str) -> bool:
    """Undo one failed call from its record and pool log; return whether anything had
    changed. Raises RollbackFailed when the state cannot be restored."""
    cached, aligned, rare_vals = rec
    if not plan.intact():
        raise RollbackFailed("a per-request container of a KV manager was replaced")
    if plan.journal.pool.free_block_queue is not plan.journal.queue:
        raise RollbackFailed("the pool's free block queue was replaced (pops not logged)")
    popped = [e for e in log if type(e) is not tuple]
    pop_ids = {id(b) for b in popped}
    touched = {id(b) for e in log if type(e) is tuple and e[0] == TOUCH for b in e[1]}
    pooled = pop_ids | touched
    changed = bool(popped) or any(e[0] == TOUCH and e[1] for e in log if type(e) is tuple)

    # Validate before changing anything: each group's length before the call.
    align_at = {a.index: (a, r) for a, r in zip(plan.align, aligned)}
    tables = []     # (rtb, current list, length before (None: absent), relocations, existed)
    for i, m in enumerate(plan.managers):
        rtb = m.req_to_blocks
        cur = rtb.get(rid)
        if i in align_at:
            tables.append(_align_table(*align_at[i], rtb, cur, pooled))
        else:
            tables.append(_derived_table(rtb, cur, pooled))
    new = all(not n for _, _, n, _, _ in tables)

    # Copy-on-write pairs the call queued: their copy block was popped by the call.
    for m in plan.managers:
        pending = getattr(m, "_pending_cow_copies", None)
        if not pending:
            continue
        k = len(pending)
        while k and id(pending[k - 1][1]) in pop_ids:
            k -= 1
        for pair in pending[k:]:
            changed = True
            for b in pair:
                if id(b) not in pooled:       # the copy's extra ref on a block held before
                    b.ref_cnt -= 1
        del pending[k:]
    # Block ids queued for zeroing: those of blocks the call popped into that table.
    for m in plan.record_ids:
        table = m.req_to_blocks.get(rid, ())
        mine = Counter(b.block_id for b in table if id(b) in pop_ids)
        ids = m.new_block_ids
        k = len(ids)
        while k and mine[ids[k - 1]] > 0:
            mine[ids[k - 1]] -= 1
            k -= 1
        del ids[k:]

    # The request's entries.
    for rtb, cur, n, relocated, existed in tables:
        if cur is None:
            continue
        if n is None or (new and not existed):    # a table the call created
            rtb.pop(rid, None)
            changed = changed or bool(cur)
            continue
        for j, orig in relocated:
            cur[j] = orig
        changed = changed or len(cur) != n
        del cur[n:]
    for d, value in zip(plan.cached, cached):
        changed = _restore(d, rid, value) or changed
    rare = rare_vals if rare_vals is not None else [None] * len(plan.rare)
    for d, value in zip(plan.rare, rare):
        changed = _restore(d, rid, value) or changed
    hashed_or_popped = pop_ids | {id(e[1]) for e in log if type(e) is tuple and e[0] == HASHED}
    for a, (_blocks, _n, last, member) in zip(plan.align, aligned):
        changed = _restore(a.last_state, rid, last) or changed
        changed = changed or (rid in a.members) != member
        (a.members.add if member else a.members.discard)(rid)
        if a.offloads:            # boundary-state hand-offs the call queued for this request
            offl = a.manager._pending_boundary_state_offloads
            k = len(offl)
            while k and offl[k - 1][0] == rid and id(offl[k - 1][2]) in hashed_or_popped:
                k -= 1
            changed = changed or k != len(offl)
            del offl[k:]

    # The pool, newest operation first.
    journal = plan.journal
    pool, queue = journal.pool, journal.queue
    run: list = []                          # consecutive popped blocks, newest first
    for entry in reversed(log):
        if type(entry) is not tuple:
            run.append(entry)
            continue
        _give_back(pool, queue, run)
        run = []
        if entry[0] == TOUCH:
            _untouch(queue, *entry[1:])
        elif entry[0] == HASHED:
            changed = True
            _forget(pool, entry[1])
    _give_back(pool, queue, run)
    stray = orphans(pool)
    if stray:
        raise RollbackFailed(f"{len(stray)} block(s) left neither free nor held "
                             f"(block {stray[0].block_id} first)")
    return changed


def _align_table(a, r, rtb, cur, pooled):
    """A Mamba align group's table: its length before the call was recorded; a block no
    pool operation gave out is a speculative block the call moved to the end, one of the
    first of the last ``num_speculative_blocks`` entries, each leaving a null behind."""
    blocks, n, _last, _member = r
    if blocks is None:
        return rtb, cur, None, (), False
    if cur is not blocks:
        raise RollbackFailed("a request's block list was replaced during the call")
    moved = [b for b in cur[n:] if not b.is_null and id(b) not in pooled]
    start = n - a.nsb
    if moved and (start < 0 or len(moved) > n - start or not all(
            cur[start + t].is_null for t in range(len(moved)))):
        raise RollbackFailed(f"block {moved[0].block_id} joined a request list without "
                             f"a logged pool operation")
    return rtb, cur, n, tuple(zip(range(start, start + len(moved)), moved)), True


def _derived_table(rtb, cur, pooled):
    """Any other group's table: it only gains blocks at its end, each one the call popped
    or touched (a new request's table also starts with nulls for skipped tokens). Its
    length before the call is what remains without them; a table holding nothing but
    nulls then is a new request's (0; whether it existed before is not known)."""
    if cur is None:
        return rtb, None, None, (), False
    k = len(cur)
    while k and id(cur[k - 1]) in pooled:
        k -= 1
    if all(b.is_null for b in cur[:k]):
        k = 0
    for b in cur[k:]:
        if not b.is_null and id(b) not in pooled:
            raise RollbackFailed(f"block {b.block_id} joined a request list without "
                                 f"a logged pool operation")
    return rtb, cur, k, (), None


def _restore(d: dict, rid, value) -> bool:
    """Set ``d[rid]`` back to ``value`` (None: absent); whether it had changed."""
    now = d.get(rid)
    if now is value:
        return False
    if value is None:
        d.pop(rid, None)
    else:
        d[rid] = value
    return now != value


def _forget(pool, block) -> None:
    if not block.is_null and (block.block_hash is not None or block.block_id in getattr(
            pool, "cached_block_hashes_by_block", {})):
        pool._maybe_evict_cached_block(block)


def _give_back(pool, queue, newest_first: list) -> None:
    """Return popped blocks to the head of the free queue, in their pop order."""
    if not newest_first:
        return
    blocks = newest_first[::-1]
    for b in blocks:
        _forget(pool, b)                        # a hash set during the call
        b.ref_cnt = 0
    prepend = getattr(queue, "prepend_n", None)
    if prepend is not None:
        prepend(blocks)
        return
    head = queue.fake_free_list_head
    for b in newest_first:
        _insert_after(queue, head, b)


def _untouch(queue, blocks, before) -> None:
    for b, (ref, _) in zip(reversed(blocks), reversed(before)):
        b.ref_cnt = ref
    _reinsert(queue, [(b, prev) for b, (ref, prev) in zip(blocks, before)
                      if ref == 0 and not b.is_null])


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


def orphans(pool) -> list:
    """Blocks neither free nor held: no reference, yet not linked into the free queue
    (popped by vLLM, then dropped before it counted them)."""
    return [b for b in pool.blocks if b.ref_cnt == 0 and not b.is_null
            and b.prev_free_block is None]


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
