"""vLLM's own natural trigger, reproduced on real objects (vllm#46892).

``MambaManager`` in align mode predicts one block too few for a new request with
external (KV-connector) computed tokens: full attention + Mamba, block 16, 32 external +
8 new tokens -> predicted 3 + 1 = 4 blocks, used 3 + 2 = 5. With exactly 4 free blocks
the capacity check passes, the attention group takes its 3 blocks, the Mamba group's
second ``get_new_blocks(1)`` raises.
"""
from __future__ import annotations

import re

import pytest

pytest.importorskip("vllm")

import vllm.v1.core.kv_cache_manager  # noqa: E402,F401  (loaded: patches apply at once)

from vllm_kvguard.testing.kv_fixtures import (free_ids, groups, hybrid_manager, make_request,  # noqa: E402
                         state, state_diff)

from vllm_kvguard import activation, report  # noqa: E402
from vllm_kvguard.tools.truth_table import record_defect  # noqa: E402

EXTERNAL, NEW = 32, 8


def predicted_blocks(manager, rid: str) -> int:
    """What vLLM's capacity check believes the allocation needs (side effects undone)."""
    coord = manager.coordinator
    n = coord.get_num_blocks_to_allocate(
        request_id=rid, num_tokens=EXTERNAL + NEW,
        new_computed_blocks=tuple([] for _ in groups(manager)), num_encoder_tokens=0,
        total_computed_tokens=EXTERNAL, num_local_computed_tokens=0,
        num_tokens_main_model=EXTERNAL + NEW)
    for m in groups(manager):
        m.req_to_blocks.pop(rid, None)
        getattr(m, "_checkpoints", {}).pop(rid, None)
    return n


def allocate(manager, req):
    return manager.allocate_slots(req, NEW, num_external_computed_tokens=EXTERNAL)


def make_pool(free_blocks: int):
    m = hybrid_manager(free_blocks + 1)                 # + the null block
    assert m.block_pool.get_num_free_blocks() == free_blocks
    return m


def test_without_the_fix_vllm_raises_and_leaves_a_half_allocation():
    m = make_pool(4)
    req = make_request("r", range(3, 3 + EXTERNAL + NEW))
    try:
        allocate(m, req)
        raised = None
    except ValueError as exc:                            # what kills EngineCore (vllm#45856)
        raised = exc
    attn, mamba = groups(m)
    held = sum(len([b for b in g.req_to_blocks.get("r", ()) if not b.is_null])
               for g in (attn, mamba))
    record_defect("allocator", "vllm#45856",
                  present=raised is not None and "Cannot get" in str(raised) and held > 0,
                  detail=f"unpatched allocate_slots: "
                         f"{type(raised).__name__ if raised else 'no error'}"
                         f"{f' ({raised})' if raised else ''}, {held} blocks left held")
    assert raised is not None and re.search("Cannot get 1 free blocks", str(raised))
    assert len(attn.req_to_blocks["r"]) == 3            # attention got all 3 blocks
    assert [b.is_null for b in mamba.req_to_blocks["r"]] == [True, False]
    assert "r" in attn.num_cached_block and "r" in mamba.num_cached_block
    assert m.block_pool.get_num_free_blocks() == 0       # everything is gone


def test_the_prediction_is_one_short():
    m = make_pool(8)
    predicted = predicted_blocks(m, "r")
    req = make_request("r", range(3, 3 + EXTERNAL + NEW))
    allocated = allocate(m, req)
    used = 8 - m.block_pool.get_num_free_blocks()
    record_defect("allocator", "vllm#46892", present=allocated is not None and predicted < used,
                  detail=f"Mamba align, {EXTERNAL} external + {NEW} new tokens: "
                         f"predicted {predicted} blocks, took {used}")
    assert predicted == 4
    assert allocated is not None
    assert used == 5                                     # what it really took


@pytest.mark.parametrize("env", [{"KVGUARD": "1", "KVGUARD_PATCHES": "allocator"},
                                 {"KVGUARD": "1"}], ids=["allocator", "KVGUARD=1-alone"])
def test_with_the_fix_none_and_exact_prior_state_then_success_when_room_exists(env):
    activation.activate(env)
    m = make_pool(6)
    holder = make_request("holder", range(500, 510))
    assert m.allocate_slots(holder, 10) is not None      # 1 attention + 1 Mamba block
    assert m.block_pool.get_num_free_blocks() == 4       # == the prediction
    req = make_request("r", range(3, 3 + EXTERNAL + NEW))
    before, order = state(m), free_ids(m)

    for _ in range(2):                                   # and again on the next step
        assert allocate(m, req) is None                  # "no room now", not a crash
        assert state_diff(before, state(m), hashes_may_shrink=False) == []
        assert free_ids(m) == order
    assert report.snapshot()["rollback"] == {"ValueError": 2}

    m.free(holder)                                       # room appears
    assert allocate(m, req) is not None
    assert sum(len([b for b in g if not b.is_null]) for g in m.get_blocks("r").blocks) == 5


def test_with_the_fix_one_more_free_block_is_enough():
    activation.activate({"KVGUARD": "1", "KVGUARD_PATCHES": "allocator"})
    m = make_pool(5)                                     # prediction + 1
    assert allocate(m, make_request("r", range(3, 3 + EXTERNAL + NEW))) is not None
    assert "rollback" not in report.snapshot()
