"""The fixes: pluggy hookimpls, one module per concern. Patches register them on apply
(the cudagraph patch builds its fix objects itself, with the changes it declares)."""
from vllm_kvguard.manager import register


def register_allocator_fixes() -> None:
    from vllm_kvguard.fixes import audit, liveness, rollback

    register(rollback, "kvguard.rollback")
    register(liveness, "kvguard.liveness")
    register(audit, "kvguard.audit")


def register_fault_injection() -> None:
    from vllm_kvguard.fixes import faults

    register(faults, "kvguard.faults")


def register_warmup_fixes() -> None:
    from vllm_kvguard.fixes import capacity, estimate, warmup_guard

    register(estimate, "kvguard.estimate")
    register(warmup_guard, "kvguard.warmup_guard")
    register(capacity, "kvguard.capacity")

