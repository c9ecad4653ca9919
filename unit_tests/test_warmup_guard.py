"""The V2 warmup guard, driven through vLLM's REAL ``_warmup_kernels`` (``warmup_kernels`` on
0.27.1) with a recording executor: fake ``worker_execute_model``/``worker_sample_tokens``
that record the ``SchedulerOutput``s, and a minimal model-runner stand-in built from real
KV-cache config and spec objects (MRV2 cannot run on CPU).
``torch.accelerator.synchronize`` (GPU only) is mocked.
"""
from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")
W = pytest.importorskip("vllm.v1.worker.gpu.warmup")

from vllm_kvguard import activation, report  # noqa: E402
from vllm_kvguard.fixes.estimation.estimate import reserved_blocks  # noqa: E402
from vllm_kvguard.testing.estimate_fixtures import spec_full, spec_mamba  # noqa: E402
from vllm_kvguard.testing.kv_fixtures import kv_cache_config as make_kv_cache_config  # noqa: E402
from vllm_kvguard.tools.truth_table import record_defect  # noqa: E402

NEW_WARMUP = hasattr(W, "_reserved_block_count")      # 0.32+: the #51438 fix is in


class Connector:
    def __init__(self):
        self.calls = []

    def set_disabled(self, disabled):
        self.calls.append(disabled)


class Zeroer:
    def __init__(self):
        self.zeroed, self.warmed = [], []

    def warmup(self, num_blocks):
        self.warmed.append(num_blocks)

    def zero_block_ids(self, ids):
        self.zeroed.append(list(ids))


class Worker:
    """Records what a worker would receive; tracks registered dummy requests."""

    def __init__(self, fail_on: int | None = None):
        self.outputs, self.registered, self.fail_on = [], set(), fail_on

    def execute(self, so):
        self.outputs.append(so)
        if self.fail_on is not None and len(self.outputs) == self.fail_on:
            self.registered.update(r.req_id for r in so.scheduled_new_reqs)
            raise RuntimeError("injected warmup failure")
        self.registered.update(r.req_id for r in so.scheduled_new_reqs)
        self.registered.difference_update(so.finished_req_ids)

    def sample(self, grammar_output=None):
        return None

    def block_ids(self) -> list[int]:
        ids = []
        for so in self.outputs:
            for nr in so.scheduled_new_reqs:
                ids += [i for g in nr.block_ids for i in g]
            for new in so.scheduled_cached_reqs.new_block_ids or ():
                ids += [i for g in (new or ()) for i in g]
        return ids

    def prefill_blocks(self, group: int) -> int:
        nr = self.outputs[0].scheduled_new_reqs[0]
        return len(nr.block_ids[group])


def make_runner(specs, num_blocks: int, *, k: int, max_model_len: int, max_num_seqs: int = 4,
                dcp: int = 1, kv_cache=None):
    """A model-runner stand-in: what ``_warmup_kernels`` reads, over real spec objects."""
    spec_cfg = SimpleNamespace(num_speculative_tokens=k, use_eagle=lambda: k > 0,
                               uses_draft_model=lambda: False,
                               max_num_new_slots_for_drafting=0) if k else None
    return SimpleNamespace(
        vllm_config=SimpleNamespace(is_mm_encoder_only=False, num_lookahead_tokens=k,
                                    speculative_config=spec_cfg,
                                    parallel_config=SimpleNamespace(
                                        decode_context_parallel_size=dcp)),
        num_speculative_steps=k, decode_query_len=k + 1, is_pooling_model=False,
        kv_cache_config=make_kv_cache_config(specs, num_blocks),
        model_state=SimpleNamespace(max_encoder_len=0), is_encoder_decoder=False,
        scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs,
                                         max_num_batched_tokens=8192),
        block_tables=None, model_config=SimpleNamespace(get_vocab_size=lambda: 1024),
        kv_block_zeroer=Zeroer(), kv_connector=Connector(), is_last_pp_rank=True,
        max_model_len=max_model_len, adaptive_verification=None, rejection_sampler=None,
        # 0.34+: read at the runner, and the extensible KV cache (off here)
        speculative_config=spec_cfg, max_num_tokens=8192, speculator=None,
        extensible_kv_cache=kv_cache)


