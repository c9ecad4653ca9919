"""The spec-aware capacity report against a REAL KVCacheManager: per-request peak blocks
and the true maximum concurrency are what the allocator actually holds and admits."""
from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from vllm_kvguard.fixes.estimation import capacity  # noqa: E402
from vllm_kvguard.testing.estimate_fixtures import (allocate, held, make_manager,  # noqa: E402
                                                    make_request, spec_chunked, spec_class,
                                                    spec_full, spec_mamba, spec_swa)
from vllm_kvguard.testing.kv_fixtures import kv_cache_config as make_kv_cache_config  # noqa: E402
from vllm_kvguard.testing.kv_fixtures import used_blocks  # noqa: E402
from vllm_kvguard.tools.truth_table import record_defect  # noqa: E402


def make_config(*, mml: int, k: int = 0, lookahead: int | None = None, max_num_seqs: int = 256,
                mode: str = "none", batched: int = 8192, full_graphs: bool | None = None):
    spec_cfg = None
    if k:
        la = k if lookahead is None else lookahead
        spec_cfg = SimpleNamespace(num_speculative_tokens=k, use_eagle=lambda: la > 0,
                                   uses_draft_model=lambda: False)
    mode_obj = None
    if full_graphs is not None:
        mode_obj = SimpleNamespace(has_full_cudagraphs=lambda: full_graphs)
    return SimpleNamespace(
        model_config=SimpleNamespace(max_model_len=mml),
        scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs,
                                         max_num_batched_tokens=batched,
                                         enable_chunked_prefill=True,
                                         max_num_encoder_input_tokens=0),
        cache_config=SimpleNamespace(mamba_cache_mode=mode),
        parallel_config=SimpleNamespace(decode_context_parallel_size=1),
        speculative_config=spec_cfg, max_in_flight_tokens=batched,
        compilation_config=SimpleNamespace(cudagraph_mode=mode_obj))


def drive_to_max_len(manager, rid: str, *, mml: int, prompt: int, step: int, k: int,
                     groups: int, first: int = 0) -> list[int]:
    """Prefill ``prompt`` (``first`` tokens, then the rest in one chunk, as a busy token
    budget may cut it) then decode ``step`` tokens at a time to ``mml``; peak per group."""
    req = make_request(rid, prompt)
    peak = [0] * groups
    computed, q = 0, first or prompt
    if first:
        assert allocate(manager, req, first, k=k) is not None
        computed, q = first, prompt - first
        req.num_computed_tokens = computed
    while computed < mml:
        q = min(q, mml - computed)
        assert allocate(manager, req, q, k=k) is not None
        peak = [max(p, held(manager, rid, g).physical) for g, p in enumerate(peak)]
        computed += q
        req.num_computed_tokens = computed
        q = step
    return peak


@pytest.mark.parametrize("mode,k,lookahead", [("none", 3, 0), ("none", 2, 2), ("align", 3, 3),
                                              ("none", 0, 0)])
def test_per_request_blocks_match_the_allocator(mode, k, lookahead):
    """Mamba align (Mamba2's prefill checkpoint) peaks on a last prefill chunk that starts
    past the first block: its running state, the state it starts from, the checkpoint."""
    mml = 128
    specs = [spec_full(16), spec_mamba(16 if mode == "align" else mml, mode, k)]
    cfg = make_config(mml=mml, k=k, lookahead=lookahead, mode=mode)
    kvc = make_kv_cache_config(specs, num_blocks=200)
    cap = capacity.compute(cfg, kvc)
    manager = make_manager(specs, 200, mml)
    prompt, first = (mml - 8, 16) if mode == "align" else (40, 0)
    peak = drive_to_max_len(manager, "r", mml=mml, prompt=prompt, step=1 + k, k=lookahead,
                            groups=2, first=first)
    assert [g.spec for g in cap.groups] == peak
    assert cap.per_request_spec == sum(peak)
    if k:
        assert cap.per_request_spec > cap.per_request_plain


def test_true_max_concurrency_is_what_the_allocator_admits():
    """Fill a real manager with requests at max_model_len: it admits exactly
    floor(true concurrency) = 3; vLLM's own figure counts the null block and says 4.00x."""
    mml, k = 64, 3
    specs = [spec_full(16), spec_mamba(mml, "none", k)]
    num_blocks = 32
    cfg = make_config(mml=mml, k=k, lookahead=0)
    cap = capacity.compute(cfg, make_kv_cache_config(specs, num_blocks))
    assert cap.per_request_spec == 4 + (1 + k)
    manager = make_manager(specs, num_blocks, mml)
    admitted = 0
    while True:
        req = make_request(f"r{admitted}", mml)
        if allocate(manager, req, mml) is None:
            break
        admitted += 1
    record_defect("warmup", "max-concurrency-counts-null-block",
                  present=int(cap.vllm_concurrency) > admitted,
                  detail=f"vLLM {cap.vllm_concurrency:.2f}x, allocator admits {admitted}")
    assert admitted == int(cap.true_concurrency) == 31 // 8 == 3
    assert used_blocks(manager) == admitted * cap.per_request_spec
    assert cap.vllm_concurrency is not None and cap.vllm_concurrency == pytest.approx(32 / 8)


