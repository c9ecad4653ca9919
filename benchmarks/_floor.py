"""The transaction's cost floor: the real transaction with nothing to record.

``--floor`` in the benchmarks counts a third side beside off and on: the plugin as
installed, but each manager's plan lists no containers, so the real ``allocate_slots``
transaction (the same code, frame, open pool journal and pool shadows) records nothing
before vLLM's call. What the transaction costs above this floor is its record; what the
floor costs above "off" no cheaper record can remove. A failed call is not rolled back
correctly on this side (bench only).
"""
from __future__ import annotations

import copy

from vllm_kvguard.fixes import rollback

_saved = rollback.Rollback.plan_for


def _empty_plan_for(self, manager):
    plan = _saved(self, manager)
    if plan is None:
        return None
    empty = copy.copy(plan)
    empty.rtbs = empty.hot = empty.rare = empty.align = empty.record_ids = ()
    return empty


def set_floor(on: bool) -> None:
    rollback.Rollback.plan_for = _empty_plan_for if on else _saved
