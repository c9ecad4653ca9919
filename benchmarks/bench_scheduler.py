"""Cost of vllm-kvguard on the REAL vLLM scheduler step, plugin off vs on, in one run.

What is measured
    vLLM's own ``Scheduler``: ``schedule()`` + ``update_from_output()`` with synthetic
    ``ModelRunnerOutput`` s (no model, no forward pass). Hybrid KV cache groups as vLLM
    builds them for a hybrid model: one ``FullAttentionSpec`` group and one ``MambaSpec``
    group (align mode, ``num_speculative_blocks`` = k) over one pool; prefix caching on;
    ngram speculative decoding with k draft tokens: each decoding request gets k drafts
    (``update_draft_token_ids``, as the engine does with the drafter's output; a seeded
    ~15 % get none, an ngram miss) and the synthetic output accepts a seeded, ragged
    number of them. 256 running requests in steady decode; requests finish on their
    ``max_tokens`` and waiting ones (prompts sharing prefixes, so prefix hits happen)
    are admitted in their place; the pool is sized so a few preemptions happen. The
    workload is a pure function of the seed: both sides do the identical work (checked:
    a fingerprint of every step's scheduled tokens must match).

    "On" is ``vllm_kvguard.activation.activate({"KVGUARD": "1"})`` (every patch that
    supports the installed vLLM), "off" is after ``activation.deactivate()``. A fresh
    scheduler is built for each sample.

Two figures, as on/off ratios side by side
    * instructions per step, exact: a few steps after the warm-up counted by callgrind
      (``_cgcount.py``), each side in a child process of its own, once per heap layout
      (``--layouts``; a layout alone moves the count by up to 0.7%): the ratio per
      layout, and of the means;
    * CPU time per step (``time.process_time``) over interleaved off/on pairs: the
      median pair ratio and its spread.
    Target (issue 35, vLLM 0.32-0.34): instructions on/off <= 1.02, i.e. the scheduler
    step with the plugin at >= 0.98x the unpatched one.

    ``--floor`` counts a third side, "floor": the plugin on with its allocator transaction
    cut to a pass-through of vLLM's own signature (``_floor.py``), and splits on's excess
    into the floor (what any per-call Python wrapper of ``allocate_slots`` costs, with the
    pool seams and other patches) and the transaction's record above it.

    python benchmarks/bench_scheduler.py [--pairs 15] [--steps 24] [--instr-steps 4]
                                         [--warmup 16] [--layouts 5] [--no-instructions]
                                         [--no-cpu] [--floor] [--json RUN.json]
                                         [--write-docs docs/performance.md [--from-json RUN.json]]

    ``--json`` saves the instruction counts' headline (``_docs.py``); ``--write-docs``
    writes it into the page's ``<!-- bench:scheduler:<vLLM> -->`` block, from this run or,
    with ``--from-json``, from a saved one (nothing is measured then).
"""
from __future__ import annotations

import argparse
import gc
import hashlib
import inspect
import logging
import os
import random
import statistics
import sys
import time

import _cgcount
import _docs
import _floor

BLOCK_SIZE = 16
K = 3                       # ngram draft tokens
RUNNING = 256               # max_num_seqs: running requests in steady state
MAX_BATCHED = 2048          # token budget per step (256 x (1 + k) decode + admissions)
MAX_MODEL_LEN = 2048
NUM_BLOCKS = 2900           # pool (incl. null block): steady decode, then a few preemptions
TARGET = 1.02              # instructions on/off per step
FAMILIES = [[(f * 7919 + i * 31) % 997 + 3 for i in range(512)] for f in range(8)]


def accepted(fn, kwargs: dict) -> dict:
    """``kwargs`` restricted to the parameters ``fn`` accepts (version tolerance)."""
    params = inspect.signature(fn).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in params}


# ------------------------------------------------------------------ a real vLLM Scheduler
# Modelled on vLLM's tests/v1/core/utils.py ``create_scheduler``; the KV cache config is
# the hybrid one vLLM builds for an attention + Mamba model (one group per spec type).
_model_config = None


