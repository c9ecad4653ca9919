"""Self-tests of the ``admission`` and ``warmup`` patches: the block model they share
(:mod:`vllm_kvguard.fixes.estimation.estimate`) against the installed vLLM's real
``KVCacheManager``.

* admission: the certificate's prompt limit is exactly what an empty pool's admission
  gate takes on a real scheduler (that many tokens fit, one more does not);
* warmup: the reserved-block model equals the blocks the allocator holds, step by step,
  for full attention with lookahead, sliding window and Mamba.
"""
from __future__ import annotations

from vllm_kvguard.verify import SelfTestFailed


def _optional(build):
    try:
        return build()
    except Exception:                  # this vLLM has no such spec
        return None


def admission() -> None:
    from vllm_kvguard.fixes.estimation.certificate import from_scheduler
    from vllm_kvguard.testing import kv_fixtures as kf

    blocks = 17
    sched = kf.make_scheduler(num_gpu_blocks=blocks)
    limit = from_scheduler(sched).prompt_limit
    gate = bool(getattr(sched, "scheduler_reserve_full_isl", False))
    for tokens, fits in ((limit, True), (limit + 1, False)):
        manager = kf.make_scheduler(num_gpu_blocks=blocks).kv_cache_manager
        req = kf.make_request(f"kvguard-selftest-{tokens}", range(3, 3 + tokens), max_tokens=1)
        kwargs = {"full_sequence_must_fit": True} if gate else {}
        got = manager.allocate_slots(req, tokens, **kwargs) is not None
        if got != fits:
            raise SelfTestFailed(f"certificate says prompts up to {limit} tokens are admitted "
                                 f"to {blocks} blocks, the allocator "
                                 f"{'refused' if fits else 'took'} {tokens}")


def warmup() -> None:
    from vllm_kvguard.fixes.estimation.estimate import Reserved, reserved_blocks
    from vllm_kvguard.testing import kv_fixtures as kf

    cases = [(kf.attention_spec(), 2, "full attention")]
    for spec, name in ((_optional(lambda: kf.attention_spec(
            kind="SlidingWindowSpec", sliding_window=32)), "sliding window"),
            (_optional(lambda: kf.mamba_spec(mode="none")), "Mamba")):
        if spec is not None:
            cases.append((spec, 0, name))
    mml = 256
    for spec, k, name in cases:
        manager = kf.make_manager([spec], num_blocks=64, max_model_len=mml,
                                  enable_caching=False)
        req = kf.make_request("kvguard-selftest", range(3, 53), max_tokens=1 << 10)
        computed = 0
        for step in (16, 16, 18, 1, k + 1, 1, k + 1):
            if manager.allocate_slots(req, step, num_lookahead_tokens=k) is None:
                raise SelfTestFailed(f"{name}: no room in a pool sized for the test")
            want = reserved_blocks(spec, computed + step, num_lookahead_tokens=k,
                                   max_model_len=mml, num_computed_tokens=computed)
            blocks = kf.groups(manager)[0].req_to_blocks.get(req.request_id, [])
            got = Reserved(len(blocks), len([b for b in blocks if not b.is_null]))
            if want != got:
                raise SelfTestFailed(f"{name}: model {tuple(want) if want else None} != "
                                     f"allocator {tuple(got)} at {computed + step} tokens")
            computed += step
            req.num_computed_tokens = computed
