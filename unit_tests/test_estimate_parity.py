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

import math

import pytest

pytest.importorskip("vllm")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from vllm_kvguard.fixes.estimation.estimate import lookahead_tokens, reserved_blocks  # noqa: E402
from vllm_kvguard.fixes.estimation.schedule import checkpointing  # noqa: E402
from vllm_kvguard.testing.estimate_fixtures import (allocate, held, lag_reason,  # noqa: E402
                                                    make_manager, make_request, spec_chunked,
                                                    spec_class, spec_cross, spec_full,
                                                    spec_mamba, spec_swa)
from vllm_kvguard.testing.kv_fixtures import attention_spec, used_blocks  # noqa: E402

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


def run_parity(make_spec, t, *, dcp=1, lookahead=True, encoder=0, lag=False, hash_block=None,
               retention=None):
    """Drive one request and compare model and allocator after every allocate_slots.
    ``lag``: as under the async scheduler, the previous step is still in flight
    (``num_in_flight_tokens``) when the next is allocated; ``hash_block``: the block
    pool's hash block size, a divisor of the block size (default: the block size);
    ``retention``: the prefix-cache retention interval (0: sparse, the engine default)."""
    spec = make_spec(t["bs"])
    mml, k = t["mml"], (t["k"] if lookahead else 0)
    hbs = math.gcd(hash_block, t["bs"]) if hash_block else None
    manager = make_manager([spec], num_blocks=4 * mml + 64, max_model_len=mml, dcp=dcp,
                           hash_block_size=hbs, retention=retention)
    ckpt = checkpointing(manager).get(0)
    if ckpt is not None:        # allocate_slots: max(prompt, num_tokens - 1)
        ckpt = ckpt._replace(prefill_end=t["prompt"])
    req = make_request("r", t["prompt"])
    computed, previous = 0, 0
    chunks = []
    left = t["prompt"]
    while left:
        chunks.append(min(t["chunk"], left))
        left -= chunks[-1]
    for q in chunks + t["steps"]:
        q = min(q, mml - computed)
        if q <= 0:
            break
        req.num_in_flight_tokens = previous if lag else 0
        out = allocate(manager, req, q, k=k, encoder=encoder)
        assert out is not None, "pool sized generously: allocation must succeed"
        want = reserved_blocks(spec, computed + q, num_lookahead_tokens=k, max_model_len=mml,
                               num_encoder_tokens=encoder, dcp=dcp,
                               num_computed_tokens=computed,
                               num_settled_tokens=computed - req.num_in_flight_tokens,
                               checkpointing=ckpt)
        got = held(manager, "r")
        assert want == got, (f"model {want} != allocator {got} at N={computed + q}, "
                             f"C={computed}, in flight {req.num_in_flight_tokens}, {t}, "
                             f"dcp={dcp}, {ckpt}")
        assert used_blocks(manager) == got.physical
        computed, previous = computed + q, q
        req.num_computed_tokens = computed


SETTINGS = settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
                    suppress_health_check=list(HealthCheck))


LAG = st.booleans()   # the async scheduler's previous step still in flight


@SETTINGS
@given(trajectories(), st.sampled_from([1, 2, 4]), LAG)
def test_full_attention(t, dcp, lag):
    run_parity(spec_full, t, dcp=dcp, lag=lag)


DCP = st.sampled_from([1, 1, 2])   # DCP > 1 shards some specs' blocks, per version


@SETTINGS
@given(trajectories(), st.integers(1, 40), DCP, LAG)
def test_sliding_window(t, window, dcp, lag):
    spec_class("SlidingWindowSpec")
    run_parity(lambda bs: spec_swa(bs, window), t, dcp=dcp, lag=lag)


@SETTINGS
@given(trajectories(), st.integers(1, 40), DCP, LAG)
def test_chunked_local(t, chunk, dcp, lag):
    spec_class("ChunkedLocalAttentionSpec")
    run_parity(lambda bs: spec_chunked(bs, chunk), t, dcp=dcp, lag=lag)


@SETTINGS
@given(trajectories(), st.integers(0, 4), st.sampled_from(["none", "all"]), DCP, LAG)
def test_mamba_none_and_all(t, nsb, mode, dcp, lag):
    spec_class("MambaSpec")
    run_parity(lambda bs: spec_mamba(bs, mode, nsb), t, dcp=dcp, lag=lag)


#: a Mamba align spec's prefill checkpoint: none (Mamba1), alignment 1 (Mamba2), a grid
CHECKPOINT = st.sampled_from([None, 1, 1, 2, 4])


@SETTINGS
@given(trajectories(align=True), st.integers(0, 4), DCP, LAG, CHECKPOINT,
       st.sampled_from([None, 1, 2, 4]), st.sampled_from([None, 0]))
def test_mamba_align(t, nsb, dcp, lag, checkpoint, hash_block, retention):
    spec_class("MambaSpec")
    lag = lag and lag_reason() is None
    run_parity(lambda bs: spec_mamba(bs, "align", nsb, checkpoint), t, dcp=dcp, lag=lag,
               hash_block=hash_block, retention=retention)


@SETTINGS
@given(trajectories(), st.integers(1, 64), st.sampled_from([1, 2]))
def test_cross_attention(t, encoder, dcp):
    spec_class("CrossAttentionSpec")
    run_parity(spec_cross, t, encoder=encoder, dcp=dcp)


