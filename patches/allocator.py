"""Host surface: the scheduler-side KV block allocator.

Targets
    ``KVCacheManager.allocate_slots`` -> hook ``kvguard_allocate_slots`` ->
        :class:`vllm_kvguard.fixes.transaction.rollback.Rollback` (the transaction)
    ``Scheduler.schedule`` -> hook ``kvguard_after_schedule`` ->
        :mod:`vllm_kvguard.fixes.transaction.audit` (``KVGUARD_AUDIT=1``), :mod:`vllm_kvguard.fixes.estimation.liveness`
Run-time changes
    ``KVCacheManager.allocate_slots`` per manager: while the rollback fix is the only
    ``kvguard_allocate_slots`` implementation, each manager's first call installs its
    transaction as an instance attribute, so later calls skip wrapt, ``HostCall`` and
    pluggy (``allocate_slots`` runs once per scheduled request per step). Any other
    registration, a trip, or revert removes them all. A call whose pool holds more free
    blocks than it can take runs unrecorded (the transaction's fast path), except while
    the fault injector is on (``KVGUARD_FAULTS``).
    ``Scheduler.schedule``: vLLM's call, then the ``kvguard_after_schedule``
    implementations called directly (``manager.direct``, refreshed on every registration
    change; through pluggy while a hook wrapper is registered), no ``HostCall`` per step.
    ``BlockPool`` per pool: the journal's seams (:mod:`.fixes.transaction.journal`): its
    free queue's ``popleft_n`` (the blocks ``get_new_blocks`` takes), ``touch`` and
    ``_insert_block_hash`` (these two only while calls record: calls with room take them
    off, the next recorded call puts them back). The same seams on every release;
    ``metrics_collector`` is never set, so vLLM 0.34's collector-less fast path in
    ``get_new_blocks`` stays on.
Why
    ``allocate_slots`` checks the budget once, then mutates group by group; a wrong
    estimate for one group raises ``ValueError("Cannot get N free blocks")`` half-way and
    kills EngineCore. Requests that can never fit wait forever.
Upstream
    vllm#45856, vllm#46892, vllm#35541, vllm#39734.
Remove when
    vLLM's allocate_slots rolls back a mid-way failure and the scheduler rejects requests
    that can never fit.
"""
from __future__ import annotations

from vllm_kvguard import hostcall
from vllm_kvguard import manager as plugins
from vllm_kvguard.hostcall import HostCall, after, first_result, hooked
from vllm_kvguard.registry import InstanceAttr, Patch, Private, Target

NAME = "allocator"
KV_MANAGER = "vllm.v1.core.kv_cache_manager"
STM = "vllm.v1.core.single_type_kv_cache_manager"

FAST_PATH = InstanceAttr(KV_MANAGER, "KVCacheManager", "allocate_slots",
                         "the manager's transaction, called without wrapt and pluggy")
POOL = "vllm.v1.core.block_pool"
UTILS = "vllm.v1.core.kv_cache_utils"
POOL_SEAMS = {
    "popleft_n": InstanceAttr(UTILS, "FreeKVCacheBlockQueue", "popleft_n",
                              "logs the blocks get_new_blocks takes from a pool's free "
                              "queue, in pop order"),
    "touch": InstanceAttr(POOL, "BlockPool", "touch",
                          "logs each touched block's ref count and free-queue place"),
    "_insert_block_hash": InstanceAttr(POOL, "BlockPool", "_insert_block_hash",
                                       "logs each block that gains a prefix-cache hash"),
}


class _State:
    fix = None                  # the Rollback this patch registered
    fast = False                # whether managers get their transaction installed
    after = ()                  # kvguard_after_schedule's implementations (manager.direct)
    undo: list = []


def _sole_fix() -> bool:
    impls = plugins.impls("kvguard_allocate_slots")
    return len(impls) == 1 and impls[0].plugin is _State.fix


def _recheck() -> None:
    """A registration changed (or the patch tripped, or rollback turned itself off):
    choose the path again."""
    _State.fast = (_State.fix is not None and not _State.fix.disabled
                   and not hostcall.tripped(NAME) and _sole_fix())
    _State.after = plugins.direct("kvguard_after_schedule") or (_after_schedule,)
    if not _State.fast:
        for m in FAST_PATH.objects():
            FAST_PATH.unset(m)


def _ours(manager) -> bool:
    """Whether ``manager``'s class attribute is this patch's wrapper (not a subclass
    override or another wrapper): read from the MRO, no module lookup per call."""
    for klass in type(manager).__mro__:
        if "allocate_slots" in vars(klass):
            raw = vars(klass)["allocate_slots"]
            return getattr(raw, "_self_wrapper", None) is allocate_slots
    return False


