"""A startup warning fires only when something is wrong or will go wrong; vLLM missing is
one line."""
from __future__ import annotations

import logging

import pytest

from vllm_kvguard import activation, versions

ON = {"KVGUARD": "1"}


def test_missing_vllm_is_one_line(monkeypatch, kvguard_log):
    monkeypatch.setattr(versions, "vllm_version", lambda: None)
    res = activation.activate(ON)
    assert res and all(r == "skipped: vLLM is not installed" for r in res.values())
    lines = kvguard_log.lines(logging.DEBUG)
    assert lines == ["vllm-kvguard: vLLM is not installed; nothing to patch"], lines
    assert not any("outside" in m for m in lines)


@pytest.mark.requires_patch("warmup")
@pytest.mark.parametrize("num_gpu_blocks", [2048, 2049, 4096])
def test_startup_without_speculation_logs_no_warning(num_gpu_blocks, kvguard_log):
    """A real Scheduler built with the plugin active, no speculative decoding: vLLM counts
    the null block (2048 blocks: vLLM 64.00x, true 63.97x), which is rounding, not a
    problem; the capacity goes to one INFO report and nothing is logged at WARNING."""
    pytest.importorskip("vllm")
    from vllm_kvguard.testing.kv_fixtures import make_scheduler

    assert activation.activate(ON)["warmup"].startswith("applied")
    make_scheduler(num_gpu_blocks=num_gpu_blocks, max_model_len=512, max_num_seqs=8)
    from vllm_kvguard.fixes.estimation import capacity

    cap = capacity.last_report()
    assert cap is not None and cap.num_spec_tokens == 0 and cap.warnings == []
    assert kvguard_log.lines(logging.WARNING) == []
    reports = [m for m in kvguard_log.lines(logging.INFO) if "true max concurrency" in m]
    assert len(reports) == 1


def _cap(num_blocks: int, *, max_num_seqs: int = 8, k: int = 0):
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    from vllm_kvguard.fixes.estimation import capacity
    from vllm_kvguard.testing.estimate_fixtures import spec_full, spec_mamba
    from vllm_kvguard.testing.kv_fixtures import kv_cache_config

    mml = 512
    spec_cfg = None if not k else SimpleNamespace(
        num_speculative_tokens=k, use_eagle=lambda: False, uses_draft_model=lambda: False)
    cfg = SimpleNamespace(
        model_config=SimpleNamespace(max_model_len=mml),
        scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs, max_num_batched_tokens=512,
                                         enable_chunked_prefill=True,
                                         max_num_encoder_input_tokens=0),
        cache_config=SimpleNamespace(mamba_cache_mode="none"),
        parallel_config=SimpleNamespace(decode_context_parallel_size=1),
        speculative_config=spec_cfg, max_in_flight_tokens=512,
        compilation_config=SimpleNamespace(cudagraph_mode=None))
    specs = [spec_full(16)] + ([spec_mamba(mml, "none", k)] if k else [])
    return capacity.compute(cfg, kv_cache_config(specs, num_blocks))


def test_warns_when_fewer_than_max_num_seqs_fit():
    cap = _cap(129, max_num_seqs=8)              # 128 usable / 32 per request = 4 < 8
    assert cap.true_concurrency == 4.0
    assert len(cap.warnings) == 1 and "vLLM reports maximum concurrency" in cap.warnings[0]


@pytest.mark.parametrize("overstated,warns", [(0.5, False), (1.5, True)])
def test_warns_when_vllm_overstates_by_more_than_rounding(overstated, warns, monkeypatch):
    from vllm_kvguard.fixes.estimation import capacity

    true = 4000 / 32                             # 4001 blocks: 125 requests, 125.03x by vLLM
    monkeypatch.setattr(capacity, "_vllm_concurrency", lambda *a: true + overstated)
    cap = _cap(4001, max_num_seqs=8)
    assert cap.true_concurrency == true
    assert len(cap.warnings) == int(warns)


def test_no_warning_for_the_null_block_alone():
    cap = _cap(100 * 32, max_num_seqs=8)         # vLLM 100.00x, true 99.97x
    assert cap.vllm_concurrency == pytest.approx(100.0) and cap.true_concurrency < 100
    assert cap.warnings == []
