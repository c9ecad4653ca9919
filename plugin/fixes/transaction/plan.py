"""What a transaction records for one ``KVCacheManager``, worked out once per manager.

vLLM keeps a request's allocation state in per-group containers it creates once and never
replaces. Most of what a failed call changed can be read back from the pool journal (the
blocks it took, touched or hashed) and the state it left; the plan lists the few values
that cannot, so the transaction reads only those before calling vLLM: each group's
``num_cached_block`` entry, and per Mamba align group the block list, its length, the
``last_state_block_idx`` entry and the ``_allocated_block_reqs`` membership.
:attr:`Plan.reads` are those reads written out as statements for the transaction (see
:mod:`.rollback` for why they are not a loop). :attr:`Plan.fast` is the bound under which
a call needs no record at all (:func:`fast_bound`).
"""
from __future__ import annotations

import functools
import inspect

#: Managers and coordinators whose per-request state this module knows (exact names).
KNOWN_MANAGERS = frozenset({
    "FullAttentionManager", "SlidingWindowManager", "ChunkedLocalAttentionManager",
    "CrossAttentionManager", "SinkFullAttentionManager", "RSWAManager",
    "CircularBufferManager", "MambaManager",
})
KNOWN_COORDINATORS = frozenset({
    "KVCacheCoordinatorNoPrefixCache", "UnitaryKVCacheCoordinator", "HybridKVCacheCoordinator",
})
#: ``allocate_slots``' parameters whose sum bounds the token positions one call can give
#: a request (``num_encoder_tokens`` is added where a cross-attention group reads it).
TOKEN_PARAMS = ("num_new_tokens", "num_new_computed_tokens", "num_external_computed_tokens",
                "num_lookahead_tokens")
#: Blocks a group may take in one call beyond ``tokens // block + 1`` (:func:`fast_bound`).
SLACK = 4


class Align:
    """One Mamba align group: what its undo needs besides the record."""

    __slots__ = ("index", "manager", "rtb", "last_state", "members", "nsb", "offloads")

    def __init__(self, index, manager):
        self.index, self.manager = index, manager
        self.rtb = manager.req_to_blocks
        self.last_state = manager.last_state_block_idx
        self.members = manager._allocated_block_reqs
        self.nsb = int(getattr(manager, "num_speculative_blocks", 0) or 0)
        self.offloads = isinstance(getattr(manager, "_pending_boundary_state_offloads", None),
                                   list)


