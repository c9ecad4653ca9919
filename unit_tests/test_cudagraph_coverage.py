"""Startup coverage audit and capture completion on real vLLM config and dispatcher objects.

Configs come from ``plan.plan_config``: vLLM's own ``EngineArgs`` + ``_set_cudagraph_sizes``
+ ``resolve_cudagraph_mode_and_sizes`` as on a CUDA GPU. Graph keys are built by the real
V1 ``CudagraphDispatcher`` / V2 ``CudaGraphManager._init_candidates``; nothing is captured.
"""
from __future__ import annotations

import logging
import re

import pytest

pytest.importorskip("vllm")

from vllm_kvguard.fixes.cudagraph import coverage, graph_owners, planner  # noqa: E402
from vllm_kvguard.patches import cudagraph  # noqa: E402
from vllm_kvguard.flags import read_flags  # noqa: E402
from vllm_kvguard.tools.plan import cudagraph as planning  # noqa: E402
from vllm_kvguard.tools.truth_table import record_defect  # noqa: E402

from vllm_kvguard.testing.cg_fixtures import NGRAM3, RUNNERS, requires_v1, real_v2_manager, vllm_logging_configured, plan  # noqa: E402,F401  (fixture: autouse)



from vllm.config import CompilationConfig  # noqa: E402

SPLIT = "decode_cudagraph_capture_request_sizes" in CompilationConfig.__dataclass_fields__
#: The setting that covers the worked example, in the installed vLLM's own terms.
WORKED_FIX = ({"max_decode_cudagraph_capture_requests": 256} if SPLIT
              else {"max_cudagraph_capture_size": 1024})
WORKED_FIX_TEXT = ", ".join(f"{k}={v}" for k, v in WORKED_FIX.items())


def gaps(row) -> str:
    return row.uncovered_ranges() if row.first_gap is not None else "no"


@pytest.fixture(scope="module")
def worked_v1():
    """The worked example: max_num_seqs=256, k=3, default capture sizes (max 512)."""
    return plan()


@pytest.mark.parametrize("runner", RUNNERS)
def test_worked_example_uncovered_129_to_256(runner):
    vc = plan(runner)
    cov = planner.audit(planning.plan_owner(vc, runner))
    row = cov.row(q=4)
    ceiling = vc.compilation_config.max_cudagraph_capture_size
    gap = (f"{runner}, k=3, max_num_seqs=256, default sizes: capture max {ceiling} tokens, "
           f"widest decode {row.family.hi * 4}; decodes of "
           f"{gaps(row)} requests uncovered"
           + (f" ({row.gap_mode})" if row.first_gap is not None else ""))
    record_defect("cudagraph", "vllm#27325", present=row.first_gap is not None, detail=gap)
    record_defect("cudagraph", "vllm#50488", present=row.covered < row.family.hi, detail=gap)
    assert vc.compilation_config.max_cudagraph_capture_size == 512
    assert (row.family.lo, row.family.hi) == (1, 256)
    assert row.covered == 128 and row.first_gap == 129 and row.gap_mode == "NONE"
    assert row.uncovered_ranges() == "129-256"
    assert row.reason == "over_max_capture_size"
    assert WORKED_FIX_TEXT in row.fix
    table = coverage.format_table(cov)
    assert "129-256" in table and "129 reqs (516 tok)" in table


@pytest.mark.parametrize("runner", RUNNERS)
def test_suggested_setting_covers_the_gap(runner):
    """The fix names a setting; vLLM's own sizing with that setting covers every shape."""
    row = planner.audit(planning.plan_owner(plan(runner), runner)).row(q=4)
    assert row.fix_setting == WORKED_FIX
    vc = plan(runner, compilation_config=row.fix_setting)
    fixed = planner.audit(planning.plan_owner(vc, runner)).row(q=4)
    assert fixed.ok and fixed.covered == 256


@pytest.mark.skipif(SPLIT, reason="0.34 sizes decode graphs in requests: a bare max of "
                                   "900 tokens covers 300 requests at q=3")
