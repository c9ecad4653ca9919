"""Self-tests of the ``admission`` and ``warmup`` patches: the block model they share
(:mod:`vllm_kvguard.fixes.estimation.estimate`) against the installed vLLM's real
``KVCacheManager``.

* admission: the certificate's prompt limit is exactly what an empty pool's admission
  gate takes on a real scheduler (that many tokens fit, one more does not). It runs in
  the scheduler's process on a copy of the engine's own config, before the engine's
  limits are published (no config is built for it there); standalone on the tiny Llama's;
* warmup: the reserved-block model equals the blocks the allocator holds, step by step,
  for full attention with lookahead, sliding window, Mamba and Mamba align (its prefill
  checkpoint blocks), each step allocated with the previous one in flight.
"""
from __future__ import annotations

from vllm_kvguard.verify import SelfTestFailed


def _optional(build):
    try:
        return build()
    except Exception:                  # this vLLM has no such spec
        return None


BLOCKS = 17                            # the admission self-test's pool (null block included)


def _block_size(vllm_config) -> int:
    from vllm_kvguard.testing import kv_fixtures as kf

    return int(vllm_config.cache_config.block_size or kf.BLOCK_SIZE)


def private_scheduler(vllm_config, num_blocks: int = BLOCKS):
    """A private ``Scheduler`` over a full-attention pool of ``num_blocks`` on a cheap copy
    of ``vllm_config`` (the engine's own, in the scheduler's process): its block size,
    caching and admission settings; test-sized lengths (the pool, not ``max_model_len``
    nor the token budget, binds: one chunk is the whole prompt), no tokenizer, no
    speculation, connectors or event publishers. Nothing of the engine's is changed."""
    import copy

    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    from vllm_kvguard.testing import kv_fixtures as kf

    block_size = _block_size(vllm_config)
    length = 2 * num_blocks * block_size
    config = copy.copy(vllm_config)
    parts = {name: copy.copy(getattr(vllm_config, name))
             for name in ("model_config", "scheduler_config", "cache_config")}
    for part, values in (("model_config", {"skip_tokenizer_init": True,
                                           "max_model_len": length}),
                         ("scheduler_config", {"max_model_len": length,
                                               "max_num_batched_tokens": length,
                                               "max_num_scheduled_tokens": None,
                                               "disable_hybrid_kv_cache_manager": True}),
                         ("cache_config", {"num_gpu_blocks": num_blocks})):
        for name, value in values.items():
            if hasattr(parts[part], name):
                object.__setattr__(parts[part], name, value)
    for name, value in (*parts.items(), ("speculative_config", None),
                        ("kv_transfer_config", None), ("kv_events_config", None),
                        ("ec_transfer_config", None)):
        if hasattr(config, name):
            object.__setattr__(config, name, value)
    kcc = kf.kv_cache_config([kf.attention_spec(block_size)], num_blocks)
    return Scheduler(**kf.accepted(Scheduler.__init__, dict(
        vllm_config=config, kv_cache_config=kcc,
        structured_output_manager=StructuredOutputManager(config),
        block_size=block_size, hash_block_size=block_size, log_stats=False)))


def admission(vllm_config=None) -> None:
    """``vllm_config``: the engine's own (its scheduler's process, before the limits are
    published); None (``kvguard doctor``, tests): the tiny Llama's."""
    from vllm_kvguard.fixes.estimation.certificate import from_scheduler
    from vllm_kvguard.testing import kv_fixtures as kf

    if vllm_config is None:
        vllm_config = kf.make_vllm_config(num_gpu_blocks=BLOCKS)
    sched = private_scheduler(vllm_config)
    block_size = _block_size(vllm_config)
    limit = from_scheduler(sched).prompt_limit
    gate = bool(getattr(sched, "scheduler_reserve_full_isl", False))
    if not 0 < limit < sched.max_model_len:
        raise SelfTestFailed(f"certificate's prompt limit {limit} for {BLOCKS} blocks of "
                             f"{block_size} tokens is not set by the pool")
    for tokens, fits in ((limit, True), (limit + 1, False)):
        manager = private_scheduler(vllm_config).kv_cache_manager
        req = kf.make_request(f"kvguard-selftest-{tokens}", range(3, 3 + tokens),
                              block_size=block_size, max_tokens=1)
        kwargs = {"full_sequence_must_fit": True} if gate else {}
        got = manager.allocate_slots(req, tokens, **kwargs) is not None
        if got != fits:
            raise SelfTestFailed(f"certificate says prompts up to {limit} tokens are admitted "
                                 f"to {BLOCKS} blocks, the allocator "
                                 f"{'refused' if fits else 'took'} {tokens}")


def warmup() -> None:
    from vllm_kvguard.fixes.estimation.estimate import Reserved, reserved_blocks
    from vllm_kvguard.fixes.estimation.schedule import checkpointing
    from vllm_kvguard.testing import kv_fixtures as kf

    cases = [(kf.attention_spec(), 2, "full attention")]
    for spec, name in ((_optional(lambda: kf.attention_spec(
            kind="SlidingWindowSpec", sliding_window=32)), "sliding window"),
            (_optional(lambda: kf.mamba_spec(mode="none")), "Mamba"),
            (_optional(lambda: kf.mamba_spec(mode="align")), "Mamba align")):
        if spec is not None:
            cases.append((spec, 0, name))
    mml = 256
    for spec, k, name in cases:
        manager = kf.make_manager([spec], num_blocks=64, max_model_len=mml,
                                  enable_caching=False)
        ckpt = checkpointing(manager).get(0)
        req = kf.make_request("kvguard-selftest", range(3, 53), max_tokens=1 << 10)
        computed, previous = 0, 0
        for step in (16, 16, 18, 1, k + 1, 1, k + 1):
            # as the async scheduler allocates it: the previous step still in flight
            req.num_in_flight_tokens = previous
            if manager.allocate_slots(req, step, num_lookahead_tokens=k) is None:
                raise SelfTestFailed(f"{name}: no room in a pool sized for the test")
            want = reserved_blocks(spec, computed + step, num_lookahead_tokens=k,
                                   max_model_len=mml, num_computed_tokens=computed,
                                   num_settled_tokens=computed - previous,
                                   checkpointing=ckpt)
            blocks = kf.groups(manager)[0].req_to_blocks.get(req.request_id, [])
            got = Reserved(len(blocks), len([b for b in blocks if not b.is_null]))
            if want != got:
                raise SelfTestFailed(f"{name}: model {tuple(want) if want else None} != "
                                     f"allocator {tuple(got)} at {computed + step} tokens")
            computed, previous = computed + step, step
            req.num_computed_tokens = computed
