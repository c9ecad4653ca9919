"""What a transaction records for one ``KVCacheManager``, worked out once per manager.

vLLM keeps a request's allocation state in per-group containers it creates once and never
replaces. Most of what a failed call changed can be read back from the pool journal (the
blocks it took, touched or hashed) and the state it left; the plan lists the few values
that cannot, so the transaction reads only those before calling vLLM: each group's
``num_cached_block`` entry, and per Mamba align group the block list, its length, the
``last_state_block_idx`` entry and the ``_allocated_block_reqs`` membership.
"""
from __future__ import annotations

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
#: ``allocate_slots``' leading parameters and defaults, which the transaction takes by
#: name and passes on by position (the same on every supported vLLM).
LEADING = (("request", inspect.Parameter.empty), ("num_new_tokens", inspect.Parameter.empty),
           ("num_new_computed_tokens", 0), ("new_computed_blocks", None),
           ("num_lookahead_tokens", 0))


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

    ``cached_gets``: each group's ``num_cached_block.get``; ``align``: the Mamba align
    groups (:class:`Align`) and ``align_reads`` their ``(req_to_blocks.get,
    last_state_block_idx.get, _allocated_block_reqs)``; ``rare``: per-request dicts
    usually empty (``_partial_hit_reqs``, ``_producer_partial_tail_reqs``), read only when
    one is not; ``record_ids``: managers that append to ``new_block_ids``.
    """

    __slots__ = ("manager", "managers", "gids", "journal", "cached", "cached_gets", "align",
                 "align_reads", "rare", "record_ids", "containers", "__weakref__")

    def __init__(self, manager, managers, journal):
        self.manager = manager
        self.managers = managers
        self.gids = {id(m): getattr(m, "kv_cache_group_id", i) for i, m in enumerate(managers)}
        self.journal = journal
        self.cached = tuple(m.num_cached_block for m in managers)
        self.cached_gets = tuple(d.get for d in self.cached)
        self.align = tuple(Align(i, m) for i, m in enumerate(managers)
                           if getattr(m, "mamba_cache_mode", None) == "align")
        self.align_reads = tuple((a.rtb.get, a.last_state.get, a.members) for a in self.align)
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

    def intact(self) -> bool:
        return all(getattr(m, name, None) is obj for m, name, obj in self.containers)


def unsupported_reason(manager) -> str | None:
    """Why ``manager``'s allocations cannot be made transactional (None: they can)."""
    coord = getattr(manager, "coordinator", None)
    managers = getattr(coord, "single_type_managers", None)
    if coord is None or managers is None:
        return "a KVCacheManager without coordinator.single_type_managers"
    try:
        params = list(inspect.signature(type(manager).allocate_slots).parameters.values())
    except (TypeError, ValueError):
        params = []
    if tuple((p.name, p.default) for p in params[1:len(LEADING) + 1]) != LEADING:
        return "an allocate_slots with other leading parameters"
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
