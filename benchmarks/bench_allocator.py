"""Throughput of the REAL KVCacheManager with the allocator patch off and on, side by side.

One deterministic allocate/free sequence is replayed on a fresh manager (full attention +
Mamba align, prefix caching on) with the patch off and on, alternating, for lookahead 2
and 4: the KVCacheManager calls one Scheduler step makes (running requests' decode and
prompt-chunk allocations, admissions with a prefix lookup in block-aligned chunks, the
block ids handed to the SchedulerOutput, the per-step drains, events, frees), continuous
batching over shared prompt families so prefix hits happen. Each off/on pair gives a
ratio (on ops/s / off ops/s, ops = allocate_slots + free calls, CPU time of this
process); the median pair ratio is printed with ops/s. Target >= 0.95, stretch 0.98.
"On" is the allocator patch as installed (its one Python transaction).

``--instructions`` counts instead, exactly, the instructions of one replay per lookahead
with the patch off and on under callgrind: each side in a child process of its own, once
per heap layout (``--layouts``; see ``_cgcount.py``), a replay uninstrumented to warm up,
then one counted on a fresh manager; it prints on/off per layout and of the means (target
<= 1.01, i.e. >= 0.99x).

``--per-call`` counts the transaction's own cost, which a replay's count (that moves
between runs by more than the transaction's smaller changes) cannot show: one decode-shaped
``allocate_slots`` call with nothing to allocate, made through vLLM's method, through a
pass-through of the same signature (``_floor.py``: what any per-call wrapper costs), through
the installed transaction (a call with room: its fast path) and through the transaction
with the fast path off (the record every call paid before), on the same manager and
request, in alternating regions of one callgrind child per layout; it prints the
instructions per call of each.

    python benchmarks/bench_allocator.py [--rounds 25] [--requests 48] [--steps 96]
                                         [--instructions [--layouts 5] | --per-call]
                                         [--json RUN.json] [--write-docs PAGE [--from-json RUN.json]]

With ``--instructions``, ``--json`` saves the headline (``_docs.py``) and ``--write-docs``
writes it into the page's ``<!-- bench:allocator:<vLLM> -->`` block; with ``--from-json``
that block is written from a saved run and nothing is measured.
"""
from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import sys
import time

import _cgcount  # noqa: E402
import _docs  # noqa: E402
import _floor  # noqa: E402
from vllm_kvguard.testing.kv_fixtures import hybrid_manager, make_request  # noqa: E402

from vllm_kvguard import activation  # noqa: E402

BS = 16
TARGET = 1.01          # instructions on/off of a replay (--instructions)
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


def set_patch(patched: bool) -> None:
    activation.deactivate()
    if patched:
        activation.activate({"KVGUARD": "1", "KVGUARD_PATCHES": "allocator"})


def timed(sequence, lookahead: int, patched: bool, num_blocks: int) -> float:
    """ops/s of one replay on a fresh manager."""
    set_patch(patched)
    try:
        manager = hybrid_manager(num_blocks, enable_caching=True, max_model_len=4096)
        gc.collect()
        start = time.process_time()      # CPU time: other processes on the box don't count
        ops = replay(manager, sequence, lookahead)
        return ops / (time.process_time() - start)
    finally:
        activation.deactivate()


def child_instructions(args, sequence, num_blocks: int) -> int:
    """In a callgrind child: the heap layout shifted, then per lookahead a replay with the
    side of ``--child`` uninstrumented (warm-up) and one counted, each on a fresh manager."""
    _cgcount.shift_layout(args.layout)
    ops = []
    for lookahead in (2, 4):
        timed(sequence, lookahead, args.child == "on", num_blocks)      # warm-up
        set_patch(args.child == "on")
        try:
            manager = hybrid_manager(num_blocks, enable_caching=True, max_model_len=4096)
            gc.collect()
            ops.append(_cgcount.region(replay, manager, sequence, lookahead))
        finally:
            activation.deactivate()
    _cgcount.emit(dict(regions=len(ops), ops=ops))
    return 0


PER_CALL = 2000        # calls per counted region of --per-call


def child_per_call(args) -> int:
    """In a callgrind child: regions of ``PER_CALL`` calls, through vLLM's own
    ``allocate_slots``, the pass-through and the transaction, alternating (twice each)."""
    _cgcount.shift_layout(args.layout)
    set_patch(True)
    manager = hybrid_manager(1024, enable_caching=True, max_model_len=4096)
    req = make_request("r0", FAMILIES[0][:40], block_size=BS)
    manager.allocate_slots(req, 40, num_lookahead_tokens=2)    # installs the transaction
    req.num_computed_tokens = 40
    txn = vars(manager)["allocate_slots"]
    vllm = type(manager).allocate_slots.__wrapped__.__get__(manager)
    floor = _floor.pass_through(manager, vllm)
    recorded = _floor.recorded(manager, vllm)

    def calls(fn):
        for _ in range(PER_CALL):
            fn(req, 1, num_lookahead_tokens=2)

    sides = (vllm, floor, txn, recorded)
    for fn in sides:
        calls(fn)                                               # warm-up, uncounted
    gc.collect()
    for fn in sides + sides:
        _cgcount.region(calls, fn)
    _cgcount.emit(dict(regions=2 * len(sides)))
    return 0


