"""What a transaction records for one ``KVCacheManager``, worked out once per manager.

vLLM keeps a request's allocation state in per-group containers that it creates once and
never replaces (``req_to_blocks``, ``num_cached_block``, Mamba's align-mode sets and
dicts). The plan lists them, so recording a request before a call is a few dict reads,
O(groups), and never a copy of a block list (lists only grow during the call). The
record uses comprehensions: building it from ``list(map(...))`` instead counted more
instructions on CPython 3.11 (``benchmarks/bench_allocator.py --instructions``).
"""
from __future__ import annotations

from itertools import repeat

#: Managers and coordinators whose per-request state this module knows (exact names).
KNOWN_MANAGERS = frozenset({
    "FullAttentionManager", "SlidingWindowManager", "ChunkedLocalAttentionManager",
    "CrossAttentionManager", "SinkFullAttentionManager", "RSWAManager",
    "CircularBufferManager", "MambaManager",
})
KNOWN_COORDINATORS = frozenset({
    "KVCacheCoordinatorNoPrefixCache", "UnitaryKVCacheCoordinator", "HybridKVCacheCoordinator",
})

_dict_get = dict.get


class Plan:
    """The containers one manager's transaction records and restores.

    ``rtbs``: each group's ``req_to_blocks``; ``dicts``: per-request dicts whose entry is
    recorded (``num_cached_block``, ``_partial_hit_reqs``, Mamba align's
    ``last_state_block_idx`` and ``_producer_partial_tail_reqs``); ``align``: per Mamba
    align group ``(group index, manager, _allocated_block_reqs, num_speculative_blocks,
    has pending boundary offloads)``; ``record_ids``: managers that append to
    ``new_block_ids``.
    """

    __slots__ = ("manager", "managers", "gids", "journal", "rtbs", "dicts", "align",
                 "record_ids", "containers", "__weakref__")

    def __init__(self, manager, managers, journal):
        self.manager = manager
        self.managers = managers
        self.gids = {id(m): getattr(m, "kv_cache_group_id", i) for i, m in enumerate(managers)}
        self.journal = journal
        containers, dicts, align = [], [], []
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
                    containers.append((m, name, d))
        self.rtbs = tuple(m.req_to_blocks for m in managers)
        self.dicts = tuple(dicts)
        self.align = tuple(align)
        self.containers = tuple(containers)
        self.record_ids = tuple(m for m in managers if getattr(m, "_record_new_block_ids", False)
                                and isinstance(getattr(m, "new_block_ids", None), list))

    def intact(self) -> bool:
        return all(getattr(m, name, None) is obj for m, name, obj in self.containers)

    def record(self, rid: str) -> tuple:
        """The request's entries before the call: (block list per group (None: absent),
        their lengths (-1: absent), the ``dicts`` values (None: absent), per align group
        (member of ``_allocated_block_reqs``, pending offload count, the last
        ``num_speculative_blocks`` table entries: the ones align mode rewrites in place),
        ``new_block_ids`` lengths)."""
        lists = list(map(_dict_get, self.rtbs, repeat(rid)))
        lens = [-1 if b is None else len(b) for b in lists]
        vals = [d.get(rid) if d else None for d in self.dicts]     # most are often empty
        align = ids = ()
        if self.align:
            align = [(rid in alloc, len(m._pending_boundary_state_offloads) if offl else 0,
                      tuple(lists[i][max(lens[i] - nsb, 0):lens[i]]) if nsb and lens[i] > 0
                      else ())
                     for i, m, alloc, nsb, offl in self.align]
        if self.record_ids:
            ids = [len(m.new_block_ids) for m in self.record_ids]
        return lists, lens, vals, align, ids


def unsupported_reason(manager) -> str | None:
    """Why ``manager``'s allocations cannot be made transactional (None: they can)."""
    coord = getattr(manager, "coordinator", None)
    managers = getattr(coord, "single_type_managers", None)
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
