"""Parity fuzz: the reserved-block model against the installed vLLM's REAL KVCacheManager.

For random shapes (block size, max_model_len, lookahead k, Mamba speculative blocks, DCP,
prompt, prefill chunking, decode steps of 1..k+1 tokens) a request is driven through
``KVCacheManager.allocate_slots``; after every call the model's ``table`` must equal
``len(req_to_blocks[rid])`` and its ``physical`` must equal the non-null blocks the
request holds (which also equal what left the pool). >= 300 examples per spec type.

Builders come from ``vllm_kvguard.testing`` (version-tolerant, real vLLM objects). Tests
skip with a reason where a spec type does not exist in the installed vLLM.
"""
from __future__ import annotations

import pytest

pytest.importorskip("vllm")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from vllm_kvguard.fixes.estimation.estimate import lookahead_tokens, reserved_blocks  # noqa: E402
from vllm_kvguard.testing.estimate_fixtures import (allocate, held, make_manager,  # noqa: E402
                                                    make_request, spec_chunked, spec_class,
                                                    spec_cross, spec_full, spec_mamba,
                                                    spec_swa)
from vllm_kvguard.testing.kv_fixtures import used_blocks  # noqa: E402

EXAMPLES = 300


# ------------------------------------------------------------------------------ the fuzz
@st.composite
def trajectories(draw, *, max_len=96, spec_steps=True, align=False):
    bs = draw(st.sampled_from([1, 2, 3, 4, 8, 16]))
    mml = draw(st.integers(2, max_len))
    k = draw(st.integers(0, 7)) if spec_steps else 0
    prompt = draw(st.integers(1, mml))
    chunk = draw(st.integers(1, prompt))
    if align:  # the scheduler ends non-final align chunks on block boundaries
        chunk = max(bs, chunk // bs * bs)
    steps = draw(st.lists(st.integers(1, k + 1), max_size=12))
    return dict(bs=bs, mml=mml, k=k, prompt=prompt, chunk=chunk, steps=steps)


def run_parity(make_spec, t, *, dcp=1, lookahead=True, encoder=0):
    """Drive one request and compare model and allocator after every allocate_slots."""
    spec = make_spec(t["bs"])
    mml, k = t["mml"], (t["k"] if lookahead else 0)
    manager = make_manager([spec], num_blocks=4 * mml + 64, max_model_len=mml, dcp=dcp)
    req = make_request("r", t["prompt"])
    computed = 0
    chunks = []
    left = t["prompt"]
    while left:
        chunks.append(min(t["chunk"], left))
        left -= chunks[-1]
    for q in chunks + t["steps"]:
        q = min(q, mml - computed)
        if q <= 0:
            break
        out = allocate(manager, req, q, k=k, encoder=encoder)
        assert out is not None, "pool sized generously: allocation must succeed"
        want = reserved_blocks(spec, computed + q, num_lookahead_tokens=k, max_model_len=mml,
                               num_encoder_tokens=encoder, dcp=dcp,
                               num_computed_tokens=computed)
        got = held(manager, "r")
        assert want == got, (f"model {want} != allocator {got} at N={computed + q}, "
                             f"C={computed}, {t}, dcp={dcp}")
        assert used_blocks(manager) == got.physical
        computed += q
        req.num_computed_tokens = computed


SETTINGS = settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
                    suppress_health_check=list(HealthCheck))


@SETTINGS
@given(trajectories(), st.sampled_from([1, 2, 4]))
def test_full_attention(t, dcp):
    run_parity(spec_full, t, dcp=dcp)


DCP = st.sampled_from([1, 1, 2])   # DCP > 1 shards some specs' blocks, per version


@SETTINGS
@given(trajectories(), st.integers(1, 40), DCP)
def test_sliding_window(t, window, dcp):
    spec_class("SlidingWindowSpec")
    run_parity(lambda bs: spec_swa(bs, window), t, dcp=dcp)


@SETTINGS
@given(trajectories(), st.integers(1, 40), DCP)
def test_chunked_local(t, chunk, dcp):
    spec_class("ChunkedLocalAttentionSpec")
    run_parity(lambda bs: spec_chunked(bs, chunk), t, dcp=dcp)


@SETTINGS
@given(trajectories(), st.integers(0, 4), st.sampled_from(["none", "all"]), DCP)
def test_mamba_none_and_all(t, nsb, mode, dcp):
    spec_class("MambaSpec")
    run_parity(lambda bs: spec_mamba(bs, mode, nsb), t, dcp=dcp)


@SETTINGS
@given(trajectories(align=True), st.integers(0, 4), DCP)
def test_mamba_align(t, nsb, dcp):
    spec_class("MambaSpec")
    run_parity(lambda bs: spec_mamba(bs, "align", nsb), t, dcp=dcp)


@SETTINGS
@given(trajectories(), st.integers(1, 64), st.sampled_from([1, 2]))
def test_cross_attention(t, encoder, dcp):
    spec_class("CrossAttentionSpec")
    run_parity(spec_cross, t, encoder=encoder, dcp=dcp)


def test_hybrid_pool_is_the_sum_of_groups():
    """Two groups share one pool: what leaves the pool is the sum of the model's physical."""
    specs = [spec_full(16), spec_mamba(16, "align", 3)]
    manager = make_manager(specs, num_blocks=64, max_model_len=256)
    req = make_request("r", 40)
    allocate(manager, req, 40, k=3)
    want = [reserved_blocks(s, 40, num_lookahead_tokens=3, max_model_len=256) for s in specs]
    assert [held(manager, "r", g) for g in range(2)] == want == [(3, 3), (6, 4)]
    assert used_blocks(manager) == 7


def test_lookahead_capped_by_max_model_len():
    spec = spec_full(16)
    assert reserved_blocks(spec, 30, num_lookahead_tokens=7, max_model_len=32) == (2, 2)
    assert reserved_blocks(spec, 30, num_lookahead_tokens=7, max_model_len=64) == (3, 3)


def test_unknown_spec_is_none():
    assert reserved_blocks(object(), 10, max_model_len=32) is None


def test_lookahead_tokens_from_config():
    from types import SimpleNamespace

    assert lookahead_tokens(SimpleNamespace(speculative_config=None)) == 0
    eagle = SimpleNamespace(num_speculative_tokens=3, use_eagle=lambda: True)
    assert lookahead_tokens(SimpleNamespace(speculative_config=eagle)) == 3
    ngram = SimpleNamespace(num_speculative_tokens=3, use_eagle=lambda: False,
                            uses_draft_model=lambda: False)
    assert lookahead_tokens(SimpleNamespace(speculative_config=ngram)) == 0
