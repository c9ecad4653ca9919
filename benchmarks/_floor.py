"""The floor under any per-call allocator transaction: the benchmarks' ``floor`` side.

The plugin as installed, with its ``allocate_slots`` transaction cut to a pass-through of
vLLM's own signature: one Python frame per call, nothing recorded; the pool seams, the
other patches and the fast-path dispatch stay (the seams still log, and with no
transaction to empty it the log grows for the benchmark's few steps). What "on" costs
above this floor is the transaction's bound check (a call with room records nothing),
journal reset and ``try``; what the floor costs over "off", no per-call Python wrapper of
``allocate_slots`` can avoid. :func:`recorded` is the other side: the transaction with its
fast path off, the record every call paid before it.
"""
from __future__ import annotations

PASS_THROUGH = "def allocate_slots({params}):\n    return fn({forward})\n"


def cut_to_pass_through() -> None:
    """Every transaction built from now on in this process is the pass-through."""
    from vllm_kvguard.fixes.transaction import rollback

    rollback.TRANSACTION = PASS_THROUGH
    rollback._compiled.cache_clear()


def pass_through(manager, fn):
    """``fn`` (vLLM's ``allocate_slots`` bound to ``manager``) wrapped the way the
    installed allocator patch wraps it, cut to the pass-through."""
    from vllm_kvguard.fixes.transaction import rollback
    from vllm_kvguard.patches import allocator

    saved = rollback.TRANSACTION
    cut_to_pass_through()
    try:
        return allocator._State.fix.transaction(manager, fn)
    finally:
        rollback.TRANSACTION = saved
        rollback._compiled.cache_clear()


def recorded(manager, fn):
    """``fn`` wrapped in the installed transaction with its fast path off (every call
    records, as with the fault injector on)."""
    from vllm_kvguard.patches import allocator

    fix = allocator._State.fix
    saved, fix.fast = fix.fast, False
    try:
        return fix.transaction(manager, fn)
    finally:
        fix.fast = saved