def test_hybrid_pool_is_the_sum_of_groups():
    """Two groups share one pool: what leaves the pool is the sum of the model's physical
    (Mamba2's align group: the state, its prefill checkpoint and 3 speculative blocks)."""
    specs = [spec_full(16), spec_mamba(16, "align", 3)]
    checkpoint = int(getattr(specs[1], "num_prefill_checkpoint_blocks", 0))   # 0.32+
    manager = make_manager(specs, num_blocks=64, max_model_len=256)
    req = make_request("r", 40)
    allocate(manager, req, 40, k=3)
    want = [reserved_blocks(s, 40, num_lookahead_tokens=3, max_model_len=256) for s in specs]
    assert [held(manager, "r", g) for g in range(2)] == want == [(3, 3), (6, 4 + checkpoint)]
    assert used_blocks(manager) == 7 + checkpoint


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


# ------------------------------------------- vLLM's own V2 warmup count (_reserved_block_count)
def _vllm_count():
    """vLLM's own ``_reserved_block_count`` (0.32+), unwrapped."""
    warmup = pytest.importorskip("vllm.v1.worker.gpu.warmup")
    fn = getattr(warmup, "_reserved_block_count", None)
    if fn is None:
        pytest.skip("no _reserved_block_count in this vLLM (0.27.1 counts inline)")
    return warmup, getattr(fn, "__wrapped__", fn)


SPEC_KINDS = ["full", "full-unsharded", "swa", "chunked", "mamba-none", "mamba-all",
              "mamba-align", "cross", "ring"]


def _spec(kind: str, bs: int, extra: int):
    if kind == "full":
        return spec_full(bs)
    if kind == "full-unsharded":
        return attention_spec(bs, dcp_sharded=False)
    if kind == "swa":
        return spec_swa(bs, extra)
    if kind == "chunked":
        return spec_chunked(bs, extra)
    if kind.startswith("mamba"):
        return spec_mamba(bs, kind.split("-")[1], extra % 5)
    if kind == "cross":
        return spec_cross(bs)
    return attention_spec(bs, spec_class("CircularBufferSpec").__name__)


@pytest.fixture
def counts(kvguard_log):
    """(vLLM's count, the wrapped count, the model's) under the plugin (``warmup`` patch)."""
    from vllm_kvguard import activation
    from vllm_kvguard.fixes.estimation.estimate import warmup_block_count
    from vllm_kvguard.testing.kv_fixtures import accepted

    warmup, original = _vllm_count()
    res = activation.activate({"KVGUARD": "1", "KVGUARD_PATCHES": "warmup"})
    assert res["warmup"].startswith("applied"), res
    wrapped = warmup._reserved_block_count
    assert getattr(wrapped, "__wrapped__", None) is original
    seen = {"answered": 0}

    def count(spec, n, **kw):
        kw = accepted(original, kw)
        want = original(n, spec, **kw)
        assert wrapped(n, spec, **kw) == want
        got = warmup_block_count(n, spec, **kw)
        seen["answered"] += 1
        return want, got

    yield count
    assert seen["answered"] >= EXAMPLES


@SETTINGS
@given(kind=st.sampled_from(SPEC_KINDS), bs=st.sampled_from([1, 2, 4, 8, 16]),
       extra=st.integers(1, 40), mml=st.integers(2, 512), n=st.integers(1, 600),
       k=st.integers(0, 8), enc=st.integers(0, 300), dcp=st.sampled_from([1, 2, 4]),
       cfg_dcp=st.sampled_from([1, 2, 4]))
def test_warmup_count_equals_vllms_own(counts, kind, bs, extra, mml, n, k, enc, dcp, cfg_dcp):
    """vLLM's own warmup count (unwrapped) = the wrapped count = our model, for every spec
    type, DCP passed and DCP configured apart (0.34's row cap binds only then)."""
    from types import SimpleNamespace

    if kind == "ring":
        spec_class("CircularBufferSpec")
    spec = _spec(kind, bs, extra)
    mode = kind.split("-")[1] if kind.startswith("mamba") else "none"
    config = SimpleNamespace(
        parallel_config=SimpleNamespace(decode_context_parallel_size=cfg_dcp),
        cache_config=SimpleNamespace(mamba_cache_mode=mode))
    want, got = counts(spec, n, vllm_config=config, num_lookahead_tokens=k,
                       max_model_len=mml, max_encoder_len=enc, dcp_world_size=dcp)
    assert got == want, (kind, bs, extra, mml, n, k, enc, dcp, cfg_dcp)


def test_warmup_count_takes_dcp_and_the_row_cap():
    """Full attention, block 16, 200 tokens, max_model_len 256, configured DCP 2: vLLM
    0.34 counts 7 blocks at DCP 2 and caps at the 8-entry row when passed DCP 1; a copy
    counting at DCP 1 with no cap (the guard before 0.34) says 13 in both cases."""
    from types import SimpleNamespace

    from vllm_kvguard.fixes.estimation.estimate import warmup_block_count

    warmup, original = _vllm_count()
    if "dcp_world_size" not in __import__("inspect").signature(original).parameters:
        pytest.skip("vLLM's warmup count takes no DCP before 0.34")
    spec = spec_full(16)
    config = SimpleNamespace(parallel_config=SimpleNamespace(decode_context_parallel_size=2))
    kw = dict(vllm_config=config, num_lookahead_tokens=0, max_model_len=256,
              max_encoder_len=0)
    for dcp, want in ((2, 7), (1, 8)):
        assert original(200, spec, dcp_world_size=dcp, **kw) == want
        assert warmup_block_count(200, spec, dcp_world_size=dcp, **kw) == want
    assert reserved_blocks(spec, 200, max_model_len=256).table == 13