def kv_cache_config(num_blocks: int, k: int):
    import torch
    from vllm.v1 import kv_cache_interface as kci

    attn = kci.FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=2, head_size=16,
                                 dtype=torch.bfloat16)
    mamba = kci.MambaSpec(**accepted(kci.MambaSpec, dict(
        block_size=BLOCK_SIZE, shapes=((4, 8),), dtypes=(torch.bfloat16,),
        mamba_cache_mode="align", num_speculative_blocks=k)))
    groups = [kci.KVCacheGroupSpec(["layers.0.attn"], attn),
              kci.KVCacheGroupSpec(["layers.1.mamba"], mamba)]
    return kci.KVCacheConfig(**accepted(kci.KVCacheConfig, dict(
        num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)))


def vllm_config(num_blocks: int, k: int):
    """A ``VllmConfig`` for the plugin's embedded tiny Llama (no download, no tokenizer)."""
    global _model_config
    from vllm.config import (CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig,
                             SpeculativeConfig, VllmConfig)

    from vllm_kvguard.tools.tiny_models import write_model

    if _model_config is None:
        _model_config = ModelConfig(**accepted(ModelConfig, dict(
            model=write_model("llama"), skip_tokenizer_init=True,
            max_model_len=MAX_MODEL_LEN, dtype="bfloat16")))
    sched = SchedulerConfig(**accepted(SchedulerConfig, dict(
        max_num_seqs=RUNNING, max_num_batched_tokens=MAX_BATCHED,
        max_model_len=MAX_MODEL_LEN, enable_chunked_prefill=True,
        is_encoder_decoder=False)))
    cache = CacheConfig(**accepted(CacheConfig, dict(
        block_size=BLOCK_SIZE, enable_prefix_caching=True, mamba_cache_mode="align")))
    spec = SpeculativeConfig(**accepted(SpeculativeConfig, dict(
        method="ngram", num_speculative_tokens=k, prompt_lookup_max=4,
        prompt_lookup_min=2)))
    config = VllmConfig(**accepted(VllmConfig, dict(
        model_config=_model_config, scheduler_config=sched, cache_config=cache,
        speculative_config=spec, device_config=DeviceConfig(device="cpu"))))
    config.cache_config.num_gpu_blocks = num_blocks
    return config


def create_scheduler(num_blocks: int = NUM_BLOCKS, k: int = K):
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    config = vllm_config(num_blocks, k)
    return Scheduler(**accepted(Scheduler.__init__, dict(
        vllm_config=config, kv_cache_config=kv_cache_config(num_blocks, k),
        structured_output_manager=StructuredOutputManager(config), block_size=BLOCK_SIZE,
        log_stats=False)))


_hasher = None


def make_request(i: int, prompt, max_tokens: int):
    global _hasher
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    if _hasher is None:
        init_none_hash(sha256)
        _hasher = get_request_block_hasher(BLOCK_SIZE, sha256)
    return Request(**accepted(Request.__init__, dict(
        request_id=f"req-{i}", prompt_token_ids=list(prompt),
        sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        pooling_params=None, eos_token_id=None, arrival_time=float(i),
        block_hasher=_hasher)))


def workload(n_requests: int, seed: int = 0):
    """(prompt, max_tokens) per request: prompts share block-aligned prefixes of a few
    families (prefix hits), decode lengths vary (requests finish at different steps)."""
    rng = random.Random(seed)
    out = []
    for i in range(n_requests):
        family = FAMILIES[rng.randrange(len(FAMILIES))]
        shared = rng.choice([0, 32, 64, 96])
        tail = [1000 + (i * 37 + j) % 997 for j in range(rng.randint(16, 80))]
        out.append((family[:shared] + tail, rng.randint(24, 240)))
    return out


