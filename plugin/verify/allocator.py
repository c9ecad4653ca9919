"""Self-test of the ``allocator`` patch: on the installed vLLM's real ``KVCacheManager``
with every group kind it has (full attention, sliding window, Mamba align), an allocation
whose block grant fails in a later group returns None with the manager and pool exactly
as before, and succeeds when retried. Without the fix vLLM raises there, half-done."""
from __future__ import annotations

from vllm_kvguard.verify import SelfTestFailed

NUM_BLOCKS = 64


def _specs():
    from vllm_kvguard.testing import kv_fixtures as kf

    specs, kinds = [kf.attention_spec()], ["full attention"]
    for kind, build in (("sliding window", lambda: kf.attention_spec(
            kind="SlidingWindowSpec", sliding_window=32)),
            ("Mamba align", lambda: kf.mamba_spec(mode="align"))):
        try:
            specs.append(build())
            kinds.append(kind)
        except Exception:              # this vLLM has no such group kind
            continue
    return specs, kinds


def _manager():
    from vllm_kvguard.testing import kv_fixtures as kf

    specs, kinds = _specs()
    while True:
        try:
            return kf.make_manager(specs, num_blocks=NUM_BLOCKS, enable_caching=True), kinds
        except Exception:
            if len(specs) <= 2:
                raise
            specs, kinds = specs[:-2] + specs[-1:], kinds[:-2] + kinds[-1:]


def _tokens(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 1000 + 3 for i in range(n)]


def check() -> None:
    from vllm_kvguard.testing import kv_fixtures as kf

    manager, kinds = _manager()
    if len(kinds) < 2:
        raise SelfTestFailed("this vLLM builds no multi-group KVCacheManager")
    held = kf.make_request("kvguard-selftest-held", _tokens(1, 40))
    if kf.prefill(manager, held) is None:
        raise SelfTestFailed("a first request found no room in an empty pool")
    req = kf.make_request("kvguard-selftest", _tokens(2, 48))
    pool = manager.block_pool
    from vllm_kvguard.patches.allocator import fast_bound

    bound = fast_bound(manager, 32)   # with room the call runs unrecorded (nothing to undo):
    if bound is not None:             # leave the pool one block below its bound
        pool.get_new_blocks(max(pool.get_num_free_blocks() - bound + 1, 0))
    before = kf.state(manager)
    grant, calls = pool.get_new_blocks, [0]

    def failing(*args, **kwargs):
        calls[0] += 1
        if calls[0] >= 2:
            raise ValueError("Cannot get the blocks (kvguard self-test)")
        return grant(*args, **kwargs)

    pool.get_new_blocks = failing      # this private pool only
    try:
        out = manager.allocate_slots(req, 32)
    except ValueError as exc:
        raise SelfTestFailed(f"an allocation failing in group 2 of {len(kinds)} "
                             f"({', '.join(kinds)}) escaped: {exc}") from None
    finally:
        del pool.get_new_blocks
    if calls[0] < 2:
        raise SelfTestFailed("the allocation never reached a later group")
    if out is not None:
        raise SelfTestFailed("a failed allocation returned blocks")
    diff = kf.state_diff(before, kf.state(manager))
    if diff:
        raise SelfTestFailed(f"state not restored after a failing allocation: {diff[0]}"[:160])
    if manager.allocate_slots(req, 32) is None:
        raise SelfTestFailed("the rolled-back request found no room when retried")