class Plan:
    """The containers one manager's transaction records and restores.

    ``cached``: each group's ``num_cached_block``; ``align``: the Mamba align groups
    (:class:`Align`); ``rare``: per-request dicts usually empty (``_partial_hit_reqs``,
    ``_producer_partial_tail_reqs``), read only when one is not; ``record_ids``: managers
    that append to ``new_block_ids``; ``signature``: ``allocate_slots``' parameters as the
    transaction declares and passes them on (:func:`_signature`); ``reads`` and ``names``:
    the record as statements and the objects their names stand for (:meth:`_write_reads`);
    ``fast``: the fast path's bound (:func:`fast_bound`; None: every call records); all
    worked out once here for every transaction built on this plan.
    """

    __slots__ = ("manager", "managers", "gids", "journal", "cached", "align", "rare",
                 "record_ids", "containers", "signature", "reads", "names", "fast",
                 "big", "__weakref__")

    def __init__(self, manager, managers, journal):
        self.manager = manager
        self.managers = managers
        self.gids = {id(m): getattr(m, "kv_cache_group_id", i) for i, m in enumerate(managers)}
        self.journal = journal
        self.signature = _signature(type(manager).allocate_slots)
        self.cached = tuple(m.num_cached_block for m in managers)
        self.align = tuple(Align(i, m) for i, m in enumerate(managers)
                           if getattr(m, "mamba_cache_mode", None) == "align")
        rare, containers = [], []
        for m in managers:
            containers += [(m, "req_to_blocks", m.req_to_blocks),
                           (m, "num_cached_block", m.num_cached_block)]
            for name in ("_partial_hit_reqs", "_producer_partial_tail_reqs"):
                d = getattr(m, name, None)
                if isinstance(d, dict):
                    rare.append(d)
                    containers.append((m, name, d))
        for a in self.align:
            containers += [(a.manager, "last_state_block_idx", a.last_state),
                           (a.manager, "_allocated_block_reqs", a.members)]
        self.rare = tuple(rare)
        self.containers = tuple(containers)
        self.record_ids = tuple(m for m in managers if getattr(m, "_record_new_block_ids", False)
                                and isinstance(getattr(m, "new_block_ids", None), list))
        self.reads, self.names = self._write_reads()
        self.fast = fast_bound(managers, journal.queue, self.signature[0])
        self.big = any_call_bound(manager, self.fast)

    def bound(self, tokens: int) -> int | None:
        """The most blocks a call given ``tokens`` (the sum of :attr:`fast`'s terms) can
        take from the free queue; None without a fast path."""
        return None if self.fast is None else call_bound(self.fast, tokens)

    def _write_reads(self) -> tuple[tuple, dict]:
        """The record as statements over the request id ``rid``, each setting one local
        ``v0``, ``v1``, ... (the transaction builds the tuple only on failure), and the
        objects their names stand for: each group's cached-block count; per align group
        its block list, that list's length (0: absent), last state index and membership;
        last the rare dicts' values, or a false value while all of them are empty."""
        names: dict = {}
        exprs = []
        for i, d in enumerate(self.cached):
            names[f"cached{i}"] = d.get
            exprs.append(f"cached{i}(rid)")
        for i, a in enumerate(self.align):
            names[f"blocks{i}"], names[f"last{i}"] = a.rtb.get, a.last_state.get
            names[f"members{i}"] = a.members
            v = f"v{len(exprs)}"
            exprs += [f"blocks{i}(rid)", f"len({v}) if {v} is not None else 0",
                      f"last{i}(rid)", f"rid in members{i}"]
        for k, d in enumerate(self.rare):
            names[f"rare{k}"] = d
        rare = [f"rare{k}" for k in range(len(self.rare))]
        if not rare:
            exprs.append("()")
        elif len(rare) <= 4:        # an or-chain is cheaper than any() for a few dicts
            exprs.append(f"({' or '.join(rare)}) and "
                         f"({', '.join(r + '.get(rid)' for r in rare)},)")
        else:
            names["rare"] = self.rare
            exprs.append("any(rare) and [d.get(rid) for d in rare]")
        return tuple(f"v{j} = {e}" for j, e in enumerate(exprs)), names

    def nest(self, flat: tuple) -> tuple:
        """The values of :attr:`reads`, in order, as the undo takes them: (cached counts,
        per align group (blocks, length, last state index, member), rare values or
        None)."""
        n = len(self.cached)
        aligned = [flat[j:j + 4] for j in range(n, n + 4 * len(self.align), 4)]
        return flat[:n], aligned, flat[-1] or None

    def intact(self) -> bool:
        return all(getattr(m, name, None) is obj for m, name, obj in self.containers)


def fast_bound(managers, queue, params) -> tuple | None:
    """``(terms, block, groups, spare)``: an ``allocate_slots`` call takes at most
    ``groups * (sum(terms) // block) + spare`` blocks out of the free queue (popped by
    ``get_new_blocks`` or touched off it as a prefix hit), over every group; None when this
    vLLM's names do not allow the bound (no fast path). Read from vLLM 0.27.1, 0.32.0 and
    0.34.0 (``kv_cache_manager``, ``kv_cache_coordinator``, ``single_type_kv_cache_manager``),
    per group, with ``tokens`` the sum of the terms and ``block`` the smallest block size:

    * a table gains blocks only for the positions up to ``cdiv(num_tokens_need_slot,
      block_size)``, where ``num_tokens_need_slot`` is the request's computed tokens plus
      ``num_new_computed_tokens + num_external_computed_tokens + num_new_tokens +
      num_lookahead_tokens`` (capped at ``max_model_len``); it already holds the positions
      of its computed tokens, so it gains at most ``tokens // block + 1``: the prefix hits
      it touches (``add_local_computed_blocks``), the external tokens' blocks
      (``allocate_external_computed_blocks``) and the new ones (``allocate_new_blocks``);
      sliding-window and chunked-local positions out of the window are nulls, no block;
    * ``num_encoder_tokens``: a cross-attention group's positions (the coordinator gives
      it those instead), added only where such a group exists;
    * ``SLACK`` = 4 more: the copy-on-write block of a partial prefix hit (0.32+,
      ``_partial_hit_reqs``), and for Mamba ``align`` (which never allocates per position
      but at most ``1 + partial hit + prefill checkpoint`` blocks a call, plus the external
      tokens' one and a hit state touched) the checkpoint block, the external block and
      the hit state; a circular-buffer group's one ring block is within ``// block + 1``;
    * plus the largest Mamba ``num_speculative_blocks``: a new request's speculative state
      blocks (``align``: the ``max_new_blocks`` cap; ``none``: ``num_tokens + block_size *
      num_speculative_blocks``).

    The transaction compares with ``cdiv(groups * tokens, block) + spare``, no smaller and
    free of a division (:data:`.rollback.FAST`); ``unit_tests/test_fast_path_bound.py``
    checks that on every layout against what calls really take. Without
    ``num_new_tokens`` or an int ``num_free_blocks`` on the free queue (what
    ``BlockPool.get_num_free_blocks`` reads), there is no bound."""
    names = {p.lstrip("*").split("=")[0] for p in params}
    if "num_new_tokens" not in names or type(
            getattr(queue, "num_free_blocks", None)) is not int:
        return None
    terms = [n for n in TOKEN_PARAMS if n in names]
    if any(type(m).__name__ == "CrossAttentionManager" for m in managers):
        if "num_encoder_tokens" not in names:
            return None
        terms.append("num_encoder_tokens")
    sizes = [getattr(m, "block_size", None) for m in managers]
    if not sizes or not all(type(b) is int and b > 0 for b in sizes):
        return None
    nsb = max([int(getattr(m, "num_speculative_blocks", 0) or 0) for m in managers] + [0])
    return tuple(terms), min(sizes), len(managers), len(managers) * (1 + SLACK + nsb)


