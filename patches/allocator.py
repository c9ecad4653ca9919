"""Host surface: the scheduler-side KV block allocator.

Targets
    ``vllm.v1.core.kv_cache_manager.KVCacheManager.allocate_slots``
        -> hook ``kvguard_allocate_slots`` -> :mod:`vllm_kvguard.fixes.rollback`
    ``vllm.v1.core.sched.scheduler.Scheduler.schedule``
        -> hook ``kvguard_after_schedule`` -> :mod:`vllm_kvguard.fixes.audit`,
           :mod:`vllm_kvguard.fixes.liveness`
Why
    ``allocate_slots`` checks the budget once, then mutates group by group; a wrong
    estimate for one group raises ``ValueError("Cannot get N free blocks")`` half-way and
    kills EngineCore. Requests that can never fit wait forever.
Upstream
    vllm#45856 (engine dies on "Cannot get N free blocks"), vllm#46892 (Mamba align
    external-hit under-count), vllm#35541 / vllm#39734 (never-admittable request hangs).
Remove when
    vLLM's allocate_slots is transactional (rolls back on a mid-way failure) and the
    scheduler rejects requests that can never fit.
"""
from vllm_kvguard.manager import hook
from vllm_kvguard.registry import HostCall, Patch, Target, first_result, hooked

NAME = "allocator"


@hooked(NAME)
def allocate_slots(call: HostCall):
    return first_result(hook().kvguard_allocate_slots, call,
                        manager=call.instance, request=call.arg(0, "request"))


@hooked(NAME)
def schedule(call: HostCall):
    output = call()
    hook().kvguard_after_schedule(scheduler=call.instance, output=output)
    return output


def _setup():
    from vllm_kvguard import fixes

    fixes.register_allocator_fixes()


PATCH = Patch(
    name=NAME,
    summary="transactional allocate_slots, liveness guard, audit mode",
    targets=[
        Target("vllm.v1.core.kv_cache_manager", "KVCacheManager.allocate_slots", allocate_slots),
        Target("vllm.v1.core.sched.scheduler", "Scheduler.schedule", schedule),
    ],
    vllm_versions=">=0.27.1,<0.34",
    upstream=("vllm#45856", "vllm#46892", "vllm#35541", "vllm#39734"),
    remove_when="vLLM rolls back a half-done allocate_slots itself and rejects "
                "requests that can never fit",
    setup=_setup,
)