def fast_bound(manager, tokens: int) -> int | None:
    """The most blocks an ``allocate_slots`` call of ``tokens`` (new + prefix-hit + external
    + lookahead tokens) can take on ``manager``: with at least that many free it runs
    unrecorded (None: every call records). Self-tests that need the record leave less."""
    fix = _State.fix
    plan = fix.plan_for(manager) if fix is not None and fix.fast else None
    return plan.bound(tokens) if plan is not None else None


@hooked(NAME)
def allocate_slots(call: HostCall):
    manager = call.instance
    if _State.fast and FAST_PATH.get(manager) is None and _ours(manager):
        txn = _State.fix.transaction(manager, call.wrapped)
        if txn is not None:
            FAST_PATH.set(manager, txn)
    return first_result(plugins.hook().kvguard_allocate_slots, call, manager=manager,
                        request=call.arg(0, "request"))


@after(NAME)
def schedule(scheduler, output) -> None:
    for fn in _State.after:
        fn(scheduler, output)


def _after_schedule(scheduler, output) -> None:
    """Through pluggy: while a hook wrapper is registered."""
    plugins.hook().kvguard_after_schedule(scheduler=scheduler, output=output)


def _notify(**kwargs) -> None:
    plugins.hook().kvguard_allocation_rolled_back(**kwargs)


def _setup(flags):
    from vllm_kvguard.fixes.estimation import liveness
    from vllm_kvguard.fixes.transaction import rollback

    # the fault injector's faults need every call recorded: no fast path while it is on
    _State.fix = rollback.Rollback(POOL_SEAMS, notify=_notify, on_disable=_recheck,
                                   fast=flags is None or flags.faults is None)
    plugins.register(_State.fix, "kvguard.rollback")
    plugins.register(liveness.Liveness(flags.liveness_steps if flags else 64),
                     "kvguard.liveness")
    if flags is not None and flags.audit:
        from vllm_kvguard.fixes.transaction import audit

        plugins.register(audit.Audit(), "kvguard.audit")
    _State.undo = [plugins.on_change(_recheck), hostcall.on_trip(lambda _name: _recheck())]
    _recheck()


def _teardown():
    for undo in _State.undo:
        undo()
    _State.undo = []
    for name in ("kvguard.rollback", "kvguard.liveness", "kvguard.audit"):
        plugins.unregister(name)
    if _State.fix is not None:
        _State.fix.close()
    _State.fix, _State.fast, _State.after = None, False, ()


PATCH = Patch(
    name=NAME,
    summary="transactional allocate_slots, liveness guard, audit mode",
    targets=[
        Target(KV_MANAGER, "KVCacheManager.allocate_slots", allocate_slots),
        Target("vllm.v1.core.sched.scheduler", "Scheduler.schedule", schedule),
    ],
    changes=(FAST_PATH, *POOL_SEAMS.values()),
    uses=(
        Private(POOL, "BlockPool", ("_maybe_evict_cached_block", "_insert_block_hash",
                                    "free_block_queue", "cached_block_hashes_by_block")),
        Private(UTILS, "FreeKVCacheBlockQueue", ("popleft_n", "prepend_n", "num_free_blocks",
                                                 "fake_free_list_head", "fake_free_list_tail")),
        Private(UTILS, "KVCacheBlock", ("ref_cnt", "prev_free_block", "next_free_block",
                                        "block_hash")),
        Private(UTILS, "KVCacheBlock", ("pool",), ">=0.32"),   # the audit: a weakref >=0.34
        Private(STM, "SingleTypeKVCacheManager", ("_partial_hit_reqs",)),
        Private(STM, "SingleTypeKVCacheManager", ("_record_new_block_ids",)),
        Private(STM, "FullAttentionManager", ("_pending_cow_copies",)),
        Private(STM, "MambaManager", ("_allocated_block_reqs", "_producer_partial_tail_reqs")),
        Private(STM, "MambaManager", ("_pending_boundary_state_offloads",), ">=0.29"),
        Private("vllm.v1.core.sched.scheduler", "Scheduler", ("_pause_state",)),
    ),
    vllm_versions=">=0.27.1,<0.35",
    upstream=("vllm#45856", "vllm#46892", "vllm#35541", "vllm#39734"),
    remove_when="vLLM rolls back a half-done allocate_slots itself and rejects "
                "requests that can never fit",
    setup=_setup,
    teardown=_teardown,
)
