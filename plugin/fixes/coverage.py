"""CUDA-graph coverage: which decode shapes the engine can reach, which captured graph each
one runs, and (opt-in) capture completion so every reachable uniform decode has a graph.

vLLM pads a batch up to the next captured size and runs that graph; a batch no graph
covers runs eager, silently (vllm-internals.md §C.2-C.3). Worked example from the
defaults: ``max_num_seqs=256`` with 3 draft tokens (query length 4) gives
``max_cudagraph_capture_size = min(256*4*2, 512) = 512``, so every decode step with
129-256 requests runs fully eager (vllm#27325, #50488, #54933, #57355).

Startup audit (:func:`audit`, logged once per KV-cache initialisation)
    From the real config and the runner's own graph keys: for every draft length that can
    occur (the configured one, each dynamic-speculation tier, zero drafts for proposers
    that can miss, each LoRA capture case), the reachable request counts (bounded by
    ``max_num_seqs``, the token budget and how many decoding sequences the KV cache holds,
    :func:`vllm_kvguard.fixes.capacity.compute`) are dispatched through the owner's real
    ``dispatch`` and summarised: coverage, the first uncovered shape, and the exact setting
    that covers it, verified by re-running vLLM's own sizing on a copy of the config.
Capture completion (``KVGUARD_CUDAGRAPH_COMPLETE=1``)
    Before the runner builds attention metadata builders and graph keys (their buffers are
    sized from ``max_cudagraph_capture_size``), extend ``cudagraph_capture_sizes`` with
    vLLM's request-count grid at each draft length up to the widest reachable decode. It
    keeps an explicit user list (unless ``Flags.cudagraph_complete_force``), does nothing
    when every reachable shape is already covered or during profiling runs, and logs the
    number of extra graphs.
Padding target
    Padded block-table rows and Mamba state indices are filled with ``NULL_BLOCK_ID``;
    the scheduler's ``BlockPool`` reserves that block and never hands it out. Both sides
    are checked (worker: after KV init and after wake-up; scheduler: when a pool is built).
No runtime capture in V2
    Model runner V2 never calls ``set_cudagraph_capturing_enabled(False)`` after
    ``capture_model`` (V1 does), so a key mismatch would capture a new graph under load.
    We disable it after every non-profile capture and re-enable it around the next one.
"""
from __future__ import annotations

import copy
import logging
import sys
from dataclasses import dataclass, field

from vllm_kvguard.hookspecs import hookimpl
from vllm_kvguard.log import logger, once

#: Proposers that may propose nothing for a request (a miss), so a decode step can carry
#: zero drafts for every request: a uniform batch at query length 1.
NO_DRAFT_METHODS = frozenset({"ngram", "ngram_gpu", "suffix"})


def _modes():
    from vllm.config import CUDAGraphMode

    return CUDAGraphMode


# ----------------------------------------------------------------------------- owners
class GraphOwner:
    """The object that maps batches to graphs: V1 ``CudagraphDispatcher`` or V2
    ``CudaGraphManager``, seen through one small interface."""

    kind = ""

    def __init__(self, obj, vllm_config):
        self.obj = obj
        self.vllm_config = vllm_config

    @property
    def mode(self):
        return self.obj.cudagraph_mode

    @property
    def max_capture_size(self) -> int:
        return int(self.vllm_config.compilation_config.max_cudagraph_capture_size or 0)

    def intended(self):
        """The mode a uniform decode batch is meant to run (NONE: no graphs at all)."""
        return self.mode.decode_mode()

    def query_lens(self) -> list[int]:
        raise NotImplementedError

    def lora_cases(self) -> list[int]:
        raise NotImplementedError

    def probe(self, num_reqs: int, q: int, lora: int = 0):
        """``(mode, padded tokens)`` the owner's own ``dispatch`` picks for a uniform
        decode of ``num_reqs`` requests x ``q`` tokens (never counted as a fallback)."""
        raise NotImplementedError

    def num_graphs(self) -> int:
        raise NotImplementedError


class V1Owner(GraphOwner):
    kind = "V1"

    def query_lens(self) -> list[int]:
        return [int(self.obj.uniform_decode_query_len)]

    def lora_cases(self) -> list[int]:
        if self.mode == _modes().NONE or not hasattr(self.obj, "_get_lora_cases"):
            return [0]
        return sorted(set([0] + list(self.obj._get_lora_cases())))

    def probe(self, num_reqs: int, q: int, lora: int = 0):
        uq = self.obj.uniform_decode_query_len
        mode, desc = type(self.obj).dispatch(self.obj, num_reqs * q, uniform_decode=(q == uq),
                                             has_lora=lora > 0, num_active_loras=lora)
        return mode, int(desc.num_tokens)

    def num_graphs(self) -> int:
        return sum(len(keys) for keys in self.obj.cudagraph_keys.values())


