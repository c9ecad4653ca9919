"""Every change the plugin makes to vLLM is in the registry, and revert() undoes it exactly.

A real scheduler runs traffic with every patch applied (faults armed, some rolled back);
then the registry alone lists the changes (wrapped class attributes, instance attributes
on managers and pools), and after ``revert()`` each vLLM object is as it was: the same
class attributes, no attribute of ours left on any instance, vLLM's own untouched.
"""
from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import vllm.v1.core.kv_cache_manager  # noqa: E402,F401  (loaded: patches apply at once)
import vllm.v1.core.sched.scheduler  # noqa: E402,F401
from vllm_kvguard.testing.kv_fixtures import make_request, make_scheduler, scheduler_step  # noqa: E402

from vllm_kvguard import activation, report  # noqa: E402
from vllm_kvguard.patches import ALL_PATCHES  # noqa: E402
from vllm_kvguard.registry import resolve  # noqa: E402

pytestmark = pytest.mark.requires_patch("allocator")


def _class_attrs():
    """(parent, attribute) -> the raw attribute, for every target of every patch."""
    found = {}
    for patch in ALL_PATCHES:
        for t in patch.targets:
            resolved = resolve(t.module, t.qualname)
            if resolved is not None:
                parent, attr, _ = resolved
                found[(parent, attr)] = vars(parent).get(attr)
    return found


def _traffic():
    sched = make_scheduler(num_gpu_blocks=40)
    for i in range(6):
        sched.add_request(make_request(f"r{i}", [(i * 31 + j) % 900 + 3 for j in range(50)]))
    for _ in range(12):
        scheduler_step(sched)
    return sched


def test_the_registry_lists_every_change_and_revert_restores_each_object():
    plain = _traffic()                                 # vLLM alone: its own attributes
    plain_keys = {"manager": set(vars(plain.kv_cache_manager)),
                  "pool": set(vars(plain.kv_cache_manager.block_pool)),
                  "queue": set(vars(plain.kv_cache_manager.block_pool.free_block_queue)),
                  "scheduler": set(vars(plain))}
    classes = _class_attrs()

    activation.activate({"KVGUARD": "1", "KVGUARD_FAULTS": "every=5"})
    sched = _traffic()
    assert report.snapshot().get("rollback"), "the traffic must roll something back"
    manager, pool = sched.kv_cache_manager, sched.kv_cache_manager.block_pool
    queue = pool.free_block_queue
    rows = [(p.name, kind, name, obj) for p in ALL_PATCHES for kind, name, obj in p.inventory()]
    on_objects = {(kind, name.rsplit(".", 1)[-1]) for _p, kind, name, obj in rows
                  if obj is manager or obj is pool or obj is queue}
    assert {("instance attribute", a) for a in ("allocate_slots", "touch", "_insert_block_hash",
                                                "popleft_n")} <= on_objects
    assert pool.metrics_collector is None              # vLLM's own value, never replaced
    # Nothing undeclared: every attribute the live objects have beyond vLLM's own is listed.
    declared = {(id(obj), name.rsplit(".", 1)[-1]) for _p, _k, name, obj in rows}
    for label, obj in (("manager", manager), ("pool", pool), ("queue", queue),
                       ("scheduler", sched)):
        extra = set(vars(obj)) - plain_keys[label]
        assert {(id(obj), a) for a in extra} <= declared, (label, extra)
    wrapped = {name for _p, kind, name, _obj in rows if kind == "wrapped"}
    assert {"KVCacheManager.allocate_slots", "Scheduler.schedule",
            "BlockPool.get_new_blocks"} <= wrapped

    activation.deactivate()
    assert [r for p in ALL_PATCHES for r in p.inventory()] == []
    assert set(vars(manager)) == plain_keys["manager"]
    assert set(vars(pool)) == plain_keys["pool"]
    assert set(vars(queue)) == plain_keys["queue"]
    assert set(vars(sched)) == plain_keys["scheduler"]
    for (parent, attr), raw in classes.items():
        assert vars(parent).get(attr) is raw, f"{parent.__name__}.{attr} not restored"
    scheduler_step(sched)                              # vLLM runs on, unpatched