def call_bound(fast: tuple, tokens: int) -> int:
    """:func:`fast_bound`'s bound for a call given ``tokens``: ``cdiv(groups * tokens,
    block) + spare`` blocks."""
    _terms, block, groups, spare = fast
    return -(-tokens * groups // block) + spare


def any_call_bound(manager, fast) -> int | None:
    """The most blocks any ``allocate_slots`` call on ``manager`` can take, whatever its
    arguments: every group's table covers at most ``cdiv(max_model_len, block)`` positions
    (``num_tokens_need_slot`` is capped at ``max_model_len``, :func:`fast_bound`), plus the
    same spare; None without a fast path, an int ``max_model_len`` or with a
    cross-attention group (its encoder positions are not capped so: :func:`fast_bound`
    then counts ``num_encoder_tokens`` among its terms)."""
    mml = getattr(manager, "max_model_len", None)
    if fast is None or type(mml) is not int or mml <= 0 or "num_encoder_tokens" in fast[0]:
        return None
    _terms, block, groups, spare = fast
    return groups * -(-mml // block) + spare


def unsupported_reason(manager) -> str | None:
    """Why ``manager``'s allocations cannot be made transactional (None: they can)."""
    coord = getattr(manager, "coordinator", None)
    managers = getattr(coord, "single_type_managers", None)
    if coord is None or managers is None:
        return "a KVCacheManager without coordinator.single_type_managers"
    if "request" not in [p.name for p in _parameters(type(manager).allocate_slots)[1:]]:
        return "an allocate_slots without a 'request' parameter"
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


def _signature(fn) -> tuple[tuple, tuple, dict]:
    """``fn``'s parameters after ``self`` as the transaction declares them, how it passes
    them on (by position where it can) and the defaults by the names the declaration uses:
    vLLM's own parameters, so no call builds an ``*args`` tuple or ``**kwargs`` dict."""
    params, forward, defaults = [], [], {}
    kw_only = False
    for i, p in enumerate(_parameters(fn)[1:]):
        if p.kind is p.VAR_POSITIONAL:
            params.append(f"*{p.name}")
            forward.append(f"*{p.name}")
            kw_only = True
            continue
        if p.kind is p.VAR_KEYWORD:
            params.append(f"**{p.name}")
            forward.append(f"**{p.name}")
            continue
        if p.kind is p.KEYWORD_ONLY and not kw_only:
            params.append("*")
            kw_only = True
        decl = p.name
        if p.default is not p.empty:
            defaults[f"default{i}"] = p.default
            decl += f"=default{i}"
        params.append(decl)
        forward.append(f"{p.name}={p.name}" if kw_only else p.name)
    return tuple(params), tuple(forward), defaults


def _parameters(fn) -> tuple:
    """``fn``'s parameters, read once per function (every manager of a class asks)."""
    return _parameters_of(inspect.unwrap(fn))


@functools.lru_cache(maxsize=8)
def _parameters_of(fn) -> tuple:
    try:
        return tuple(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return ()