class V2Owner(GraphOwner):
    kind = "V2"

    def query_lens(self) -> list[int]:
        qs = {d.uniform_token_count for descs in self.obj._capture_descs.values()
              for d in descs if getattr(d, "uniform_token_count", None)}
        return sorted(qs) or [int(self.obj.decode_query_len)]

    def lora_cases(self) -> list[int]:
        return sorted(set([0] + list(getattr(self.obj, "lora_capture_cases", None) or [0])))

    def probe(self, num_reqs: int, q: int, lora: int = 0):
        obj = self.obj
        kwargs = {"max_query_len": q} if _v2_takes_max_query_len(type(obj)) else {}
        from vllm_kvguard.fixes.fallbacks import quiet

        captured = obj._graphs_captured
        obj._graphs_captured = True          # dispatch answers only once graphs exist
        try:
            with quiet():
                desc = type(obj).dispatch(obj, num_reqs, num_reqs * q, q, lora, **kwargs)
        finally:
            obj._graphs_captured = captured
        return desc.cg_mode, int(desc.num_tokens)

    def num_graphs(self) -> int:
        return sum(len(descs) for descs in self.obj._capture_descs.values())


def _v2_takes_max_query_len(cls) -> bool:
    import inspect

    try:
        return "max_query_len" in inspect.signature(cls.dispatch).parameters
    except (TypeError, ValueError):
        return False


def owner_of(runner) -> GraphOwner | None:
    """The graph owner of a model runner (V2 ``cudagraph_manager`` or V1
    ``cudagraph_dispatcher``), or None when it has none (yet)."""
    obj = getattr(runner, "cudagraph_manager", None)
    if obj is not None and hasattr(obj, "_candidates"):
        return V2Owner(obj, runner.vllm_config)
    obj = getattr(runner, "cudagraph_dispatcher", None)
    if obj is not None and hasattr(obj, "cudagraph_keys"):
        return V1Owner(obj, runner.vllm_config)
    return None


def is_v2_runner(runner) -> bool:
    """Model runner V2 (``vllm.v1.worker.gpu.model_runner``) rather than V1."""
    flag = getattr(runner, "kvguard_runner_v2", None)       # the offline planner's stand-in
    if isinstance(flag, bool):
        return flag
    return type(runner).__module__.startswith("vllm.v1.worker.gpu.")


def v1_probe(vllm_config, mode, q: int) -> V1Owner:
    """A fresh ``CudagraphDispatcher`` with keys for the current capture sizes."""
    from vllm.v1.cudagraph_dispatcher import CudagraphDispatcher

    d = CudagraphDispatcher(vllm_config)
    d.initialize_cudagraph_keys(mode, q)
    return V1Owner(d, vllm_config)


def v2_probe(vllm_config, mode, decode_query_len: int, lora_capture_cases=None,
             varlen_decode: bool = False, cls=None) -> V2Owner:
    """A ``CudaGraphManager`` with candidates for the current capture sizes, built without
    its ``__init__`` (which needs an initialised pipeline group and a graph pool): only the
    attributes ``_init_candidates`` and ``dispatch`` read. The unit tests check it against
    the real ``__init__`` on every pinned version."""
    if cls is None:
        from vllm.v1.worker.gpu.cudagraph_utils import CudaGraphManager as cls
    m = cls.__new__(cls)
    pc = vllm_config.parallel_config
    attrs = dict(
        vllm_config=vllm_config, device=None,
        max_num_reqs=vllm_config.scheduler_config.max_num_seqs,
        compilation_config=vllm_config.compilation_config, cudagraph_mode=mode,
        decode_query_len=decode_query_len, varlen_decode=varlen_decode, ubatch_runner=None,
        dp_size=pc.data_parallel_size, tp_size=pc.tensor_parallel_size,
        is_first_pp_rank=True, is_last_pp_rank=True,
        lora_capture_cases=list(lora_capture_cases or [0]), graphs={}, pool=None,
        _graphs_captured=False, _max_full_descs_to_capture=None, _capture_mem_samples=None,
        _candidates={}, _capture_descs={}, use_breakable_cg=False, breakable_cg_runner=None)
    for name, value in attrs.items():
        if not isinstance(getattr(cls, name, None), property):
            setattr(m, name, value)
    if hasattr(m, "_build_lora_dispatch_map"):
        m._lora_dispatch_map, m._max_lora_case = m._build_lora_dispatch_map()
    m._init_candidates()
    return V2Owner(m, vllm_config)


# ----------------------------------------------------------------------------- families
@dataclass(frozen=True)
class Family:
    """One draft length (and LoRA case): uniform decode steps of ``lo..hi`` requests x
    ``q`` tokens each."""

    q: int
    lo: int
    hi: int
    lora: int = 0
    no_draft: bool = False      # zero-draft steps of a proposer that can miss
    limit: str = ""             # what bounds ``hi``

    @property
    def drafts(self) -> int:
        return self.q - 1


def _token_budget(vllm_config) -> int:
    sc = vllm_config.scheduler_config
    return int(getattr(sc, "max_num_scheduled_tokens", None) or sc.max_num_batched_tokens)


def _num_spec(vllm_config) -> int:
    sc = getattr(vllm_config, "speculative_config", None)
    return int(getattr(sc, "num_speculative_tokens", 0) or 0) if sc is not None else 0