class Run:
    """One sample: a fresh scheduler with the whole workload queued, stepped without a
    model. ``step()`` is one engine step as the scheduler sees it."""

    def __init__(self, n_requests: int, k: int, num_blocks: int, seed: int = 0):
        from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput

        self._mro, self._drafts = ModelRunnerOutput, DraftTokenIds
        self.k = k
        self.sched = create_scheduler(num_blocks, k)
        for i, (prompt, max_tokens) in enumerate(workload(n_requests, seed)):
            self.sched.add_request(make_request(i, prompt, max_tokens))
        self.rng = random.Random(seed + 1)
        self.digest = hashlib.sha256()
        self.stats = dict(steps=0, tokens=0, drafts=0, accepted=0, preempted=0,
                          finished=0, admitted=0)

    def step(self) -> None:
        sched, rng, k = self.sched, self.rng, self.k
        out = sched.schedule()
        num_sched = out.num_scheduled_tokens
        spec = out.scheduled_spec_decode_tokens
        req_ids = list(num_sched)
        sampled = []
        for rid in req_ids:
            req = sched.requests[rid]
            if req.num_computed_tokens < req.num_tokens:        # a prompt chunk: no token
                sampled.append([])
                continue
            drafts = spec.get(rid)
            n_acc = 0
            if drafts:                                            # ragged acceptance
                n_acc = min(len(drafts), rng.choice((0, 0, 1, 1, 2, 3, 3)))
            sampled.append([rng.randrange(3, 997) for _ in range(n_acc + 1)])
            self.stats["drafts"] += len(drafts or ())
            self.stats["accepted"] += n_acc
        mro = self._mro(**accepted(self._mro, dict(
            req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled, logprobs=None, prompt_logprobs_dict={},
            pooler_output=[])))
        sched.update_from_output(out, mro)
        # the drafter's proposals for the next step: k tokens per decoding request,
        # none for an ngram miss
        draft_ids, draft_tokens = [], []
        for rid in req_ids:
            req = sched.requests.get(rid)
            if req is None or req.is_finished() or req.num_computed_tokens < req.num_tokens - 1:
                continue
            draft_ids.append(rid)
            draft_tokens.append([] if rng.random() < 0.15
                                else [rng.randrange(3, 997) for _ in range(k)])
        if draft_ids:
            sched.update_draft_token_ids(self._drafts(draft_ids, draft_tokens))
        st = self.stats
        st["steps"] += 1
        st["tokens"] += out.total_num_scheduled_tokens
        st["preempted"] += len(getattr(out, "preempted_req_ids", None) or ())
        st["finished"] += len(out.finished_req_ids)
        st["admitted"] += len(out.scheduled_new_reqs)
        self.digest.update(repr(sorted(num_sched.items())).encode())

    def steps(self, n: int) -> None:
        for _ in range(n):
            self.step()

    def summary(self) -> dict:
        return dict(self.stats, running=len(self.sched.running),
                    waiting=len(self.sched.waiting), digest=self.digest.hexdigest()[:16])


# ------------------------------------------------------------------ plugin on / off
def set_plugin(on: bool) -> None:
    import vllm.v1.engine.core  # noqa: F401  (loaded in EngineCore: the health heartbeat
    #                              registers there, so both sides load it)
    from vllm_kvguard import activation

    activation.deactivate()
    if on:
        activation.activate({"KVGUARD": "1"})


def sample(on: bool, args, n_steps: int) -> tuple[float, dict]:
    """CPU seconds of ``n_steps`` steps after warm-up on a fresh scheduler."""
    set_plugin(on)
    try:
        run = Run(args.requests, args.k, args.num_blocks, args.seed)
        run.steps(args.warmup)
        gc.collect()
        t0 = time.process_time()
        run.steps(n_steps)
        return time.process_time() - t0, run.summary()
    finally:
        set_plugin(False)


# ------------------------------------------------------------------ instruction counts
def child_instructions(args) -> int:
    """In a callgrind child: the heap layout shifted, the side set, a fresh scheduler
    warmed up uninstrumented, then ``--instr-steps`` steps counted."""
    _cgcount.shift_layout(args.layout)
    set_plugin(args.child in ("on", "floor"))
    if args.child == "floor":
        _floor.cut_to_pass_through()
    run = Run(args.requests, args.k, args.num_blocks, args.seed)
    run.steps(args.warmup)
    gc.collect()
    _cgcount.region(run.steps, args.instr_steps)
    _cgcount.emit(dict(regions=1, summary=run.summary()))
    return 0