def run_warmup(runner, worker):
    fn = getattr(W, "_warmup_kernels", None) or W.warmup_kernels
    return fn(runner, worker.execute, worker.sample)


@pytest.fixture(autouse=True)
def no_device_sync(mocker):
    mocker.patch("torch.accelerator.synchronize")


def patched():
    res = activation.activate({"KVGUARD": "1", "KVGUARD_PATCHES": "warmup"})
    assert res and res["warmup"].startswith("applied"), res


def admitted_pool(specs, *, max_model_len: int, mode: str) -> int:
    """The smallest pool vLLM's own startup check admits: 1 null block plus, per group,
    ``cdiv(spec.max_memory_usage_bytes(cfg), page)`` (vLLM's own per-spec function)."""
    cfg = SimpleNamespace(model_config=SimpleNamespace(max_model_len=max_model_len),
                          cache_config=SimpleNamespace(mamba_cache_mode=mode),
                          parallel_config=SimpleNamespace(decode_context_parallel_size=1),
                          max_in_flight_tokens=8192)
    return 1 + sum(-(-s.max_memory_usage_bytes(cfg) // s.page_size_bytes) for s in specs)


# --------------------------------------------------------------------------- under-count
def test_prefill_reserves_what_the_allocator_reserves():
    """Mamba none, 3 speculative blocks, k=3: the allocator holds 4 blocks for the prefill
    request; 0.27.1's warmup gives 1 (vllm#51438), with the patch it gives 4."""
    specs = [spec_full(16), spec_mamba(256, "none", 3)]
    want = reserved_blocks(specs[1], 4 + 1, num_lookahead_tokens=3, max_model_len=256).table
    assert want == 4

    before = Worker()
    run_warmup(make_runner(specs, 200, k=3, max_model_len=256), before)
    given = before.prefill_blocks(1)
    record_defect("warmup", "vllm#51438", present=given < want,
                  detail=f"Mamba nsb=3 prefill request: warmup gives {given} of {want} blocks")
    assert given == (4 if NEW_WARMUP else 1)

    patched()
    after = Worker()
    run_warmup(make_runner(specs, 200, k=3, max_model_len=256), after)
    assert after.prefill_blocks(1) == want
    assert after.prefill_blocks(0) == reserved_blocks(
        specs[0], 5, num_lookahead_tokens=3, max_model_len=256).table
    assert max(after.block_ids()) < 200
    assert report.snapshot()["warmup"] == {"ok": 1}


def test_prefill_reserves_the_lookahead_tokens():
    """Full attention only, block 16, k=8: the warmup prefill request has 10 tokens and
    a real ``KVCacheManager`` admitting it with 8 lookahead tokens holds 2 blocks. 0.27.1's
    warmup sizes it from the tokens alone (1 block, vllm#50531); 0.32+ and the patch give 2."""
    from vllm_kvguard.testing.kv_fixtures import groups, make_manager, make_request, prefill

    k, mml, spec = 8, 256, spec_full(16)
    prompt_len = k + 2                                   # decode_query_len + 1
    manager = make_manager([spec], num_blocks=64, max_model_len=mml)
    assert prefill(manager, make_request("r", range(3, 3 + prompt_len)), lookahead=k)
    want = len(groups(manager)[0].req_to_blocks["r"])
    assert want == reserved_blocks(spec, prompt_len, num_lookahead_tokens=k,
                                   max_model_len=mml).table == 2

    before = Worker()
    run_warmup(make_runner([spec], 200, k=k, max_model_len=mml), before)
    given = before.prefill_blocks(0)
    record_defect("warmup", "vllm#50531", present=given < want,
                  detail=f"k={k}, {prompt_len}-token prefill, block 16: warmup gives {given} "
                         f"of the {want} blocks allocate_slots holds with lookahead")
    assert given == (want if NEW_WARMUP else 1)

    patched()
    after = Worker()
    run_warmup(make_runner([spec], 200, k=k, max_model_len=mml), after)
    assert after.prefill_blocks(0) == want
    assert max(after.block_ids()) < 200


# --------------------------------------------------------------------------- in bounds
def test_measured_overflow_case_stays_in_bounds(kvguard_log):
    """Align, k=7, max_model_len 32, block 16, 11-block pool: vLLM hands out id 11."""
    specs = [spec_full(16), spec_mamba(16, "align", 7)]
    before = Worker()
    run_warmup(make_runner(specs, 11, k=7, max_model_len=32, max_num_seqs=1), before)
    record_defect("warmup", "warmup-block-id-overflow", present=max(before.block_ids()) >= 11,
                  detail=f"highest warmup block id {max(before.block_ids())} on an 11-block pool")
    assert max(before.block_ids()) >= 11

    patched()
    after = Worker()
    run_warmup(make_runner(specs, 11, k=7, max_model_len=32, max_num_seqs=1), after)
    assert all(i < 11 for i in after.block_ids())
    assert not after.registered
    assert report.snapshot()["warmup"] == {"skipped_no_room": 1}
    assert any("skipping the V2 kernel warmup" in m for m in kvguard_log.lines())


SWEEP = [(mode, k, mml, seqs) for mode in ("none", "align") for k in (1, 2, 3, 4, 7)
         for mml in (32, 48, 64, 96, 128) for seqs in (1, 2, 4, 8)]


def test_every_admitted_pool_stays_in_bounds():
    """For every pool the engine's startup check admits (smallest .. +2) over ``SWEEP``,
    with the patch every warmup block id is < the pool size, and requests are capped (not
    skipped) whenever one request fits."""
    patched()
    checked = 0
    for mode, k, mml, seqs in SWEEP:
        # Mamba "none" states are one block of max_model_len tokens (as vLLM sizes them).
        specs = [spec_full(16), spec_mamba(16 if mode == "align" else mml, mode, k)]
        smallest = admitted_pool(specs, max_model_len=mml, mode=mode)
        for pool in range(smallest, smallest + 3):
            worker = Worker()
            run_warmup(make_runner(specs, pool, k=k, max_model_len=mml, max_num_seqs=seqs),
                       worker)
            ids = worker.block_ids()
            assert ids and max(ids) < pool, (mode, k, mml, seqs, pool, ids)
            assert not worker.registered
            checked += 1
    assert checked == len(SWEEP) * 3
    assert "skipped_no_room" not in report.snapshot().get("warmup", {})


def test_requests_are_capped_not_skipped(kvguard_log):
    specs = [spec_full(16), spec_mamba(256, "none", 3)]
    runner = make_runner(specs, 12, k=3, max_model_len=256, max_num_seqs=8)
    patched()
    worker = Worker()
    run_warmup(runner, worker)
    n = len(worker.outputs[0].scheduled_new_reqs)
    assert 1 <= n < 8 and max(worker.block_ids()) < 12
    assert runner.scheduler_config.max_num_seqs == 8          # only the warmup saw the cap
    # 0.32+ caps itself (its count is spec-aware); 0.27.1 under-counts and needs our cap.
    want = {"ok": 1} if NEW_WARMUP else {"capped": 1, "ok": 1}
    assert report.snapshot()["warmup"] == want


# --------------------------------------------------------------------------- skip on failure
def test_failing_step_without_patch_aborts_and_leaks():
    specs = [spec_full(16), spec_mamba(256, "none", 2)]
    runner = make_runner(specs, 200, k=2, max_model_len=256)
    worker = Worker(fail_on=2)
    with pytest.raises(RuntimeError, match="injected"):
        run_warmup(runner, worker)
    record_defect("warmup", "warmup-no-cleanup", present=bool(worker.registered),
                  detail=f"{len(worker.registered)} dummy requests left after a failed step")
    assert worker.registered and runner.kv_connector.calls == [True]


def test_failing_step_is_rolled_back_and_startup_continues(kvguard_log):
    specs = [spec_full(16), spec_mamba(256, "none", 2)]
    runner = make_runner(specs, 200, k=2, max_model_len=256)
    patched()
    worker = Worker(fail_on=2)
    run_warmup(runner, worker)                                  # does not raise
    assert not worker.registered, "dummy requests left registered"
    assert worker.outputs[-1].finished_req_ids == {r.req_id for r in
                                                   worker.outputs[0].scheduled_new_reqs}
    assert runner.kv_connector.calls[-1] is False
    assert runner.kv_block_zeroer.zeroed == [[0]]
    assert report.snapshot()["warmup"] == {"rolled_back": 1}
    assert any("rolled back" in m for m in kvguard_log.lines())


def test_failed_rollback_raises_the_warmup_error():
    specs = [spec_full(16)]
    runner = make_runner(specs, 200, k=0, max_model_len=256)
    patched()

    class Broken(Worker):
        def execute(self, so):
            raise RuntimeError("injected warmup failure")

    with pytest.raises(RuntimeError, match="injected warmup failure"):
        run_warmup(runner, Broken())


def test_unmodelled_spec_leaves_the_warmup_as_vllm_plans_it(kvguard_log):
    from dataclasses import dataclass

    from vllm.v1.kv_cache_interface import KVCacheSpec

    @dataclass(frozen=True)
    class CustomSpec(KVCacheSpec):
        @property
        def page_size_bytes(self) -> int:
            return 64

    specs = [spec_full(16), CustomSpec(block_size=16)]
    before = Worker()
    run_warmup(make_runner(specs, 200, k=2, max_model_len=256), before)
    patched()
    after = Worker()
    run_warmup(make_runner(specs, 200, k=2, max_model_len=256), after)
    assert after.block_ids() == before.block_ids()
    assert any("no block model for KV spec(s) CustomSpec" in m for m in kvguard_log.lines())


def test_patch_declares_range_upstream_and_removal():
    from vllm_kvguard.patches import warmup as pw

    p = pw.PATCH
    assert p.missing_targets() == []
    assert hasattr(W, "_warmup_kernels") or hasattr(W, "warmup_kernels")
    assert {"vllm#51438", "vllm#37521"} <= set(p.upstream)
    assert p.vllm_versions and p.remove_when
    assert pw.__doc__.count("Remove when") == 4          # one per target group
    # Model Runner V1 is gone from 0.34: its profiling target is declared absent there
    v1 = "vllm.v1.worker.gpu_model_runner.GPUModelRunner._dummy_sampler_run"
    has_v1 = importlib.util.find_spec("vllm.v1.worker.gpu_model_runner") is not None
    assert (v1 in p.absent_by_declaration()) == (not has_v1)
    assert (v1 in [t.name for t in p.targets_in()]) == has_v1


# --------------------------------------------------------------------------- 0.34 shapes
VLLM_DCP = NEW_WARMUP and "dcp_world_size" in __import__("inspect").signature(
    W._reserved_block_count).parameters            # 0.34+: vLLM's count takes DCP


def requests(worker) -> list:
    """Every block id each dummy request received, per output, in order."""
    out = []
    for so in worker.outputs:
        out.append([(nr.req_id, nr.block_ids) for nr in so.scheduled_new_reqs])
        out.append(list(so.scheduled_cached_reqs.new_block_ids or ()))
    return out


@pytest.mark.parametrize("dcp", [1, 2])
@pytest.mark.parametrize("mode,k", [(None, 0), (None, 3), ("none", 2), ("align", 3)])
def test_roomy_pool_warmup_equals_vllms_own(mode, k, dcp):
    """On a pool with room, the guard's rewritten warmup hands every request exactly the
    block ids vLLM's own plan does (DCP included on 0.34, whose count takes it); where
    vLLM's count has no DCP (0.32/0.33), the guard follows the allocator instead."""
    if not NEW_WARMUP:
        pytest.skip("0.27.1's own plan under-counts (vllm#51438): the under-count tests")
    bs = 4
    specs = [spec_full(bs)] + ([spec_mamba(bs if mode == "align" else 64, mode, k)]
                                if mode else [])
    before = Worker()
    run_warmup(make_runner(specs, 400, k=k, max_model_len=64, dcp=dcp), before)
    patched()
    after = Worker()
    run_warmup(make_runner(specs, 400, k=k, max_model_len=64, dcp=dcp), after)
    truth = reserved_blocks(specs[0], k + 2, num_lookahead_tokens=k, max_model_len=64,
                            dcp=dcp).table
    assert after.prefill_blocks(0) == truth
    if dcp == 1 or VLLM_DCP:
        assert requests(after) == requests(before)
    else:
        assert before.prefill_blocks(0) == reserved_blocks(    # no DCP in 0.32/0.33's count
            specs[0], k + 2, num_lookahead_tokens=k, max_model_len=64).table
    assert report.snapshot()["warmup"] == {"ok": 1}


def test_dcp_prefill_equals_the_allocator():
    """DCP 2, block 4, k=3: a real KVCacheManager (DCP 2) holds 1 block for the 5-token
    warmup prefill plus 3 lookahead tokens; the patched warmup gives the same."""
    from vllm_kvguard.testing.estimate_fixtures import allocate, held, make_manager, make_request

    spec = spec_full(4)
    manager = make_manager([spec], num_blocks=64, max_model_len=64, dcp=2)
    assert allocate(manager, make_request("r", 5), 5, k=3) is not None
    patched()
    worker = Worker()
    run_warmup(make_runner([spec], 400, k=3, max_model_len=64, dcp=2), worker)
    assert worker.prefill_blocks(0) == held(manager, "r").table == 1


class ExtensibleKVCache:
    """What vLLM 0.34's warmup reads of an extensible KV cache: the committable bound."""

    def __init__(self, committable: int):
        self.warmup_committable_blocks, self.commits = committable, []

    def commit(self, num_blocks, defragment=False, shrink=False):
        self.commits.append(num_blocks)


needs_committable = pytest.mark.skipif(
    not hasattr(W, "num_committable_kv_blocks"), reason="no extensible KV cache (< 0.34)")


@needs_committable
def test_ids_stay_within_the_committable_blocks(kvguard_log):
    """A 200-block pool of which warmup may commit 12: vLLM caps its requests by the
    committable count; the guard keeps every id below it, and only the real run commits
    (its dry runs commit nothing)."""
    specs = [spec_full(16), spec_mamba(256, "none", 3)]
    kv = ExtensibleKVCache(12)
    patched()
    worker = Worker()
    run_warmup(make_runner(specs, 200, k=3, max_model_len=256, max_num_seqs=8,
                           kv_cache=kv), worker)
    assert max(worker.block_ids()) < 12
    assert len(kv.commits) == 1 and max(worker.block_ids()) < kv.commits[0] <= 12
    assert report.snapshot()["warmup"] == {"ok": 1}


@needs_committable
def test_one_request_floor_beyond_the_committable_blocks_is_skipped(kvguard_log):
    """Warmup may commit 5 blocks but one request needs 8: vLLM's one-request floor commits
    and addresses past the bound; the guard skips the warmup and commits nothing."""
    specs = [spec_full(16), spec_mamba(256, "none", 3)]
    kv = ExtensibleKVCache(5)
    before = Worker()
    run_warmup(make_runner(specs, 200, k=3, max_model_len=256, kv_cache=kv), before)
    record_defect("warmup", "warmup-past-committable", present=max(before.block_ids()) >= 5,
                  detail=f"highest id {max(before.block_ids())}, commit {kv.commits} of 5")
    assert max(before.block_ids()) >= 5 and kv.commits[0] > 5
    patched()
    kv.commits.clear()
    after = Worker()
    run_warmup(make_runner(specs, 200, k=3, max_model_len=256, kv_cache=kv), after)
    assert after.outputs == [] and kv.commits == []
    assert report.snapshot()["warmup"] == {"skipped_no_room": 1}


@pytest.mark.skipif(not NEW_WARMUP or "greedy" not in __import__("inspect").signature(
    W._warmup_kernels).parameters, reason="no greedy warmup pass (< 0.34)")
def test_greedy_pass_under_drafts_is_guarded_too():
    """0.34's ``warmup_kernels`` runs ``_warmup_kernels`` again with greedy=True under
    drafts (inside ``_fixed_draft_counts``): both passes go through the guard, in bounds."""
    specs = [spec_full(16), spec_mamba(16, "align", 7)]
    patched()
    worker = Worker()
    W.warmup_kernels(make_runner(specs, 11, k=7, max_model_len=32, max_num_seqs=1),
                     worker.execute, worker.sample)
    assert report.snapshot()["warmup"] == {"skipped_no_room": 2}
    worker = Worker()
    report.reset_counters()
    W.warmup_kernels(make_runner(specs, 200, k=3, max_model_len=256), worker.execute,
                     worker.sample)
    assert report.snapshot()["warmup"] == {"ok": 2}
    assert max(worker.block_ids()) < 200 and not worker.registered
