"""Startup coverage audit and capture completion on real vLLM config and dispatcher objects.

Configs come from ``coverage.plan_config``: vLLM's own ``EngineArgs`` + ``_set_cudagraph_sizes``
+ ``resolve_cudagraph_mode_and_sizes`` as on a CUDA GPU. Graph keys are built by the real
V1 ``CudagraphDispatcher`` / V2 ``CudaGraphManager._init_candidates``; nothing is captured.
"""
from __future__ import annotations

import logging

import pytest

pytest.importorskip("vllm")

from vllm_kvguard.fixes import coverage  # noqa: E402

from cg_fixtures import NGRAM3, vllm_logging_configured, plan  # noqa: E402,F401  (fixture: autouse)



@pytest.fixture(scope="module")
def worked_v1():
    """The worked example: max_num_seqs=256, k=3, default capture sizes (max 512)."""
    return plan()


@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_worked_example_uncovered_129_to_256(runner):
    vc = plan(runner)
    assert vc.compilation_config.max_cudagraph_capture_size == 512
    cov = coverage.audit(coverage.plan_owner(vc, runner))
    row = cov.row(q=4)
    assert (row.family.lo, row.family.hi) == (1, 256)
    assert row.covered == 128 and row.first_gap == 129 and row.gap_mode == "NONE"
    assert row.uncovered_ranges() == "129-256"
    assert row.reason == "over_max_capture_size"
    assert "max_cudagraph_capture_size=1024" in row.fix
    table = coverage.format_table(cov)
    assert "129-256" in table and "129 reqs (516 tok)" in table


@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_suggested_setting_covers_the_gap(runner):
    """The fix names a setting; vLLM's own sizing with that setting covers every shape."""
    row = coverage.audit(coverage.plan_owner(plan(runner), runner)).row(q=4)
    assert row.fix_setting == {"max_cudagraph_capture_size": 1024}
    vc = plan(runner, compilation_config=row.fix_setting)
    fixed = coverage.audit(coverage.plan_owner(vc, runner)).row(q=4)
    assert fixed.ok and fixed.covered == 256


def test_suggestion_when_no_bare_max_covers():
    """q=3 (k=2), 300 requests: the widest decode is 900 tokens, but vLLM truncates a max
    of 900 to its 16-step grid (896, vllm#54933) and FULL decode keys stop at 900, so no
    bare max covers 300 requests: the verified fix is an explicit list."""
    k2 = {**NGRAM3, "num_speculative_tokens": 2}
    vc = plan(max_num_seqs=300, speculative_config=k2)
    row = coverage.audit(coverage.plan_owner(vc)).row(q=3)
    assert row.first_gap is not None
    for bare in (900, 912):
        vc = plan(max_num_seqs=300, speculative_config=k2,
                  compilation_config={"max_cudagraph_capture_size": bare})
        assert not coverage.audit(coverage.plan_owner(vc)).row(q=3).ok
    assert set(row.fix_setting) == {"cudagraph_capture_sizes"}
    assert "cudagraph_capture_sizes=" in row.fix
    vc = plan(max_num_seqs=300, speculative_config=k2, compilation_config=row.fix_setting)
    assert coverage.audit(coverage.plan_owner(vc)).row(q=3).ok


@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_completion_covers_worked_example(runner):
    vc = plan(runner)
    result = coverage.complete(coverage.PlanRunner(vc, runner), None)
    assert not result.skipped
    assert result.added[0] == 136 * 4 and result.added[-1] == 1024
    assert result.extra_graphs > 0
    assert vc.compilation_config.max_cudagraph_capture_size == 1024
    cov = coverage.audit(coverage.plan_owner(vc, runner))
    assert cov.row(q=4).ok and cov.row(q=4).covered == 256
    assert cov.graphs == result.graphs_after