@settings(max_examples=150, deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
@given(st.sampled_from(["SlidingWindowSpec", "ChunkedLocalAttentionSpec"]),
       st.sampled_from([2, 4, 8, 16]), st.integers(8, 160), st.integers(1, 48),
       st.data())
def test_windowed_peak_covers_every_prompt_length(kind, bs, mml, window, data):
    """Sliding-window / chunked-local groups free blocks as they go: the report's peak must
    cover the worst the allocator holds for any prompt length and chunking."""
    spec_class(kind)
    spec = (spec_swa(bs, window) if kind == "SlidingWindowSpec"
            else spec_chunked(bs, window))
    chunk = data.draw(st.integers(1, mml))
    k = data.draw(st.integers(0, 4))
    prompt = data.draw(st.integers(1, mml))
    manager = make_manager([spec], 4 * mml + 64, mml)
    req = make_request("r", prompt)
    computed, peak, q = 0, 0, min(chunk, prompt)
    while computed < mml:
        q = min(q, mml - computed)
        assert allocate(manager, req, q, k=k) is not None
        peak = max(peak, held(manager, "r").physical)
        computed += q
        req.num_computed_tokens = computed
        q = min(chunk, prompt - computed) if computed < prompt else 1 + k
    est = capacity.peak_blocks(spec, max_model_len=mml, step=1 + k, chunk=chunk, lookahead=k)
    assert est >= peak
    assert est <= -(-mml // bs)


@settings(max_examples=150, deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
@given(st.sampled_from([1, 2, 4, 8, 16]), st.integers(8, 160), st.integers(0, 3),
       st.sampled_from([None, 1, 2]), st.sampled_from([None, 0]), st.booleans(), st.data())
def test_mamba_align_peak_covers_every_prompt_length(bs, mml, nsb, checkpoint, retention,
                                                     lagged, data):
    """Mamba align: the report's peak covers the worst the allocator holds for any prompt
    length and chunking, prefill checkpoints (dense and sparse retention) and the async
    scheduler's step in flight included."""
    from vllm_kvguard.fixes.estimation.schedule import checkpointing
    from vllm_kvguard.testing.estimate_fixtures import lag_reason

    lagged = lagged and lag_reason() is None
    spec = spec_mamba(bs, "align", nsb, checkpoint)
    chunk = max(bs, data.draw(st.integers(1, mml)) // bs * bs)
    prompt = data.draw(st.integers(1, mml))
    manager = make_manager([spec], 4 * mml + 64, mml, retention=retention)
    req = make_request("r", prompt)
    computed, previous, peak = 0, 0, 0
    while computed < mml:
        q = min(chunk, prompt - computed) if computed < prompt else 1 + nsb
        q = min(q, mml - computed)
        req.num_in_flight_tokens = previous if lagged else 0
        assert allocate(manager, req, q) is not None
        peak = max(peak, held(manager, "r").physical)
        computed, previous = computed + q, q
        req.num_computed_tokens = computed
    est = capacity.peak_blocks(spec, max_model_len=mml, step=1 + nsb, chunk=chunk,
                               lookahead=0, lagged=lagged,
                               checkpointing=checkpointing(manager).get(0))
    assert peak <= est <= nsb + 5


def test_mamba_full_decode_warning_names_the_numbers(kvguard_log):
    """256 sequences, 257 blocks, Mamba align with 3 speculative
    blocks: vLLM's check passes, but at most 51 decodes fit (Mamba alone: 256 // 5)."""
    cfg = make_config(mml=4096, k=3, mode="align", max_num_seqs=256, full_graphs=True)
    kvc = make_kv_cache_config([spec_mamba(16, "align", 3)], 257)
    lines = capacity.kvguard_startup_report(vllm_config=cfg, kv_cache_config=kvc,
                                            scheduler=None)
    cap = capacity.last_report()
    assert cap.decode_blocks == 5 and cap.decodes_that_fit == 51
    warnings = kvguard_log.lines(logging.WARNING)
    assert any("max_num_seqs=256" in w and "at most 51" in w and "--max-num-seqs to 51" in w
               for w in warnings), warnings
    assert any("Mamba decode: 51 of max_num_seqs=256" in line for line in lines)


def test_report_lines_are_parseable():
    mml = 128
    cfg = make_config(mml=mml, k=3, lookahead=0)
    kvc = make_kv_cache_config([spec_full(16), spec_mamba(mml, "none", 3)], 100)
    lines = capacity.kvguard_startup_report(vllm_config=cfg, kv_cache_config=kvc,
                                            scheduler=None)
    text = "\n".join(lines)
    assert "group 0 FullAttentionSpec block_size=16: peak blocks/request at max_model_len " \
           "plain=8 spec=8; held decoding at max_model_len=8" in text
    assert "group 1 MambaSpec(none, nsb=3) block_size=128: peak blocks/request at " \
           "max_model_len plain=1 spec=4; held decoding at max_model_len=4" in text
    assert "per request: peak plain=9 spec=12; blocks to admit one max_model_len request=12" \
           in text
    assert "true max concurrency=8 max_model_len requests at once (1 + (99 - 12) // 12)" in text


# ------------------------------------------------------------------ cost: once per KV config
def _counting(monkeypatch, name: str) -> list:
    calls: list = []
    real = getattr(capacity, name)

    def counted(*args, **kwargs):
        calls.append(args[1])
        return real(*args, **kwargs)

    monkeypatch.setattr(capacity, name, counted)
    return calls


def test_figures_are_computed_once_per_kv_configuration(monkeypatch):
    """A second Scheduler with the same KV configuration (any pool size) reuses the
    per-group figures; another max_model_len computes them again."""
    capacity.clear_cache()
    calls = _counting(monkeypatch, "reserved_blocks")
    cfg = make_config(mml=256, k=2, lookahead=2)
    first = capacity.compute(cfg, make_kv_cache_config([spec_full(16), spec_swa(16, 64)], 100))
    n = len(calls)
    assert n > 0
    again = capacity.compute(cfg, make_kv_cache_config([spec_full(16), spec_swa(16, 64)], 500))
    assert len(calls) == n
    assert [(g.plain, g.spec, g.decode) for g in again.groups] == \
           [(g.plain, g.spec, g.decode) for g in first.groups]
    assert (first.num_blocks, again.num_blocks) == (100, 500)
    assert again.true_concurrency > first.true_concurrency
    capacity.compute(make_config(mml=512, k=2, lookahead=2),
                     make_kv_cache_config([spec_full(16), spec_swa(16, 64)], 100))
    assert len(calls) > n


def test_no_speculation_scans_once():
    """Without drafts or lookahead the plain and the speculative peak are the same pass."""
    capacity.clear_cache()
    cfg = make_config(mml=128)
    cap = capacity.compute(cfg, make_kv_cache_config([spec_full(16)], 100))
    assert [(g.plain, g.spec) for g in cap.groups] == [(8, 8)]


def test_our_estimate_registered_is_called_directly(monkeypatch):
    """With only our own kvguard_reserved_blocks registered (activation), the loops call
    reserved_blocks itself, not the pluggy hook."""
    from vllm_kvguard import manager
    from vllm_kvguard.fixes.estimation import estimate

    capacity.clear_cache()
    manager.register(estimate, "kvguard.estimate")
    try:
        def through_pluggy(*_a, **_k):
            raise AssertionError("the hook path was used")

        monkeypatch.setattr(capacity, "reserved", through_pluggy)
        cap = capacity.compute(make_config(mml=128, k=3, lookahead=0),
                               make_kv_cache_config([spec_full(16)], 100))
        assert cap.groups[0].spec == 8
    finally:
        manager.unregister("kvguard.estimate")


def test_a_third_party_estimate_answers_and_is_not_cached():
    from vllm_kvguard import manager
    from vllm_kvguard.fixes.estimation.estimate import Reserved
    from vllm_kvguard.hookspecs import hookimpl

    class Mine:
        @hookimpl
        def kvguard_reserved_blocks(self, spec, num_tokens):
            return Reserved(7, 7)

    capacity.clear_cache()
    cfg = make_config(mml=128)
    kvc = make_kv_cache_config([spec_full(16)], 100)
    manager.register(Mine(), "test.mine")
    try:
        cap = capacity.compute(cfg, kvc)
        assert [(g.plain, g.spec, g.decode) for g in cap.groups] == [(7, 7, 7)]
    finally:
        manager.unregister("test.mine")
    cap = capacity.compute(cfg, kvc)
    assert [(g.plain, g.spec, g.decode) for g in cap.groups] == [(8, 8, 1)]
