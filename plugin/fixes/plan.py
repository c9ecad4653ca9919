"""What a transaction records for one ``KVCacheManager``, worked out once per manager.

vLLM keeps a request's allocation state in per-group containers that it creates once and
never replaces (``req_to_blocks``, ``num_cached_block``, Mamba's align-mode sets and
dicts). The plan lists them, so recording a request before a call is a few dict reads,
O(groups), and never a copy of a block list (lists only grow during the call). The
transaction reads them in its own frame (:mod:`.rollback`); this module only sorts them.
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


class Plan:
    """The containers one manager's transaction records and restores.

    ``rtbs``: each group's ``req_to_blocks``; ``hot``: per-request dicts most requests
    have an entry in (``num_cached_block``, Mamba align's ``last_state_block_idx``);
    ``rare``: those usually empty (``_partial_hit_reqs``, ``_producer_partial_tail_reqs``),
    read only when one is not; ``dicts``: ``hot + rare``; ``align``: per Mamba align group
    ``(group index, manager, _allocated_block_reqs, num_speculative_blocks, has pending
    boundary offloads)``; ``record_ids``: managers that append to ``new_block_ids``.
    """

    __slots__ = ("manager", "managers", "gids", "journal", "rtbs", "hot", "rare", "dicts",
                 "align", "record_ids", "containers", "__weakref__")

    def __init__(self, manager, managers, journal):
        self.manager = manager
        self.managers = managers
        self.gids = {id(m): getattr(m, "kv_cache_group_id", i) for i, m in enumerate(managers)}
        self.journal = journal
        containers, hot, rare, align = [], [], [], []
        for i, m in enumerate(managers):
            names = [("num_cached_block", hot), ("_partial_hit_reqs", rare)]
            if getattr(m, "mamba_cache_mode", None) == "align":
                names += [("last_state_block_idx", hot), ("_producer_partial_tail_reqs", rare)]
                align.append((i, m, m._allocated_block_reqs,
                              int(getattr(m, "num_speculative_blocks", 0) or 0),
                              isinstance(getattr(m, "_pending_boundary_state_offloads", None),
                                         list)))
                containers.append((m, "_allocated_block_reqs", m._allocated_block_reqs))
            containers.append((m, "req_to_blocks", m.req_to_blocks))
            for name, kind in names:
                d = getattr(m, name, None)
                if isinstance(d, dict):
                    kind.append(d)
                    containers.append((m, name, d))
        self.rtbs = tuple(m.req_to_blocks for m in managers)
        self.hot, self.rare = tuple(hot), tuple(rare)
        self.dicts = self.hot + self.rare
        self.align = tuple(align)
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