def instructions(args) -> dict:
    """Instructions per counted step: {"off": [per layout], "on": [...], "floor": [...]
    (with --floor), "summary": ...}."""
    argv = [os.path.abspath(__file__), "--requests", str(args.requests), "--k", str(args.k),
            "--num-blocks", str(args.num_blocks), "--seed", str(args.seed),
            "--warmup", str(args.warmup), "--instr-steps", str(args.instr_steps)]
    layouts = _cgcount.LAYOUTS[:args.layouts]
    sides = ["off", "on"] + (["floor"] if args.floor else [])
    done = _cgcount.count_each(argv, sides, layouts)
    res: dict = {side: [] for side in sides}
    res["layouts"] = layouts
    digests = set()
    for n in layouts:
        for side in sides:
            result, (count,) = done[(side, n)]
            res[side].append(count / args.instr_steps)
            res["summary"] = result["summary"]
            digests.add(result["summary"]["digest"])
    if len(digests) != 1:
        raise RuntimeError(f"{', '.join(sides)} scheduled different work (step fingerprints "
                           "differ)")
    return res


# ------------------------------------------------------------------ main
def quiet(verbose: bool) -> None:
    """vLLM's and the plugin's INFO/WARNING lines (capacity report per scheduler, CPU
    backend notes) off, unless --verbose. vLLM sets its logger up on import."""
    import vllm  # noqa: F401

    if not verbose:
        logging.getLogger("vllm").setLevel(logging.ERROR)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=15, help="interleaved off/on CPU-time pairs")
    ap.add_argument("--steps", type=int, default=24, help="timed steps per CPU sample")
    ap.add_argument("--instr-steps", type=int, default=4,
                    help="steps counted under callgrind (after the same warm-up)")
    ap.add_argument("--warmup", type=int, default=16,
                    help="steps before measuring (ramp-up to steady decode)")
    ap.add_argument("--requests", type=int, default=512,
                    help="requests queued (256 run at a time; the rest wait)")
    ap.add_argument("--k", type=int, default=K, help="ngram draft tokens per step")
    ap.add_argument("--num-blocks", type=int, default=NUM_BLOCKS)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-instructions", action="store_true", help="skip the callgrind counts")
    ap.add_argument("--no-cpu", action="store_true", help="skip the CPU-time pairs")
    ap.add_argument("--floor", action="store_true",
                    help="also count the plugin with its transaction cut to a pass-through")
    ap.add_argument("--layouts", type=int, default=len(_cgcount.LAYOUTS),
                    choices=range(1, len(_cgcount.LAYOUTS) + 1),
                    help="heap layouts each side is counted under (one child each)")
    ap.add_argument("--verbose", action="store_true", help="keep vLLM's INFO logs")
    _docs.add_arguments(ap, "scheduler")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--layout", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if _docs.write_saved(ap, args):
        return 0
    quiet(args.verbose)
    if args.child:
        return child_instructions(args)

    import vllm

    print(f"vLLM {vllm.__version__} Scheduler.schedule + update_from_output, no model; "
          f"KV groups: full attention + Mamba (align), block {BLOCK_SIZE}, pool "
          f"{args.num_blocks} blocks, prefix caching on; ngram spec decode k={args.k} "
          f"(ragged acceptance); {RUNNING} running of {args.requests} requests, budget "
          f"{MAX_BATCHED} tokens/step; warm-up {args.warmup} steps; plugin on = "
          f"activate(KVGUARD=1)")
    rows = []
    instr = None
    if not args.no_instructions:
        why = _cgcount.available()
        if why:
            print(f"instructions: not counted ({why})")
        else:
            t0 = time.monotonic()
            instr = instructions(args)
            s = instr["summary"]
            off, on = statistics.fmean(instr["off"]), statistics.fmean(instr["on"])
            per = [b / a for a, b in zip(instr["off"], instr["on"])]
            print(f"instructions: callgrind, {args.instr_steps} steps after the warm-up, "
                  f"each side in its own child under {len(per)} heap layout(s) "
                  f"({time.monotonic() - t0:.0f} s); by the end of those steps: "
                  f"{s['steps']} steps, {s['tokens']} tokens scheduled, {s['drafts']} drafts "
                  f"/ {s['accepted']} accepted, {s['admitted']} admitted, {s['finished']} "
                  f"finished, {s['preempted']} preempted, {s['running']} running; "
                  f"identical work off/on")
            rows.append(("instructions/step", f"{off:,.0f}", f"{on:,.0f}", on / off,
                         "exact per layout; per-layout ratios " +
                         " ".join(f"{r:.4f}" for r in per)))
            if args.floor:
                floor = statistics.fmean(instr["floor"])
                rows.append(("floor: pass-through", f"{off:,.0f}", f"{floor:,.0f}", floor / off,
                             "on/off of the floor side; per layout " + " ".join(
                                 f"{b / a:.4f}" for a, b in zip(instr["off"], instr["floor"]))))
    if not args.no_cpu:
        sample(False, args, args.steps)                        # warm both paths
        sample(True, args, args.steps)
        ratios, off_t, on_t, summ = [], [], [], None
        for r in range(args.pairs):
            order = (False, True) if r % 2 == 0 else (True, False)
            res = {}
            for on in order:
                res[on] = sample(on, args, args.steps)
            if res[False][1]["digest"] != res[True][1]["digest"]:
                raise RuntimeError("off and on scheduled different work")
            summ = res[False][1]
            off_t.append(res[False][0] / args.steps)
            on_t.append(res[True][0] / args.steps)
            ratios.append(res[True][0] / res[False][0])
        q = statistics.quantiles(ratios, n=4) if len(ratios) >= 2 else [ratios[0]] * 3
        print(f"CPU time: {args.pairs} interleaved off/on pairs of {args.steps} steps each "
              f"(time.process_time); per sample: {summ['tokens']} tokens, {summ['drafts']} "
              f"drafts / {summ['accepted']} accepted, {summ['admitted']} admitted, "
              f"{summ['finished']} finished, {summ['preempted']} preempted, "
              f"{summ['running']} running at the end")
        rows.append(("CPU ms/step (median)", f"{statistics.median(off_t) * 1e3:.2f}",
                     f"{statistics.median(on_t) * 1e3:.2f}", statistics.median(ratios),
                     f"pairs min {min(ratios):.3f} / IQR {q[0]:.3f}-{q[2]:.3f} / "
                     f"max {max(ratios):.3f}"))
    if rows:
        print(f"{'':22} {'off':>12} {'on':>12} {'on/off':>8}  spread")
        for name, off, on, ratio, spread in rows:
            print(f"{name:22} {off:>12} {on:>12} {ratio:8.4f}  {spread}")
    if instr is not None:
        ratio = statistics.fmean(instr["on"]) / statistics.fmean(instr["off"])
        verdict = "PASS" if ratio <= TARGET else "MISS"
        print(f"{verdict}: scheduler step with the plugin at {1 / ratio:.4f}x the unpatched "
              f"step in instructions (on/off {ratio:.4f}; target on/off <= {TARGET})")
        rec = _docs.record(
            "scheduler", vllm.__version__, instr["layouts"], {"step": ratio}, TARGET,
            per_layout={"step": [b / a for a, b in zip(instr["off"], instr["on"])]},
            command=f"bench_scheduler.py --no-cpu --layouts {len(instr['layouts'])} "
                    f"--instr-steps {args.instr_steps}")
        _docs.save(args, rec)
        if "floor" in instr:
            off, on = statistics.fmean(instr["off"]), statistics.fmean(instr["on"])
            floor = statistics.fmean(instr["floor"])
            print(f"of on's excess {ratio - 1:.2%}: {floor / off - 1:.2%} is the floor (a "
                  f"pass-through of allocate_slots' signature, the pool seams and the other "
                  f"patches), {(on - floor) / off:.2%} the transaction's record, journal "
                  f"reset and try ({(on - floor) / RUNNING:,.0f} instructions per running "
                  f"request and step)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
