"""``kvguard plan``'s warmup feasibility: which model-runner V2 warmup shapes a pool runs.

vLLM's own warmup function (``_warmup_kernels``; ``warmup_kernels`` on 0.27.1) is run over
the planner's ``VllmConfig`` and ``KVCacheConfig`` against a recording executor: no model,
no device. Once as vLLM plans it (the dummy requests and the highest block id it hands
out), once as the warmup guard plans it (:func:`vllm_kvguard.fixes.estimation.warmup_guard.choose_cap`:
all requests, capped, or skipped), and once over an unbounded pool for the size that
warms every shape. The V1 runner's dummy runs hold no KV blocks, so nothing is skipped.
"""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from unittest import mock


def _warmup_fn():
    import vllm.v1.worker.gpu.warmup as W

    fn = getattr(W, "_warmup_kernels", None) or W.warmup_kernels
    return getattr(fn, "__wrapped__", fn)          # vLLM's own, if the plugin wraps it


def plan_runner(vllm_config, kv_cache_config):
    """What the warmup reads from a V2 model runner, from the configs alone."""
    from vllm_kvguard.fixes.estimation.estimate import num_spec

    k = num_spec(vllm_config)
    return SimpleNamespace(
        vllm_config=vllm_config, model_config=vllm_config.model_config,
        scheduler_config=vllm_config.scheduler_config, kv_cache_config=kv_cache_config,
        max_model_len=int(vllm_config.model_config.max_model_len),
        max_num_reqs=int(vllm_config.scheduler_config.max_num_seqs),
        num_speculative_steps=k, decode_query_len=k + 1, is_pooling_model=False,
        is_encoder_decoder=False, model_state=SimpleNamespace(max_encoder_len=0),
        block_tables=None, kv_block_zeroer=None,
        kv_connector=SimpleNamespace(set_disabled=lambda _d: None),
        is_last_pp_rank=True, adaptive_verification=None, rejection_sampler=None,
        # read from vLLM 0.34: the token budget and draft slots (``_cap_num_warmup_reqs``),
        # no extensible cache (``num_committable_kv_blocks`` = the pool), no drafter state
        speculative_config=vllm_config.speculative_config,
        max_num_tokens=int(vllm_config.scheduler_config.max_num_batched_tokens),
        extensible_kv_cache=None, speculator=None)


class _Recorder:
    def __init__(self):
        self.requests, self.max_id, self.done = 0, 0, False

    def execute(self, so):
        self.requests = max(self.requests, len(so.scheduled_new_reqs))
        ids = [i for nr in so.scheduled_new_reqs for g in nr.block_ids for i in g]
        for new in so.scheduled_cached_reqs.new_block_ids or ():
            ids += [i for g in (new or ()) for i in g]
        self.max_id = max([self.max_id, *ids])
        self.done = self.done or bool(so.finished_req_ids)


def _as_vllm_plans(runner) -> _Recorder:
    rec = _Recorder()
    try:
        _warmup_fn()(runner, rec.execute, lambda *_a, **_k: None)
    except Exception:
        if not rec.done:        # only the device sync after the cleanup step may fail
            raise
    return rec


def feasibility(vllm_config, kv_cache_config, runner: str = "v2") -> dict:
    """``{runner, num_blocks, vllm_requests, vllm_max_block_id, vllm_in_bounds,
    kvguard_requests, skipped_shapes, blocks_for_all}`` (V2), or ``{runner}`` (V1)."""
    if runner != "v2":
        return {"runner": runner}
    from vllm_kvguard.fixes.estimation.warmup_guard import WarmupPlan, choose_cap

    stand_in = plan_runner(vllm_config, kv_cache_config)
    with mock.patch("torch.accelerator.synchronize", create=True):
        vllm_alone = _as_vllm_plans(stand_in)
        plan = WarmupPlan.of(stand_in)
        cap, fitted = choose_cap(_warmup_fn(), stand_in, plan, (), {})
        unbounded = dataclasses.replace(kv_cache_config, num_blocks=2**40)
        big = plan_runner(vllm_config, unbounded)
        _, full = choose_cap(_warmup_fn(), big, WarmupPlan.of(big), (), {})
    planned, every = vllm_alone.requests, full.num_new_reqs
    ran = 0 if fitted is None else (planned if cap is None else cap)
    return {"runner": runner, "num_blocks": int(kv_cache_config.num_blocks),
            "vllm_requests": planned, "vllm_max_block_id": vllm_alone.max_id,
            "vllm_in_bounds": vllm_alone.max_id < kv_cache_config.num_blocks,
            "kvguard_requests": ran, "requests_for_all": every,
            "skipped_shapes": [] if ran >= every else [ran + 1, every],
            "blocks_for_all": full.max_id + 1}


def format_lines(w: dict) -> list[str]:
    if w["runner"] != "v2":
        return ["warmup (model runner V1): its dummy runs hold no KV blocks; no warmup "
                "shape is skipped"]
    out = [f"warmup (model runner V2): vLLM plans {w['vllm_requests']} dummy request(s); "
           f"highest block id {w['vllm_max_block_id']} of the pool's {w['num_blocks']}: "
           + ("in bounds" if w["vllm_in_bounds"] else "OUT OF BOUNDS (vLLM alone)")]
    lo_hi = w["skipped_shapes"]
    if not lo_hi:
        out.append(f"  with kvguard: all {w['kvguard_requests']} run; no warmup shape is "
                   f"skipped")
    else:
        what = ("not one dummy request fits in bounds" if not w["kvguard_requests"] else
                f"{w['kvguard_requests']} of {w['requests_for_all']} request(s) warmed")
        out.append(f"  with kvguard: {what}; batches of {lo_hi[0]}-{lo_hi[1]} requests are "
                   f"not warmed (they compile on the first real steps); a pool of "
                   f">= {w['blocks_for_all']} blocks warms all {w['requests_for_all']}")
    return out


def problem(w: dict) -> str | None:
    """The verdict's line for a warmup that would skip shapes, or None."""
    if w["runner"] != "v2" or not w["skipped_shapes"]:
        return None
    lo, hi = w["skipped_shapes"]
    return (f"V2 warmup: batches of {lo}-{hi} requests would not be warmed; fix: "
            f"--num-gpu-blocks >= {w['blocks_for_all']} (or more KV cache memory)")