def test_suggestion_when_no_bare_max_covers():
    """q=3 (k=2), 300 requests: the widest decode is 900 tokens, but vLLM truncates a max
    of 900 to its 16-step grid (896, vllm#54933) and FULL decode keys stop at 900, so no
    bare max covers 300 requests: the verified fix is an explicit list."""
    k2 = {**NGRAM3, "num_speculative_tokens": 2}
    vc = plan(max_num_seqs=300, speculative_config=k2)
    row = planner.audit(planning.plan_owner(vc)).row(q=3)
    assert row.first_gap is not None
    for bare in (900, 912):
        vc = plan(max_num_seqs=300, speculative_config=k2,
                  compilation_config={"max_cudagraph_capture_size": bare})
        assert not planner.audit(planning.plan_owner(vc)).row(q=3).ok
    assert set(row.fix_setting) == {"cudagraph_capture_sizes"}
    assert "cudagraph_capture_sizes=" in row.fix
    vc = plan(max_num_seqs=300, speculative_config=k2, compilation_config=row.fix_setting)
    assert planner.audit(planning.plan_owner(vc)).row(q=3).ok


@pytest.mark.parametrize("runner", RUNNERS)
def test_explicit_max_is_truncated_below_the_widest_decode(runner):
    """vllm#54933's own example: k=6 (a 7-token verify), max_num_seqs=6 and an explicit
    max_cudagraph_capture_size=42 = 6 x 7. vLLM truncates 42 to its grid (40; V1 then to
    its multiples of 7: 35), so the 6-request verify has no graph and runs eager."""
    k6 = {**NGRAM3, "num_speculative_tokens": 6}
    vc = plan(runner, max_num_seqs=6, speculative_config=k6,
              compilation_config={"max_cudagraph_capture_size": 42})
    resolved = vc.compilation_config.max_cudagraph_capture_size
    row = planner.audit(planning.plan_owner(vc, runner)).row(q=7)
    record_defect("cudagraph", "vllm#54933", present=resolved < 42 and row.first_gap is not None,
                  detail=f"{runner}, k=6, max_num_seqs=6, max_cudagraph_capture_size=42 -> "
                         f"{resolved}; decodes of {gaps(row)} requests "
                         f"uncovered")
    assert row.family.hi == 6
    assert (row.first_gap is not None) == (resolved < 42)
    if row.first_gap is not None:
        assert row.uncovered_ranges() == "6" and row.reason == "over_max_capture_size"
        assert row.gap_mode == "NONE"
        fixed = plan(runner, max_num_seqs=6, speculative_config=k6,
                     compilation_config=row.fix_setting)
        assert planner.audit(planning.plan_owner(fixed, runner)).row(q=7).ok


@pytest.mark.parametrize("runner", RUNNERS)
def test_max_num_seqs_off_the_grid_without_speculation(runner):
    """vllm#57355: no speculation, FULL_AND_PIECEWISE, max_num_seqs=250 (not a multiple of
    8). Where vLLM sizes FULL decode graphs up to its grid below 250 (248), decodes of
    249-250 requests pad to a size with no FULL graph and run PIECEWISE."""
    vc = plan(runner, mode="FULL_AND_PIECEWISE", max_num_seqs=250, speculative_config=None)
    row = planner.audit(planning.plan_owner(vc, runner)).row(q=1)
    record_defect("cudagraph", "vllm#57355", present=row.first_gap is not None,
                  detail=f"{runner}, max_num_seqs=250, no spec: decodes of "
                         f"{gaps(row)} requests without a FULL graph"
                         + (f" ({row.gap_mode})" if row.first_gap is not None else ""))
    assert row.family.hi == 250
    if row.first_gap is not None:
        assert row.uncovered_ranges() == "249-250" and row.gap_mode == "PIECEWISE"
    else:
        assert row.ok and row.covered == 250


def test_vllm_itself_does_not_warn_about_the_gap():
    """vllm#51509 (warn when decode batches are not covered): building the worked example's
    config and graph keys as vLLM does (sizing, mode resolution, dispatcher keys; capture
    itself needs a GPU) logs no vLLM warning about graphs, though 129-256 are uncovered."""
    class Collect(logging.Handler):
        def __init__(self):
            super().__init__(logging.WARNING)
            self.messages = []

        def emit(self, record):
            self.messages.append(record.getMessage())

    handler, vllm_logger = Collect(), logging.getLogger("vllm")
    vllm_logger.addHandler(handler)
    try:
        vc = plan()
        row = planner.audit(planning.plan_owner(vc)).row(q=4)
    finally:
        vllm_logger.removeHandler(handler)
    about = [m for m in handler.messages if re.search(r"graph|captur", m, re.IGNORECASE)]
    record_defect("cudagraph", "vllm#51509", present=row.first_gap is not None and not about,
                  detail=f"decodes of {gaps(row)} requests uncovered; "
                         f"{len(about)} vLLM warning(s) about graphs"
                         + (f": {about[0][:80]}" if about else ""))
    assert row.first_gap == 129