def per_call(args) -> int:
    why = _cgcount.available()
    if why:
        print(f"instructions: not counted ({why})")
        return 1
    layouts = _cgcount.LAYOUTS[:args.layouts]
    done = _cgcount.count_each([os.path.abspath(__file__)], ["per-call"], layouts)
    rows = []
    for n in layouts:
        c = [x / PER_CALL for x in done[("per-call", n)][1]]
        rows.append(tuple((c[i] + c[i + 4]) / 2 for i in range(4)))
    base = statistics.fmean(r[0] for r in rows)
    floor, extra, rec = (statistics.fmean(r[i] - r[0] for r in rows) for i in (1, 2, 3))
    print(f"per call: one decode-shaped allocate_slots (nothing to allocate), {PER_CALL} calls a "
          f"region, vLLM's method, a pass-through of its signature, the transaction and the "
          f"transaction with its fast path off alternating in one process, {len(layouts)} "
          f"heap layout(s)")
    print(f"vLLM {base:,.0f} Ir/call; through a pass-through +{floor:,.0f} ({floor / base:.2%}); "
          f"through the transaction +{extra:,.0f} Ir/call ({extra / base:.2%}), of which its "
          f"bound check, journal reset and try +{extra - floor:,.0f}; recorded (fast path off) "
          f"+{rec:,.0f} ({rec / base:.2%}); per layout: "
          + " ".join(f"+{f - a:,.0f}/+{t - a:,.0f}/+{r - a:,.0f}" for a, f, t, r in rows))
    return 0


def instructions(args, form: str) -> int:
    why = _cgcount.available()
    if why:
        print(f"instructions: not counted ({why})")
        return 1
    argv = [os.path.abspath(__file__), "--requests", str(args.requests), "--steps",
            str(args.steps), "--batch", str(args.batch)]
    layouts = _cgcount.LAYOUTS[:args.layouts]
    t0 = time.monotonic()
    done = _cgcount.count_each(argv, ["off", "on"], layouts)
    ops = done[("off", layouts[0])][0]["ops"]
    print(f"instructions: callgrind, one replay per lookahead ({ops[0]} allocate_slots + free "
          f"calls), each side in its own child under {len(layouts)} heap layout(s) "
          f"({time.monotonic() - t0:.0f} s); transaction: {form}")
    print(f"{'':14} {'off Ir':>14} {'on Ir':>14} {'on/off':>8} {'Ir/op off':>10} "
          f"{'Ir/op on':>10}  per-layout on/off")
    worst = None
    ratios, per_layout = {}, {}
    for i, lookahead in enumerate((2, 4)):
        off = [done[("off", n)][1][i] for n in layouts]
        on = [done[("on", n)][1][i] for n in layouts]
        m_off, m_on = statistics.fmean(off), statistics.fmean(on)
        ratio = m_on / m_off
        ratios[f"lookahead {lookahead}"] = ratio
        per_layout[f"lookahead {lookahead}"] = [b / a for a, b in zip(off, on)]
        worst = ratio if worst is None else max(worst, ratio)
        print(f"lookahead {lookahead:<4} {m_off:>14,.0f} {m_on:>14,.0f} {ratio:8.4f} "
              f"{m_off / ops[i]:>10,.0f} {m_on / ops[i]:>10,.0f}  "
              + " ".join(f"{b / a:.4f}" for a, b in zip(off, on)))
    verdict = "PASS" if worst <= TARGET else "MISS"
    print(f"{verdict}: allocator replay with the patch at {1 / worst:.4f}x the unpatched one "
          f"in instructions (worst on/off {worst:.4f}; target on/off <= {TARGET})")
    import vllm

    rec = _docs.record("allocator", vllm.__version__, layouts, ratios, TARGET,
                       per_layout=per_layout,
                       command=f"bench_allocator.py --instructions --layouts {len(layouts)}")
    _docs.save(args, rec)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=25)
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--steps", type=int, default=96)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--instructions", action="store_true",
                    help="count instructions of one replay off and on under callgrind "
                         "instead of timing")
    ap.add_argument("--per-call", action="store_true",
                    help="count one allocate_slots call through vLLM's method and through "
                         "the transaction under callgrind (the transaction's own cost)")
    ap.add_argument("--layouts", type=int, default=len(_cgcount.LAYOUTS),
                    choices=range(1, len(_cgcount.LAYOUTS) + 1),
                    help="with --instructions or --per-call: heap layouts each side is "
                         "counted under")
    _docs.add_arguments(ap, "allocator", when="with --instructions: ")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--layout", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if _docs.write_saved(ap, args):
        return 0
    form = "one Python transaction, its reads written out per manager"
    sequence = make_sequence(args.requests, args.steps, args.batch)
    num_blocks = 4096
    if args.child == "per-call":
        return child_per_call(args)
    if args.child:
        return child_instructions(args, sequence, num_blocks)
    if args.per_call:
        return per_call(args)
    if args.instructions:
        return instructions(args, form)
    print(f"KVCacheManager: full attention + Mamba align, prefix caching on, block {BS}; "
          f"{args.requests} requests, batch {args.batch}, {args.rounds} off/on pairs; "
          f"transaction: {form}")
    worst = None
    for lookahead in (2, 4):
        timed(sequence, lookahead, False, num_blocks)           # warm both paths
        timed(sequence, lookahead, True, num_blocks)
        off, on, ratios = [], [], []
        for r in range(args.rounds):
            order = (False, True) if r % 2 == 0 else (True, False)
            res = {p: timed(sequence, lookahead, p, num_blocks)
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
