"""CUDA-graph coverage: which decode shapes the engine can reach and which graph each runs.

vLLM pads a batch up to the next captured size and runs that graph; a batch no graph
covers runs eager, and vLLM says nothing. With ``max_num_seqs=256`` and 3 draft tokens
(query length 4) the default ``max_cudagraph_capture_size`` is ``min(256*4*2, 512) = 512``,
so every decode step of 129-256 requests runs eager.

:func:`audit` takes the real config and an owner's graph keys: for every draft length that
can occur (the configured one, each dynamic-speculation tier, zero drafts for proposers
that can miss, each LoRA capture case) it dispatches every reachable request count
(bounded by ``max_num_seqs``, the token budget and the decoding sequences the KV cache
holds) through the owner's own ``dispatch``, and summarises coverage, the first uncovered
shape and a verified setting that covers it (:mod:`vllm_kvguard.fixes.cudagraph.planner`).
:func:`format_table` is the startup table. The padding-target checks make sure padded rows
point at the scheduler's reserved null block.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field

from vllm_kvguard.fixes.estimation.estimate import num_spec
from vllm_kvguard.fixes.cudagraph.graph_owners import GraphOwner, modes
from vllm_kvguard.log import logger

#: Proposers that may propose nothing for a request (a miss), so a decode step can carry
#: zero drafts for every request: a uniform batch at query length 1.
NO_DRAFT_METHODS = frozenset({"ngram", "ngram_gpu", "suffix"})


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


def token_budget(vllm_config) -> int:
    sc = vllm_config.scheduler_config
    return int(getattr(sc, "max_num_scheduled_tokens", None) or sc.max_num_batched_tokens)


def _dynamic_tiers(vllm_config, base_q: int) -> list[tuple[int, int, int]] | None:
    """``(q, first, last batch size)`` per dynamic-speculation tier, or None."""
    sc = getattr(vllm_config, "speculative_config", None)
    uses = getattr(sc, "uses_dynamic_speculative_decoding", None)
    if sc is None or not callable(uses) or not uses():
        return None
    from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup

    k = num_spec(vllm_config)
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
    budget = token_budget(vllm_config)
    base_q = max(owner.query_lens())
    tiers = _dynamic_tiers(vllm_config, base_q) or [(base_q, 1, max_seqs)]
    spec = getattr(vllm_config, "speculative_config", None)
    method = getattr(spec, "method", None)
    no_draft = num_spec(vllm_config) > 0 and method in NO_DRAFT_METHODS
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
    decode_requests: list[int] | None = None   # 0.34+: decode graph sizes, in requests

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


def audit(owner: GraphOwner, kv_decodes: int | None = None) -> Coverage:
    """The coverage of every reachable uniform decode on ``owner`` (keys already built);
    :func:`vllm_kvguard.fixes.cudagraph.planner.audit` adds the setting that covers each gap."""
    vc = owner.vllm_config
    cc = vc.compilation_config
    families = decode_families(vc, owner, kv_decodes) if owner.mode != modes().NONE else []
    rows = cover(owner, families)
    cov = Coverage(owner.kind, owner.mode.name, sorted(cc.cudagraph_capture_sizes or []),
                   owner.max_capture_size, int(vc.scheduler_config.max_num_seqs),
                   token_budget(vc), kv_decodes, owner.num_graphs(), rows,
                   getattr(cc, "decode_cudagraph_capture_request_sizes", None))
    return cov


def kv_decodes_of(vllm_config, kv_cache_config) -> int | None:
    """Decoding sequences the KV cache holds at once (reserved-block model), or None."""
    if kv_cache_config is None:
        return None
    try:
        from vllm_kvguard.fixes.estimation import capacity

        return int(capacity.compute(vllm_config, kv_cache_config).decodes_that_fit)
    except Exception as exc:      # an unknown spec type: do not bound by KV
        logger.debug("vllm-kvguard: KV decode capacity unknown (%s: %s)", type(exc).__name__, exc)
        return None


# ----------------------------------------------------------------------------- table
def format_table(cov: Coverage, title: str = "vllm-kvguard CUDA-graph coverage") -> str:
    kv = "unknown" if cov.kv_decodes is None else str(cov.kv_decodes)
    sizes = cov.capture_sizes
    size_txt = f"{sizes[0]}..{sizes[-1]} ({len(sizes)} sizes)" if sizes else "none"
    if cov.decode_requests is not None:      # 0.34+: decode graphs are sized in requests
        reqs = sorted(cov.decode_requests)
        size_txt = (f"decode {reqs[0]}..{reqs[-1]} requests ({len(reqs)} sizes)" if reqs
                    else "decode none") + f", tokens {size_txt}"
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
            label = ("not graphed (informational) " if f.no_draft else "uncovered ") + \
                r.uncovered_ranges()
            lines.append(f"  {'':>6} {'':>3} {'':>4} {'':>10} {'':>9}  "
                         f"{label:<24} fix: {r.fix} "
                         f"[{r.reason}; requests bounded by {f.limit}]")
    lines += LEGEND
    if any(r.family.no_draft for r in cov.rows):
        lines.append("  drafts with *: zero-draft steps (the proposer found nothing for any "
                     "request); shown for information, not a problem")
    return "\n".join(lines)


#: What each column of :func:`format_table` means, printed once below it.
LEGEND = [
    "  columns: drafts = draft tokens per request in the step; q = tokens per request "
    "(1 + drafts);",
    "    lora = active LoRA adapters; requests = the batch sizes the engine can reach;",
    "    covered = how many of those batch sizes have their intended graph;",
    "    first uncovered = the smallest batch without it (requests, tokens, the mode it "
    "runs: NONE = eager);",
    "    mapping = batch sizes -> mode, with pad a..b = the graph sizes (tokens) they are "
    "padded up to."]



_last: list[Coverage] = []


def remember(cov: Coverage) -> None:
    """Keep ``cov`` as this process's latest startup audit."""
    _last[:] = [cov]


def last_audit() -> Coverage | None:
    return _last[-1] if _last else None


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