@pytest.mark.parametrize("runner", RUNNERS)
def test_completion_covers_worked_example(runner):
    vc = plan(runner)
    result = planner.complete(planning.PlanRunner(vc, runner), None)
    assert not result.skipped
    if SPLIT:        # request counts, vLLM 0.34's own grid (16 apart from 128)
        assert result.added == [144, 160, 176, 192, 208, 224, 240, 256]
        assert vc.compilation_config.decode_cudagraph_capture_request_sizes[-1] == 256
    else:
        assert result.added[0] == 136 * 4 and result.added[-1] == 1024
    assert result.extra_graphs > 0
    assert vc.compilation_config.max_cudagraph_capture_size == 1024
    cov = planner.audit(planning.plan_owner(vc, runner))
    assert cov.row(q=4).ok and cov.row(q=4).covered == 256
    assert cov.graphs == result.graphs_after


def test_completion_skips_when_every_shape_is_covered():
    vc = plan(max_num_seqs=64)                      # 64 x 4 = 256 <= 512
    before = list(vc.compilation_config.cudagraph_capture_sizes)
    result = planner.complete(planning.PlanRunner(vc, planning.default_runner()), None)
    assert result.skipped.startswith("every reachable")
    assert result.extra_graphs == 0
    assert vc.compilation_config.cudagraph_capture_sizes == before


def test_completion_keeps_an_explicit_list_unless_forced():
    field = "decode_cudagraph_capture_request_sizes" if SPLIT else "cudagraph_capture_sizes"
    sizes = [1, 2, 4, 8, 16, 32] if SPLIT else [4, 8, 16, 32, 64, 128]
    vc = plan(compilation_config={field: sizes})
    result = planner.complete(planning.PlanRunner(vc, planning.default_runner()), None)
    assert "explicitly" in result.skipped
    assert getattr(vc.compilation_config, field) == sizes
    forced = planner.complete(planning.PlanRunner(vc, planning.default_runner()), None,
                              force=True)
    assert not forced.skipped and forced.extra_graphs > 0
    assert planner.audit(planning.plan_owner(vc)).row(q=4).ok


def test_bare_max_is_not_an_explicit_list():
    """A user max (vllm#54933 style) derives the list: completion may extend it."""
    vc = plan(compilation_config={"max_cudagraph_capture_size": 256})
    assert not planner.explicit_sizes(vc, v2=False)
    if SPLIT:        # and 0.34's own ceiling in requests
        vc = plan(compilation_config={"max_decode_cudagraph_capture_requests": 64})
        assert not planner.explicit_sizes(vc, v2=True)


def test_kv_capacity_bounds_reachable_shapes():
    """Shapes the KV cache can never hold are not reported as gaps."""
    vc = plan()
    owner = planning.plan_owner(vc)
    cov = planner.audit(owner, kv_decodes=100)
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
    row = planner.audit(planning.plan_owner(vc)).row(q=4)
    assert row.family.hi == 100 and row.family.limit.startswith("token budget")


def test_zero_draft_steps_are_a_family_for_ngram():
    vc = plan()
    row = planner.audit(planning.plan_owner(vc)).row(q=1)
    assert row.family.no_draft
    assert row.gap_mode == "NONE" and "FULL_AND_PIECEWISE" in row.fix   # V1 FULL_DECODE_ONLY


def test_eager_config_has_nothing_to_cover():
    vc = plan(mode="FULL_DECODE_ONLY")
    vc.compilation_config.cudagraph_mode = vc.compilation_config.cudagraph_mode.NONE
    owner = planning.plan_owner(vc)
    cov = planner.audit(owner)
    assert cov.rows == [] and cov.ok
    assert "nothing to cover" in coverage.format_table(cov)


