"""The transaction's cost floor: ``Rollback.transaction`` with the record taken out.

``--floor`` in the benchmarks counts a third side beside off and on: the plugin as
installed, but each manager's transaction only opens the pool journal around vLLM's call
(the same frame, the same pool shadows) and records nothing before it. What the real
transaction costs above this floor is its record; what the floor costs above "off" no
cheaper record can remove. A failed call is not rolled back on this side (bench only).
"""
from __future__ import annotations

from vllm_kvguard.fixes import rollback

_saved = rollback.Rollback.transaction


def _floor_transaction(self, manager, fn):
    plan = self.plan_for(manager)
    if plan is None:
        return None
    journal = plan.journal

    def allocate_slots(request, num_new_tokens, num_new_computed_tokens=0,
                       new_computed_blocks=None, num_lookahead_tokens=0, *args, **kwargs):
        if journal.log is not None or self.disabled:
            return fn(request, num_new_tokens, num_new_computed_tokens,
                      new_computed_blocks, num_lookahead_tokens, *args, **kwargs)
        journal.log = []
        try:
            if args or kwargs:
                return fn(request, num_new_tokens, num_new_computed_tokens,
                          new_computed_blocks, num_lookahead_tokens, *args, **kwargs)
            return fn(request, num_new_tokens, num_new_computed_tokens,
                      new_computed_blocks, num_lookahead_tokens)
        finally:
            journal.log = None

    return allocate_slots


def set_floor(on: bool) -> None:
    rollback.Rollback.transaction = _floor_transaction if on else _saved
