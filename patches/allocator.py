"""TEMPORARY (redesign in progress): the allocator patch without its fast path."""
from __future__ import annotations

from vllm_kvguard.hostcall import HostCall, first_result, hooked
from vllm_kvguard.manager import hook
from vllm_kvguard.registry import Patch, Target

NAME = "allocator"


@hooked(NAME)
def allocate_slots(call: HostCall):
    return first_result(hook().kvguard_allocate_slots, call, manager=call.instance,
                        request=call.arg(0, "request"))


@hooked(NAME)
def schedule(call: HostCall):
    output = call()
    hook().kvguard_after_schedule(scheduler=call.instance, output=output)
    return output


def _setup(flags):
    from vllm_kvguard import fixes

    fixes.register_allocator_fixes()


def _teardown():
    from vllm_kvguard.fixes import rollback

    rollback.uninstall_all()


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
    teardown=_teardown,
)