def test_v2_probe_matches_the_real_constructor(mocker):
    """``v2_probe`` builds the manager without ``__init__``; it must equal the real one."""
    vc = plan("v2", mode="FULL_AND_PIECEWISE")
    mode = vc.compilation_config.cudagraph_mode
    real = real_v2_manager(vc, mode, 4, mocker)
    probe = graph_owners.v2_probe(vc, mode, 4).obj
    assert real._candidates == probe._candidates
    assert real._capture_descs == probe._capture_descs
    assert getattr(real, "_decode_descs", None) == getattr(probe, "_decode_descs", None)
    for n in (1, 100, 128, 129, 256):
        real._graphs_captured = True
        assert graph_owners.V2Owner(real, vc).probe(n, 4) == graph_owners.V2Owner(probe, vc).probe(n, 4)


def test_hook_completes_only_outside_profiling(monkeypatch, kvguard_log):
    monkeypatch.setenv("KVGUARD_CUDAGRAPH_COMPLETE", "1")
    hooks = cudagraph.build_fixes(read_flags())["coverage"]
    vc = plan()
    runner = planning.PlanRunner(vc, planning.default_runner())
    hooks.kvguard_cudagraph_before_kv_init(runner=runner, kv_cache_config=None,
                                              is_profiling=True)
    assert vc.compilation_config.max_cudagraph_capture_size == 512
    hooks.kvguard_cudagraph_before_kv_init(runner=runner, kv_cache_config=None,
                                              is_profiling=False)
    assert vc.compilation_config.max_cudagraph_capture_size == 1024
    lines = [m for m in kvguard_log.lines() if "KVGUARD_CUDAGRAPH_COMPLETE" in m]
    extra = "8 extra CUDA graphs" if SPLIT else "16 extra CUDA graphs"
    assert len(lines) == 1 and extra in lines[0]
    if SPLIT:       # set in 0.34's own terms: decode request sizes
        cc = vc.compilation_config
        assert "(requests)" in lines[0] and cc.max_decode_cudagraph_capture_requests == 256
        assert cc.decode_cudagraph_capture_request_sizes[-1] == 256


def test_hook_does_nothing_without_the_flag(monkeypatch):
    monkeypatch.delenv("KVGUARD_CUDAGRAPH_COMPLETE", raising=False)
    hooks = cudagraph.build_fixes(read_flags())["coverage"]
    vc = plan()
    hooks.kvguard_cudagraph_before_kv_init(runner=planning.PlanRunner(vc, None),
                                           kv_cache_config=None, is_profiling=False)
    assert vc.compilation_config.max_cudagraph_capture_size == 512


def test_audit_hook_logs_one_table(kvguard_log):
    vc = plan()

    owner = planning.plan_owner(vc)

    class Runner:                         # the attributes the hook reads from a model runner
        vllm_config = vc
        cudagraph_dispatcher = owner.obj if owner.kind == "V1" else None
        cudagraph_manager = owner.obj if owner.kind == "V2" else None

    cudagraph.build_fixes()["coverage"].kvguard_cudagraph_after_kv_init(
        runner=Runner(), kv_cache_config=None, is_profiling=False)
    tables = [r for r in kvguard_log.records if "CUDA-graph coverage" in r.getMessage()]
    assert len(tables) == 1 and tables[0].levelno == logging.WARNING
    assert "129-256" in tables[0].getMessage()
    assert coverage.last_audit().row(q=4).first_gap == 129


@requires_v1
def test_lora_cases_are_families():
    vc = plan(enable_lora=True, max_loras=2, max_lora_rank=8)
    cov = planner.audit(planning.plan_owner(vc))
    loras = sorted({r.family.lora for r in cov.rows})
    assert loras[0] == 0 and len(loras) > 1
    assert all(r.first_gap == 129 for r in cov.rows if r.family.q == 4)


@requires_v1
def test_lora_without_specialization_leaves_adapterless_decodes_eager():
    """Found by the audit (V1): with cudagraph_specialize_lora off, graphs are captured
    only for the LoRA case, so a decode batch with no active adapter runs eager."""
    vc = plan(max_num_seqs=64, speculative_config=None, enable_lora=True, max_loras=2,
              max_lora_rank=8, compilation_config={"cudagraph_specialize_lora": False})
    cov = planner.audit(planning.plan_owner(vc))
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