def test_completion_skips_when_every_shape_is_covered():
    vc = plan(max_num_seqs=64)                      # 64 x 4 = 256 <= 512
    before = list(vc.compilation_config.cudagraph_capture_sizes)
    result = coverage.complete(coverage.PlanRunner(vc, "v1"), None)
    assert result.skipped.startswith("every reachable")
    assert result.extra_graphs == 0
    assert vc.compilation_config.cudagraph_capture_sizes == before


def test_completion_keeps_an_explicit_list_unless_forced():
    sizes = [4, 8, 16, 32, 64, 128]
    vc = plan(compilation_config={"cudagraph_capture_sizes": sizes})
    result = coverage.complete(coverage.PlanRunner(vc, "v1"), None)
    assert "explicitly" in result.skipped
    assert vc.compilation_config.cudagraph_capture_sizes == sizes
    forced = coverage.complete(coverage.PlanRunner(vc, "v1"), None, force=True)
    assert not forced.skipped and forced.extra_graphs > 0
    assert coverage.audit(coverage.plan_owner(vc)).row(q=4).ok


def test_bare_max_is_not_an_explicit_list():
    """A user max (vllm#54933 style) derives the list: completion may extend it."""
    vc = plan(compilation_config={"max_cudagraph_capture_size": 256})
    assert not coverage.explicit_sizes(vc, v2=False)


def test_kv_capacity_bounds_reachable_shapes():
    """Shapes the KV cache can never hold are not reported as gaps."""
    vc = plan()
    owner = coverage.plan_owner(vc)
    cov = coverage.audit(owner, kv_decodes=100)
    row = cov.row(q=4)
    assert row.family.hi == 100 and row.family.limit == "KV cache" and row.ok


def test_kv_decodes_from_the_reserved_block_model():
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    vc = plan()
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    kv = KVCacheConfig(num_blocks=101, kv_cache_tensors=[],
                       kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)])
    assert coverage.kv_decodes_of(vc, kv) == 100          # one block per short decode


def test_token_budget_bounds_reachable_shapes():
    vc = plan(max_num_batched_tokens=400)
    row = coverage.audit(coverage.plan_owner(vc)).row(q=4)
    assert row.family.hi == 100 and row.family.limit.startswith("token budget")


def test_zero_draft_steps_are_a_family_for_ngram():
    vc = plan()
    row = coverage.audit(coverage.plan_owner(vc)).row(q=1)
    assert row.family.no_draft
    assert row.gap_mode == "NONE" and "FULL_AND_PIECEWISE" in row.fix   # V1 FULL_DECODE_ONLY


def test_eager_config_has_nothing_to_cover():
    vc = plan(mode="FULL_DECODE_ONLY")
    vc.compilation_config.cudagraph_mode = vc.compilation_config.cudagraph_mode.NONE
    owner = coverage.v1_probe(vc, vc.compilation_config.cudagraph_mode, 4)
    cov = coverage.audit(owner)
    assert cov.rows == [] and cov.ok
    assert "nothing to cover" in coverage.format_table(cov)


def test_v2_probe_matches_the_real_constructor(mocker):
    """``v2_probe`` builds the manager without ``__init__``; it must equal the real one."""
    from vllm.v1.worker.gpu import cudagraph_utils

    vc = plan("v2", mode="FULL_AND_PIECEWISE")
    pp = mocker.Mock(is_first_rank=True, is_last_rank=True)
    mocker.patch.object(cudagraph_utils, "get_pp_group", return_value=pp)  # torch.distributed
    mocker.patch.object(cudagraph_utils.current_platform, "get_global_graph_pool",
                        return_value=None, create=True)                     # needs a GPU
    mode = vc.compilation_config.cudagraph_mode
    real = cudagraph_utils.CudaGraphManager(vc, None, mode, 4)
    probe = coverage.v2_probe(vc, mode, 4).obj
    assert real._candidates == probe._candidates
    assert real._capture_descs == probe._capture_descs
    for n in (1, 100, 128, 129, 256):
        real._graphs_captured = True
        assert coverage.V2Owner(real, vc).probe(n, 4) == coverage.V2Owner(probe, vc).probe(n, 4)