def _dynamic_tiers(vllm_config, base_q: int) -> list[tuple[int, int, int]] | None:
    """``(q, first, last batch size)`` per dynamic-speculation tier, or None."""
    sc = getattr(vllm_config, "speculative_config", None)
    uses = getattr(sc, "uses_dynamic_speculative_decoding", None)
    if sc is None or not callable(uses) or not uses():
        return None
    from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup

    k = _num_spec(vllm_config)
    max_seqs = int(vllm_config.scheduler_config.max_num_seqs)
    dense = build_dynamic_sd_schedule_lookup(sc.num_speculative_tokens_per_batch_size,
                                             vllm_max_batch_size=max_seqs,
                                             vllm_num_speculative_tokens=k)
    sampled = max(1, base_q - k)
    tiers: list[tuple[int, int, int]] = []
    for bs in range(1, max_seqs + 1):
        q = dense[bs] + sampled
        if tiers and tiers[-1][0] == q and tiers[-1][2] == bs - 1:
            tiers[-1] = (q, tiers[-1][1], bs)
        else:
            tiers.append((q, bs, bs))
    return tiers


def decode_families(vllm_config, owner: GraphOwner, kv_decodes: int | None) -> list[Family]:
    """Every uniform decode family the engine can reach, bounded by ``max_num_seqs``, the
    token budget and ``kv_decodes`` (decoding sequences the KV cache holds, None: unknown)."""
    max_seqs = int(vllm_config.scheduler_config.max_num_seqs)
    budget = _token_budget(vllm_config)
    base_q = max(owner.query_lens())
    tiers = _dynamic_tiers(vllm_config, base_q) or [(base_q, 1, max_seqs)]
    spec = getattr(vllm_config, "speculative_config", None)
    method = getattr(spec, "method", None)
    no_draft = _num_spec(vllm_config) > 0 and method in NO_DRAFT_METHODS
    rows = [(q, lo, hi, False) for q, lo, hi in tiers]
    if no_draft and all(q != 1 for q, _, _ in tiers):
        rows.append((1, 1, max_seqs, True))
    families = []
    for lora in owner.lora_cases():
        for q, lo, hi, nd in rows:
            bounds = [(hi, "tier" if len(tiers) > 1 and not nd else "max_num_seqs"),
                      (budget // q, f"token budget {budget}")]
            if kv_decodes is not None:
                bounds.append((kv_decodes, "KV cache"))
            top, limit = min(bounds, key=lambda b: b[0])
            if top >= lo:
                families.append(Family(q, lo, top, lora, nd, limit))
    return families


# ----------------------------------------------------------------------------- coverage
@dataclass
class Segment:
    lo: int
    hi: int
    mode: str
    pad_lo: int
    pad_hi: int


@dataclass
class FamilyCoverage:
    family: Family
    intended: str
    segments: list[Segment] = field(default_factory=list)
    covered: int = 0
    first_gap: int | None = None       # fewest requests with no intended graph
    gap_mode: str = ""
    reason: str = ""
    fix: str = ""
    fix_setting: dict = field(default_factory=dict)   # compilation_config fields that cover it

    @property
    def total(self) -> int:
        return self.family.hi - self.family.lo + 1

    @property
    def ok(self) -> bool:
        return self.first_gap is None

    def uncovered_ranges(self) -> str:
        return ", ".join(f"{s.lo}-{s.hi}" if s.hi > s.lo else f"{s.lo}"
                         for s in self.segments if s.mode != self.intended) or "-"


@dataclass
class Coverage:
    kind: str
    mode: str
    capture_sizes: list[int]
    max_capture_size: int
    max_num_seqs: int
    budget: int
    kv_decodes: int | None
    graphs: int
    rows: list[FamilyCoverage]

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.rows)

    def row(self, q: int, lora: int = 0) -> FamilyCoverage | None:
        return next((r for r in self.rows if r.family.q == q and r.family.lora == lora), None)


def _gap_reason(owner: GraphOwner, fam: Family, n: int) -> str:
    if fam.no_draft:
        return "not_captured_for_draft_length"
    other = [0] if fam.lora else [c for c in owner.lora_cases() if c]
    if any(owner.probe(n, fam.q, c)[0] == owner.intended() for c in other):
        return "lora"                    # the other LoRA case has this graph
    if n * fam.q > owner.max_capture_size:
        return "over_max_capture_size"
    return "not_captured_for_draft_length"


def cover(owner: GraphOwner, families: list[Family]) -> list[FamilyCoverage]:
    """Dispatch every reachable shape through the owner and summarise per family."""
    intended = owner.intended()
    out = []
    for fam in families:
        fc = FamilyCoverage(fam, intended.name)
        for n in range(fam.lo, fam.hi + 1):
            mode, padded = owner.probe(n, fam.q, fam.lora)
            seg = fc.segments[-1] if fc.segments else None
            if seg is not None and seg.mode == mode.name:
                seg.hi, seg.pad_hi = n, padded
            else:
                fc.segments.append(Segment(n, n, mode.name, padded, padded))
            if mode == intended:
                fc.covered += 1
            elif fc.first_gap is None:
                fc.first_gap, fc.gap_mode = n, mode.name
        if fc.first_gap is not None:
            fc.reason = _gap_reason(owner, fam, fc.first_gap)
        out.append(fc)
    return out


def audit(owner: GraphOwner, kv_decodes: int | None = None,
          suggest: bool = True) -> Coverage:
    """The coverage of every reachable uniform decode on ``owner`` (keys already built)."""
    vc = owner.vllm_config
    cc = vc.compilation_config
    families = decode_families(vc, owner, kv_decodes) if owner.mode != _modes().NONE else []
    rows = cover(owner, families)
    cov = Coverage(owner.kind, owner.mode.name, sorted(cc.cudagraph_capture_sizes or []),
                   owner.max_capture_size, int(vc.scheduler_config.max_num_seqs),
                   _token_budget(vc), kv_decodes, owner.num_graphs(), rows)
    if suggest:
        for r in rows:
            if not r.ok:
                r.fix, r.fix_setting = suggest_fix(owner, r)
    return cov


def kv_decodes_of(vllm_config, kv_cache_config) -> int | None:
    """Decoding sequences the KV cache holds at once (reserved-block model), or None."""
    if kv_cache_config is None:
        return None
    try:
        from vllm_kvguard.fixes import capacity

        return int(capacity.compute(vllm_config, kv_cache_config).decodes_that_fit)
    except Exception as exc:      # an unknown spec type: do not bound by KV
        logger.debug("vllm-kvguard: KV decode capacity unknown (%s: %s)", type(exc).__name__, exc)
        return None


# ----------------------------------------------------------------------------- settings
def _shadow(vllm_config):
    """A copy of ``vllm_config`` whose compilation config can be re-sized freely."""
    shadow = copy.copy(vllm_config)
    object.__setattr__(shadow, "compilation_config", copy.copy(vllm_config.compilation_config))
    return shadow


def vllm_sizes(vllm_config, max_size: int | None, sizes: list[int] | None, *, v2: bool):
    """The capture sizes and max vLLM itself derives for a ``max_cudagraph_capture_size`` /
    ``cudagraph_capture_sizes`` setting (its own ``_set_cudagraph_sizes`` and, for V1 FULL
    decode with drafts, the rounding ``resolve_cudagraph_mode_and_sizes`` applies)."""
    shadow = _shadow(vllm_config)
    cc = shadow.compilation_config
    cc.max_cudagraph_capture_size = max_size
    cc.cudagraph_capture_sizes = None if sizes is None else list(sizes)
    type(shadow)._set_cudagraph_sizes(shadow)
    q = 1 + _num_spec(vllm_config)
    if not v2 and cc.cudagraph_mode.decode_mode() == _modes().FULL and q > 1:
        _adjust_for_spec_decode(cc, q, vllm_config.parallel_config.tensor_parallel_size)
    return sorted(cc.cudagraph_capture_sizes), int(cc.max_cudagraph_capture_size)


def _adjust_for_spec_decode(cc, q: int, tp: int) -> None:
    """``adjust_cudagraph_sizes_for_spec_decode`` (0.27-0.29 also take the TP size)."""
    import inspect

    fn = cc.adjust_cudagraph_sizes_for_spec_decode
    if "tensor_parallel_size" in inspect.signature(fn).parameters:
        fn(q, tp)
    else:
        fn(q)


def _probe_like(owner: GraphOwner, vllm_config) -> GraphOwner:
    """A probe owner of the same kind as ``owner`` for ``vllm_config``'s sizes."""
    if owner.kind == "V1":
        return v1_probe(vllm_config, owner.mode, owner.query_lens()[-1])
    obj = owner.obj
    return v2_probe(vllm_config, owner.mode, int(obj.decode_query_len),
                    getattr(obj, "lora_capture_cases", None),
                    bool(getattr(obj, "varlen_decode", False)), cls=type(obj))


def explicit_sizes(vllm_config, *, v2: bool) -> bool:
    """Whether the capture list is the user's own (not what vLLM derives by default or
    from a bare ``max_cudagraph_capture_size``). Unknown counts as explicit."""
    cc = vllm_config.compilation_config
    current = sorted(cc.cudagraph_capture_sizes or [])
    try:
        for max_size in (None, cc.max_cudagraph_capture_size):
            sizes, _ = vllm_sizes(vllm_config, max_size, None, v2=v2)
            raw, _ = vllm_sizes(vllm_config, max_size, None, v2=True)   # before V1 rounding
            if current in (sizes, raw):
                return False
    except Exception as exc:
        logger.debug("vllm-kvguard: cannot re-derive vLLM's capture sizes (%s)", exc)
    return True


def _covers(owner: GraphOwner, vllm_config, fc: FamilyCoverage) -> bool:
    probe = _probe_like(owner, vllm_config)
    fam = fc.family
    return all(probe.probe(n, fam.q, fam.lora)[0] == probe.intended()
               for n in range(fam.lo, fam.hi + 1))


def suggest_fix(owner: GraphOwner, fc: FamilyCoverage) -> tuple[str, dict]:
    """The exact setting that covers ``fc``'s gaps, verified on a copy of the config:
    ``(text, {compilation_config field: value})`` (the dict is empty when no setting
    covers them)."""
    fam = fc.family
    mode = owner.mode
    if fam.no_draft:
        if mode.name == "FULL_DECODE_ONLY":
            return ("zero-draft steps have no decode graph; cudagraph_mode=FULL_AND_PIECEWISE "
                    "runs them PIECEWISE instead of eager", {})
        return "zero-draft steps have no decode graph at this draft length", {}
    if fc.reason == "lora":
        if not fam.lora:
            return ("batches without an active LoRA adapter have no graph: compilation_config "
                    "cudagraph_specialize_lora=true captures them", {})
        return ("LoRA batches miss their graph: keep cudagraph_specialize_lora on and check "
                "max_loras", {})
    vc = owner.vllm_config
    need = fam.hi * fam.q
    v2 = owner.kind == "V2"
    complete = " (or KVGUARD_CUDAGRAPH_COMPLETE=1)"
    current = sorted(vc.compilation_config.cudagraph_capture_sizes or [])
    try:
        if not explicit_sizes(vc, v2=v2):
            step = 16 if need >= 256 else 8
            lcm = step * fam.q // _gcd(step, fam.q)
            for cand in sorted({need, _round_up(need, step), _round_up(need, lcm)}):
                if _covers(owner, _resized(vc, *vllm_sizes(vc, cand, None, v2=v2)), fc):
                    return (f"compilation_config max_cudagraph_capture_size={cand}{complete}",
                            {"max_cudagraph_capture_size": cand})
        extra = completion_sizes(fc, current)
        sizes = sorted(set(current) | set(extra))
        if _covers(owner, _resized(vc, sizes, sizes[-1]), fc):
            return (f"compilation_config cudagraph_capture_sizes=<the current {len(current)} "
                    f"sizes plus {_short(extra)}>{complete}", {"cudagraph_capture_sizes": sizes})
    except Exception as exc:
        logger.debug("vllm-kvguard: no verified fix (%s: %s)", type(exc).__name__, exc)
    return f"capture sizes up to {need} tokens at query length {fam.q}{complete}", {}


def _resized(vllm_config, sizes: list[int], max_size: int):
    shadow = _shadow(vllm_config)
    shadow.compilation_config.cudagraph_capture_sizes = list(sizes)
    shadow.compilation_config.max_cudagraph_capture_size = max_size
    return shadow


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _short(sizes: list[int], keep: int = 6) -> str:
    if len(sizes) <= keep:
        return ",".join(map(str, sizes))
    return f"{','.join(map(str, sizes[:3]))},...,{sizes[-1]} ({len(sizes)} sizes)"


# ----------------------------------------------------------------------------- table
def format_table(cov: Coverage, title: str = "vllm-kvguard CUDA-graph coverage") -> str:
    kv = "unknown" if cov.kv_decodes is None else str(cov.kv_decodes)
    sizes = cov.capture_sizes
    size_txt = f"{sizes[0]}..{sizes[-1]} ({len(sizes)} sizes)" if sizes else "none"
    lines = [f"{title} (model runner {cov.kind}, cudagraph_mode={cov.mode}, capture sizes "
             f"{size_txt}, max_num_seqs={cov.max_num_seqs}, token budget={cov.budget}, "
             f"KV holds {kv} decoding sequences, {cov.graphs} graphs):"]
    if not cov.rows:
        lines.append("  no graphs are intended (cudagraph_mode NONE): nothing to cover")
        return "\n".join(lines)
    lines.append(f"  {'drafts':>6} {'q':>3} {'lora':>4} {'requests':>10} {'covered':>9}  "
                 f"{'first uncovered':<24} mapping / fix")
    for r in cov.rows:
        f = r.family
        name = f"{f.drafts}" + ("*" if f.no_draft else "")
        reqs = f"{f.lo}-{f.hi}"
        first = "-" if r.ok else f"{r.first_gap} reqs ({r.first_gap * f.q} tok) {r.gap_mode}"
        mapping = "; ".join(
            f"{s.lo}-{s.hi} {s.mode}" + (f" (pad {s.pad_lo}..{s.pad_hi})" if s.mode != "NONE"
                                          else "") for s in r.segments)
        lines.append(f"  {name:>6} {f.q:>3} {f.lora:>4} {reqs:>10} {r.covered:>4}/{r.total:<4}  "
                     f"{first:<24} {mapping}")
        if not r.ok:
            lines.append(f"  {'':>6} {'':>3} {'':>4} {'':>10} {'':>9}  "
                         f"{'uncovered ' + r.uncovered_ranges():<24} fix: {r.fix} "
                         f"[{r.reason}; requests bounded by {f.limit}]")
    if any(r.family.no_draft for r in cov.rows):
        lines.append("  * zero-draft steps (the proposer missed for every request)")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- completion
def request_grid(max_reqs: int) -> list[int]:
    """vLLM's request-count grid (``_set_cudagraph_sizes``): 1, 2, 4, multiples of 8 below
    256, of 16 from 256, and ``max_reqs`` itself."""
    counts = [n for n in (1, 2, 4) if n <= max_reqs]
    counts += list(range(8, min(max_reqs + 1, 256), 8))
    counts += list(range(256, max_reqs + 1, 16))
    return sorted(set(counts + [max_reqs]))


def completion_sizes(fc: FamilyCoverage, current: list[int]) -> list[int]:
    """Sizes (tokens) to add so every request count from ``fc``'s first gap up to its
    widest reachable decode pads to a captured multiple of its query length."""
    fam = fc.family
    start = fc.first_gap or fam.lo
    have = set(current)
    return sorted({n * fam.q for n in request_grid(fam.hi) if n >= start} - have)


@dataclass
class Completion:
    added: list[int]
    graphs_before: int
    graphs_after: int
    skipped: str = ""

    @property
    def extra_graphs(self) -> int:
        return self.graphs_after - self.graphs_before


def complete(runner, kv_cache_config, *, force: bool = False) -> Completion | None:
    """Extend the capture sizes so every reachable uniform decode has a graph (see module
    docstring). Returns what was done, or None when there are no graphs at all."""
    vc = runner.vllm_config
    cc = vc.compilation_config
    mode = cc.cudagraph_mode
    if mode is None or mode == _modes().NONE or mode.decode_mode() == _modes().NONE:
        return None
    v2 = is_v2_runner(runner)
    if v2:
        owner = v2_probe(vc, mode, int(runner.decode_query_len),
                         getattr(runner, "lora_capture_cases", None),
                         getattr(runner, "adaptive_verification", None) is not None)
    else:
        owner = v1_probe(vc, mode, 1 + _num_spec(vc))
    before = audit(owner, kv_decodes_of(vc, kv_cache_config), suggest=False)
    gaps = [r for r in before.rows if not r.ok and not r.family.no_draft
            and r.reason in ("over_max_capture_size", "not_captured_for_draft_length")
            and r.family.q in owner.query_lens()]
    if not gaps:
        return Completion([], before.graphs, before.graphs,
                          "every reachable uniform decode already has a graph")
    if not force and explicit_sizes(vc, v2=v2):
        return Completion([], before.graphs, before.graphs,
                          "cudagraph_capture_sizes was set explicitly; kept as given")
    current = sorted(cc.cudagraph_capture_sizes or [])
    added = sorted({s for r in gaps for s in completion_sizes(r, current)})
    cc.cudagraph_capture_sizes = sorted(set(current) | set(added))
    cc.max_cudagraph_capture_size = cc.cudagraph_capture_sizes[-1]
    after = _probe_like(owner, vc)
    return Completion(added, before.graphs, after.num_graphs())


# ----------------------------------------------------------------------------- padding
def _null_block_id() -> int | None:
    try:
        from vllm.v1.attention.backends.utils import NULL_BLOCK_ID

        return int(NULL_BLOCK_ID)
    except (ImportError, AttributeError):
        return None


def check_worker_padding() -> list[str]:
    """Problems with the ids the worker pads CUDA-graph rows with (empty: all good)."""
    problems = []
    null_id = _null_block_id()
    if null_id != 0:
        problems.append(f"NULL_BLOCK_ID is {null_id}, not the scheduler's reserved block 0")
    # Modules that pad, checked only if loaded (they import the constant by name).
    for mod_name in ("vllm.v1.worker.gpu_model_runner", "vllm.v1.attention.backends.mamba_attn"):
        mod = sys.modules.get(mod_name)
        value = getattr(mod, "NULL_BLOCK_ID", None) if mod is not None else None
        if value is not None and value != 0:
            problems.append(f"{mod_name}.NULL_BLOCK_ID is {value}: padded rows would not "
                            "point at the reserved null block")
    try:
        from vllm.v1.attention.backends.utils import PAD_SLOT_ID

        if PAD_SLOT_ID >= 0:
            problems.append(f"PAD_SLOT_ID is {PAD_SLOT_ID}: padded tokens would write KV")
    except ImportError:
        pass
    return problems


def check_block_pool(pool) -> list[str]:
    """Problems with the scheduler's null block (empty: block 0 is reserved, never free)."""
    problems = []
    null = getattr(pool, "null_block", None)
    if null is None:
        return ["BlockPool has no null_block"]
    if null.block_id != 0 or pool.blocks[0] is not null:
        problems.append(f"the null block is block {null.block_id}, padding writes block 0")
    if not getattr(null, "is_null", False):
        problems.append("block 0 is not marked is_null")
    if null.prev_free_block is not None or null.next_free_block is not None:
        problems.append("block 0 is linked into the free list: it could be handed out")
    return problems


# ----------------------------------------------------------------------------- hookimpls
def _first_rank() -> bool:
    try:
        from vllm.distributed.parallel_state import is_global_first_rank

        return bool(is_global_first_rank())
    except Exception:
        return True


@hookimpl
def kvguard_cudagraph_before_kv_init(runner, kv_cache_config, is_profiling):
    from vllm_kvguard.activation import flags

    fl = flags()
    if not fl.cudagraph_complete or is_profiling:
        return
    result = complete(runner, kv_cache_config,
                      force=fl.cudagraph_complete_force)
    if result is None:
        return
    if result.skipped:
        logger.info("vllm-kvguard: KVGUARD_CUDAGRAPH_COMPLETE: nothing added (%s)",
                    result.skipped)
        return
    logger.info("vllm-kvguard: KVGUARD_CUDAGRAPH_COMPLETE: %d extra CUDA graphs (%d -> %d) for "
                "capture sizes %s; max_cudagraph_capture_size is now %d. These graphs were not "
                "in the startup memory profile: if capture runs out of memory, lower "
                "gpu_memory_utilization", result.extra_graphs, result.graphs_before,
                result.graphs_after, _short(result.added),
                runner.vllm_config.compilation_config.max_cudagraph_capture_size)


_last: list[Coverage] = []


def last_audit() -> Coverage | None:
    return _last[-1] if _last else None


@hookimpl
def kvguard_cudagraph_after_kv_init(runner, kv_cache_config, is_profiling):
    problems = check_worker_padding()
    if problems:
        once(logging.ERROR, ("padding", tuple(problems)),
             "vllm-kvguard: CUDA-graph padding target check failed: %s. Padded rows may "
             "write live KV blocks; run with enforce_eager=True until this is resolved",
             "; ".join(problems))
    if is_profiling:
        return
    owner = owner_of(runner)
    if owner is None:
        return
    cov = audit(owner, kv_decodes_of(runner.vllm_config, kv_cache_config))
    _last[:] = [cov]
    if not _first_rank():
        return
    level = logging.INFO if cov.ok else logging.WARNING
    logger.log(level, "%s", format_table(cov))


@hookimpl
def kvguard_block_pool_ready(pool):
    problems = check_block_pool(pool)
    if problems:
        once(logging.ERROR, ("null_block", tuple(problems)),
             "vllm-kvguard: the KV pool's null block is not reserved: %s. CUDA-graph padding "
             "writes block 0", "; ".join(problems))


@hookimpl
def kvguard_cudagraph_before_capture(runner, profile_only):
    if is_v2_runner(runner):
        from vllm.compilation import monitor

        monitor.set_cudagraph_capturing_enabled(True)


@hookimpl
def kvguard_cudagraph_captured(runner, profile_only):
    if profile_only or not is_v2_runner(runner):
        return
    from vllm.compilation import monitor

    monitor.set_cudagraph_capturing_enabled(False)
    once(logging.INFO, ("v2_capture_lock",),
         "vllm-kvguard: model runner V2 capture done; further CUDA-graph capture is disabled "
         "(as model runner V1 does), so a dispatch/capture key mismatch raises instead of "
         "capturing under load")


@hookimpl
def kvguard_cudagraph_reinit(worker, phase, error):
    if phase == "resume" and error is None:
        problems = check_worker_padding()
        if problems:
            once(logging.ERROR, ("padding_resume", tuple(problems)),
                 "vllm-kvguard: after wake-up the CUDA-graph padding target check failed: %s",
                 "; ".join(problems))


# ----------------------------------------------------------------------------- planner
def plan_config(model: str | None = None, *, cudagraph_mode: str = "FULL_DECODE_ONLY",
                runner: str = "v1", min_cg_support: str = "ALWAYS", **engine_kwargs):
    """A real ``VllmConfig`` sized as vLLM sizes it on a (non-Blackwell) CUDA GPU, built on
    any machine: ``EngineArgs(...).create_engine_config()``, then the CUDA-graph sizing the
    CPU platform skips (vLLM's own ``_set_cudagraph_sizes`` and, as the runner does,
    ``resolve_cudagraph_mode_and_sizes``). ``engine_kwargs`` are ``EngineArgs`` fields
    (``max_num_seqs``, ``speculative_config``, ``compilation_config`` with capture sizes...).
    Used by the offline planner (``python -m vllm_kvguard.fixes.coverage``), the tests and
    the dispatch benchmark."""
    from vllm.config import CompilationMode
    from vllm.engine.arg_utils import EngineArgs

    from vllm_kvguard.tools.tiny_models import write_model

    user_cc = dict(engine_kwargs.pop("compilation_config", None) or {})
    if model is None:
        model = _TINY.get("llama") or _TINY.setdefault("llama", write_model("llama"))
    kw = dict(model=model, load_format="dummy",
              skip_tokenizer_init=True, dtype="bfloat16", max_model_len=2048)
    kw.update(engine_kwargs)
    with _some_platform():
        vc = EngineArgs(**kw).create_engine_config()
    cc = vc.compilation_config
    mode = getattr(_modes(), cudagraph_mode)
    cc.cudagraph_mode = mode
    cc.cudagraph_capture_sizes = user_cc.get("cudagraph_capture_sizes")
    cc.max_cudagraph_capture_size = user_cc.get("max_cudagraph_capture_size")
    if "cudagraph_specialize_lora" in user_cc:
        cc.cudagraph_specialize_lora = user_cc["cudagraph_specialize_lora"]
    if mode.requires_piecewise_compilation():
        cc.mode = CompilationMode.VLLM_COMPILE
        cc.splitting_ops = list(type(cc)._attention_ops)
        cc.use_inductor_graph_partition = False
    object.__setattr__(vc.model_config, "enforce_eager", False)
    type(vc)._set_cudagraph_sizes(vc)
    from vllm.v1.attention.backend import AttentionCGSupport

    cc.resolve_cudagraph_mode_and_sizes(getattr(AttentionCGSupport, min_cg_support),
                                        "FLASH_ATTN", 1 + _num_spec(vc),
                                        use_v2_model_runner=(runner == "v2"))
    return vc


_TINY: dict[str, str] = {}        # one tiny model config per process


class _some_platform:
    """Build configs with vLLM's CPU platform class where vLLM detects no platform (a CUDA
    wheel on a machine without a GPU): only the config's device fields depend on it; the
    CUDA-graph sizing is applied afterwards as on a GPU. vLLM modules import
    ``current_platform`` by name, so each loaded module's binding is swapped and restored."""

    def __enter__(self):
        import vllm.platforms as platforms

        self.saved = None
        if getattr(platforms.current_platform, "device_type", "cpu"):
            return self
        from vllm.platforms.cpu import CpuPlatform

        self.saved, self.stand_in = platforms._current_platform, CpuPlatform()
        platforms._current_platform = self.stand_in
        self._swap(self.saved, self.stand_in)
        return self

    def __exit__(self, *exc):
        if self.saved is not None:
            import vllm.platforms as platforms

            platforms._current_platform = self.saved
            self._swap(self.stand_in, self.saved)
        return False

    @staticmethod
    def _swap(old, new) -> None:
        for name, mod in list(sys.modules.items()):
            if name.startswith("vllm.") and getattr(mod, "current_platform", None) is old:
                mod.current_platform = new


def plan_owner(vllm_config, runner: str = "v1") -> GraphOwner:
    """The runner's graph owner for a :func:`plan_config` config (keys built, no capture)."""
    mode = vllm_config.compilation_config.cudagraph_mode
    q = 1 + _num_spec(vllm_config)
    if runner == "v2":
        return v2_probe(vllm_config, mode, q)
    return v1_probe(vllm_config, mode, q)


def main(argv: list[str] | None = None) -> int:
    """Offline planner: print the coverage table a GPU engine with these settings would log.

    python -m vllm_kvguard.fixes.coverage --max-num-seqs 256 --num-speculative-tokens 3
    """
    import argparse
    import json

    p = argparse.ArgumentParser(prog="python -m vllm_kvguard.fixes.coverage",
                                description=main.__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model dir (default: a tiny Llama config)")
    p.add_argument("--runner", choices=("v1", "v2"), default="v1")
    p.add_argument("--cudagraph-mode", default="FULL_AND_PIECEWISE",
                   choices=("FULL_DECODE_ONLY", "FULL_AND_PIECEWISE", "PIECEWISE", "FULL"))
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--num-speculative-tokens", type=int, default=0)
    p.add_argument("--spec-method", default="ngram")
    p.add_argument("--compilation-config", default="{}", help="JSON, as vLLM's flag")
    p.add_argument("--complete", action="store_true", help="show KVGUARD_CUDAGRAPH_COMPLETE")
    a = p.parse_args(argv)
    kw = dict(max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens,
              compilation_config=json.loads(a.compilation_config))
    if a.num_speculative_tokens:
        spec = {"method": a.spec_method, "num_speculative_tokens": a.num_speculative_tokens}
        if a.spec_method == "ngram":
            spec["prompt_lookup_max"] = 3
        kw["speculative_config"] = spec
    vc = plan_config(a.model, cudagraph_mode=a.cudagraph_mode, runner=a.runner, **kw)
    owner = plan_owner(vc, a.runner)
    print(format_table(audit(owner)))
    if a.complete:
        runner = PlanRunner(vc, a.runner)
        result = complete(runner, None, force=True)
        if result is not None and not result.skipped:
            print(f"KVGUARD_CUDAGRAPH_COMPLETE=1: +{result.extra_graphs} graphs "
                  f"({_short(result.added)})")
        print(format_table(audit(plan_owner(vc, a.runner)), "after capture completion"))
    return 0


def plan_v1_runner(vllm_config, dp_size: int = 1):
    """A V1 ``GPUModelRunner`` built without ``__init__`` (which needs a GPU), carrying what
    ``_determine_batch_execution_and_padding`` reads and a dispatcher with keys for
    ``vllm_config``: lets tests and the dispatch benchmark run vLLM's own per-step dispatch."""
    from types import SimpleNamespace

    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    runner = GPUModelRunner.__new__(GPUModelRunner)
    parallel = SimpleNamespace(data_parallel_size=dp_size, data_parallel_rank=0,
                               tensor_parallel_size=1)
    runner.__dict__.update(
        vllm_config=SimpleNamespace(parallel_config=parallel,
                                    observability_config=vllm_config.observability_config,
                                    compilation_config=vllm_config.compilation_config,
                                    scheduler_config=vllm_config.scheduler_config),
        parallel_config=parallel, compilation_config=vllm_config.compilation_config,
        model_config=vllm_config.model_config,
        uniform_decode_query_len=1 + _num_spec(vllm_config),
        input_batch=SimpleNamespace(lora_id_to_lora_request={}, num_reqs=0),
        cudagraph_dispatcher=plan_owner(vllm_config).obj)
    return runner


class PlanRunner:
    """Just enough of a model runner for :func:`complete` in the offline planner."""

    def __init__(self, vllm_config, runner: str):
        self.vllm_config = vllm_config
        self.decode_query_len = 1 + _num_spec(vllm_config)
        self.lora_capture_cases = None
        self.kvguard_runner_v2 = runner == "v2"


if __name__ == "__main__":
    sys.exit(main())
