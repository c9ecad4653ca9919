"""Throughput of the REAL KVCacheManager with the allocator patch off and on, side by side.

One deterministic allocate/free sequence is replayed on a fresh manager (full attention +
Mamba align, prefix caching on) with the patch off and on, alternating, for lookahead 2
and 4: the KVCacheManager calls one Scheduler step makes (running requests' decode and
prompt-chunk allocations, admissions with a prefix lookup in block-aligned chunks, the
block ids handed to the SchedulerOutput, the per-step drains, events, frees), continuous
batching over shared prompt families so prefix hits happen. Each off/on pair gives a
ratio (on ops/s / off ops/s, ops = allocate_slots + free calls, CPU time of this
process); the median pair ratio is printed with ops/s. Target >= 0.95, stretch 0.98.
"On" is the allocator patch as installed: its transaction runs in the C accelerator when
that was built (``vllm_kvguard._txn``), else in Python; ``--pure-python`` measures the
Python form (``KVGUARD_PURE_PYTHON=1``).

    python benchmarks/bench_allocator.py [--rounds 25] [--requests 48] [--steps 96]
                                         [--pure-python]
"""
from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import time

from vllm_kvguard import activation
from vllm_kvguard.fixes import rollback
from vllm_kvguard.testing.kv_fixtures import hybrid_manager, make_request

BS = 16
FAMILIES = [[(f * 7919 + i * 31) % 997 + 3 for i in range(512)] for f in range(4)]


def make_sequence(n_requests: int, steps: int, batch: int, seed: int = 0):
    """(prompt, decode length) per request; admitted as slots free up."""
    rng = random.Random(seed)
    reqs = []
    for i in range(n_requests):
        family = FAMILIES[rng.randrange(len(FAMILIES))]
        shared = rng.choice([0, 64, 128, 192])
        prompt = family[:shared] + [1000 + (i * 37 + j) % 997 for j in range(rng.randint(40, 200))]
        reqs.append((prompt, rng.randint(steps // 2, steps)))
    return reqs, batch


def _call(manager, name, *args):
    fn = getattr(manager, name, None)          # absent in some vLLM versions
    return fn(*args) if fn is not None else None


def replay(manager, sequence, lookahead: int) -> int:
    """Drive ``manager`` the way ``Scheduler.schedule``/``update_from_output`` do, step by
    step; return the number of ``allocate_slots`` + ``free`` calls made."""
    specs, batch = sequence
    pending = list(enumerate(specs))
    running: list = []
    ops = 0
    while pending or running:
        manager.new_step_starts()
        for item in running:                              # running loop first
            req = item[0]
            if req.num_computed_tokens < req.num_tokens:  # rest of the prompt
                n = req.num_tokens - req.num_computed_tokens
            else:
                req.append_output_token_ids(FAMILIES[0][item[1] % 512])
                item[1] -= 1
                n = 1
            out = manager.allocate_slots(req, n, num_lookahead_tokens=lookahead)
            if out is None:
                raise RuntimeError("benchmark pool too small")
            out.get_block_ids(allow_none=True)            # SchedulerOutput's new block ids
            req.num_computed_tokens += n
            ops += 1
        while pending and len(running) < batch:           # then the waiting loop
            i, (prompt, decode) = pending.pop(0)
            req = make_request(f"r{i}", prompt, block_size=BS)
            blocks, hit, _ = manager.get_computed_blocks(req)
            cut = (req.num_tokens - 1) // BS * BS
            end = cut if hit < cut else req.num_tokens
            out = manager.allocate_slots(req, end - hit, num_new_computed_tokens=hit,
                                         new_computed_blocks=blocks,
                                         num_lookahead_tokens=lookahead)
            ops += 1
            if out is None:
                raise RuntimeError("benchmark pool too small")
            manager.record_prefix_cache_stats(req, hit)
            manager.get_blocks(req.request_id).get_block_ids()
            req.num_computed_tokens = end
            running.append([req, decode])
        _call(manager, "take_boundary_state_offloads")    # end of schedule()
        _call(manager, "take_kv_cache_block_copies")
        _call(manager, "take_new_block_ids")
        manager.take_events()                             # update_from_output
        for item in [it for it in running if it[1] <= 0]:
            _call(manager, "finalize_partial_tail_offloads", item[0])
            manager.free(item[0])
            running.remove(item)
            ops += 1
    return ops


def timed(sequence, lookahead: int, patched: bool, num_blocks: int,
          pure_python: bool = False) -> float:
    """ops/s of one replay on a fresh manager."""
    if patched:
        activation.activate({"KVGUARD": "1", "KVGUARD_PATCHES": "allocator",
                             "KVGUARD_PURE_PYTHON": "1" if pure_python else "0"})
    try:
        manager = hybrid_manager(num_blocks, enable_caching=True, max_model_len=4096)
        gc.collect()
        start = time.process_time()      # CPU time: other processes on the box don't count
        ops = replay(manager, sequence, lookahead)
        return ops / (time.process_time() - start)
    finally:
        activation.deactivate()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=25)
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--steps", type=int, default=96)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--pure-python", action="store_true",
                    help="run the transaction in Python even if the C accelerator is built")
    args = ap.parse_args(argv)
    form = ("pure Python" if args.pure_python or rollback._txn is None
            else "C accelerator (vllm_kvguard._txn)")
    sequence = make_sequence(args.requests, args.steps, args.batch)
    num_blocks = 4096
    print(f"KVCacheManager: full attention + Mamba align, prefix caching on, block {BS}; "
          f"{args.requests} requests, batch {args.batch}, {args.rounds} off/on pairs; "
          f"transaction: {form}")
    worst = None
    for lookahead in (2, 4):
        timed(sequence, lookahead, False, num_blocks)           # warm both paths
        timed(sequence, lookahead, True, num_blocks, args.pure_python)
        off, on, ratios = [], [], []
        for r in range(args.rounds):
            order = (False, True) if r % 2 == 0 else (True, False)
            res = {p: timed(sequence, lookahead, p, num_blocks, args.pure_python)
                   for p in order}
            off.append(res[False])
            on.append(res[True])
            ratios.append(res[True] / res[False])
        ratio = statistics.median(ratios)
        worst = ratio if worst is None else min(worst, ratio)
        print(f"lookahead {lookahead}: off {statistics.median(off):,.0f} ops/s, "
              f"on {statistics.median(on):,.0f} ops/s, ratio {ratio:.3f} "
              f"(pairs: min {min(ratios):.3f}, max {max(ratios):.3f})")
    verdict = "meets" if worst >= 0.95 else "MISSES"
    print(f"allocator patch throughput ratio {worst:.3f} (target >= 0.95, stretch 0.98): "
          f"{verdict} the target")
    return 0


if __name__ == "__main__":
    sys.exit(main())