def test_hook_completes_only_outside_profiling(monkeypatch, kvguard_log):
    monkeypatch.setenv("KVGUARD_CUDAGRAPH_COMPLETE", "1")
    vc = plan()
    runner = coverage.PlanRunner(vc, "v1")
    coverage.kvguard_cudagraph_before_kv_init(runner=runner, kv_cache_config=None,
                                              is_profiling=True)
    assert vc.compilation_config.max_cudagraph_capture_size == 512
    coverage.kvguard_cudagraph_before_kv_init(runner=runner, kv_cache_config=None,
                                              is_profiling=False)
    assert vc.compilation_config.max_cudagraph_capture_size == 1024
    lines = [m for m in kvguard_log.lines() if "KVGUARD_CUDAGRAPH_COMPLETE" in m]
    assert len(lines) == 1 and "16 extra CUDA graphs" in lines[0]


def test_hook_does_nothing_without_the_flag(monkeypatch):
    monkeypatch.delenv("KVGUARD_CUDAGRAPH_COMPLETE", raising=False)
    vc = plan()
    coverage.kvguard_cudagraph_before_kv_init(runner=coverage.PlanRunner(vc, "v1"),
                                              kv_cache_config=None, is_profiling=False)
    assert vc.compilation_config.max_cudagraph_capture_size == 512


def test_audit_hook_logs_one_table(kvguard_log):
    vc = plan()

    class Runner:                         # the attributes the hook reads from a model runner
        vllm_config = vc
        cudagraph_dispatcher = coverage.plan_owner(vc).obj

    coverage.kvguard_cudagraph_after_kv_init(runner=Runner(), kv_cache_config=None,
                                             is_profiling=False)
    tables = [r for r in kvguard_log.records if "CUDA-graph coverage" in r.getMessage()]
    assert len(tables) == 1 and tables[0].levelno == logging.WARNING
    assert "129-256" in tables[0].getMessage()
    assert coverage.last_audit().row(q=4).first_gap == 129


def test_lora_cases_are_families():
    vc = plan(enable_lora=True, max_loras=2, max_lora_rank=8)
    cov = coverage.audit(coverage.plan_owner(vc))
    loras = sorted({r.family.lora for r in cov.rows})
    assert loras[0] == 0 and len(loras) > 1
    assert all(r.first_gap == 129 for r in cov.rows if r.family.q == 4)


def test_lora_without_specialization_leaves_adapterless_decodes_eager():
    """Found by the audit (V1): with cudagraph_specialize_lora off, graphs are captured
    only for the LoRA case, so a decode batch with no active adapter runs eager."""
    vc = plan(max_num_seqs=64, speculative_config=None, enable_lora=True, max_loras=2,
              max_lora_rank=8, compilation_config={"cudagraph_specialize_lora": False})
    cov = coverage.audit(coverage.plan_owner(vc))
    plain = cov.row(q=1, lora=0)
    assert plain.covered == 0 and plain.reason == "lora"
    assert "cudagraph_specialize_lora=true" in plain.fix
    assert all(r.ok for r in cov.rows if r.family.lora)


# ----------------------------------------------------------------------------- padding target
def test_block_pool_reserves_block_zero():
    from vllm.v1.core.block_pool import BlockPool

    pool = BlockPool(num_gpu_blocks=8, enable_caching=True, hash_block_size=16)
    assert coverage.check_block_pool(pool) == []
    handed = pool.get_new_blocks(7)
    assert all(b.block_id != 0 for b in handed)


def test_block_pool_check_catches_a_free_null_block():
    from vllm.v1.core.block_pool import BlockPool

    pool = BlockPool(num_gpu_blocks=8, enable_caching=True, hash_block_size=16)
    pool.free_block_queue.append(pool.null_block)         # the broken invariant
    assert any("free list" in p for p in coverage.check_block_pool(pool))


def test_worker_padding_ids():
    assert coverage.check_worker_padding() == []
