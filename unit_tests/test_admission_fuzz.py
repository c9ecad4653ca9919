"""The admission certificate equals the REAL allocator, fuzzed over specs and pool sizes.

One to three KV-cache groups (full attention, sliding window, chunked local, Mamba
none/all/align with speculative blocks) on one shared pool, a lookahead, a
``max_model_len`` and a pool size drawn by hypothesis. The certificate's ``decode_limit``
is a claim about the least a request can hold: a request that decodes one token per step
(the path that frees the most: every earlier token computed) must allocate every step up
to ``decode_limit`` computed tokens on an empty pool and must fail at the next one. (What
the scheduler admits is proven on the real Scheduler: test_admission_scheduler.py.)
"""
from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from vllm_kvguard import activation  # noqa: E402
from vllm_kvguard.fixes.estimation.certificate import Certificate, Schedule  # noqa: E402
from vllm_kvguard.testing.estimate_fixtures import (allocate, make_manager,  # noqa: E402
                                                    make_request, spec_chunked, spec_class,
                                                    spec_full, spec_mamba, spec_swa)

KINDS = ("full", "swa", "chunked", "mamba_none", "mamba_all", "mamba_align")


def build(kind: str, bs: int, extra: int, nsb: int):
    if kind == "full":
        return spec_full(bs)
    if kind == "swa":
        spec_class("SlidingWindowSpec")
        return spec_swa(bs, extra)
    if kind == "chunked":
        spec_class("ChunkedLocalAttentionSpec")
        return spec_chunked(bs, extra)
    return spec_mamba(bs, kind.split("_")[1], nsb)


@st.composite
def engines(draw):
    bs = draw(st.sampled_from([2, 4, 8, 16]))
    kinds = draw(st.lists(st.sampled_from(KINDS), min_size=1, max_size=3))
    groups = [(kind, draw(st.integers(1, 40)), draw(st.integers(0, 3))) for kind in kinds]
    mml = draw(st.integers(2, 96))
    k = draw(st.sampled_from([0, 0, 1, 3]))
    return dict(bs=bs, groups=groups, mml=mml, k=k, spare=draw(st.integers(-3, 3)))


@settings(max_examples=120, deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
@given(engines())
def test_the_certificate_is_what_the_allocator_admits(e):
    activation.activate({"KVGUARD": "1", "KVGUARD_PATCHES": "none"})
    specs = [build(kind, e["bs"], extra, nsb) for kind, extra, nsb in e["groups"]]
    mml, k = e["mml"], e["k"]
    full = Certificate(groups=tuple(enumerate(specs)), usable=1 << 20, max_model_len=mml,
                       schedule=Schedule(budget=1), lookahead=k)
    # a pool around what a request of a random length needs, so both outcomes occur
    num_blocks = max(2, full.decode_need(max(1, mml // 2)) + 1 + e["spare"])
    cert = Certificate(groups=tuple(enumerate(specs)), usable=num_blocks - 1,
                       max_model_len=mml, schedule=Schedule(budget=1), lookahead=k)
    manager = make_manager(specs, num_blocks=num_blocks, max_model_len=mml)
    req = make_request("r", 1)
    largest = cert.decode_limit
    computed = 0
    while computed < mml:
        ok = allocate(manager, req, 1, k=k) is not None
        if computed + 1 <= largest:
            assert ok, f"certificate {largest} but step {computed + 1} failed: {e}"
        else:
            assert not ok, f"certificate {largest} but step {computed + 1} fit: {e}"
            break
        computed += 1
        req.num_computed_tokens = computed
        req.append_output_token_ids(7)
    assert computed == largest, (computed, largest, e)
