"""The coverage planner: settings that cover a gap, verified, and opt-in capture completion.

:func:`suggest_fix` names the exact ``compilation_config`` setting that covers a family's
uncovered shapes, verified by re-running vLLM's own capture sizing on a copy of the config
and dispatching every shape again. :func:`complete` (``KVGUARD_CUDAGRAPH_COMPLETE``) runs
before the runner builds attention metadata builders and graph keys (their buffers are
sized from ``max_cudagraph_capture_size``) and adds vLLM's request-count grid up to the
widest reachable decode at each draft length. In vLLM's own terms: up to 0.33 as token
sizes (``cudagraph_capture_sizes``); from 0.34, where those are deprecated, as decode
request sizes (``decode_cudagraph_capture_request_sizes``, :mod:`.split_sizing`), with
the recorded token fields re-resolved by vLLM's sizing. It keeps an explicit user list
unless forced, and does nothing when every reachable uniform decode already has a graph.
"""
from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass

from vllm_kvguard.fixes.cudagraph import coverage
from vllm_kvguard.fixes.cudagraph.coverage import Coverage, FamilyCoverage, kv_decodes_of
from vllm_kvguard.fixes.estimation.estimate import num_spec
from vllm_kvguard.fixes.cudagraph import split_sizing as split
from vllm_kvguard.fixes.cudagraph.graph_owners import (GraphOwner, is_v2_runner, modes,
                                                      split_sizing, v1_probe, v2_probe)
from vllm_kvguard.log import logger


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
    q = 1 + num_spec(vllm_config)
    if not v2 and cc.cudagraph_mode.decode_mode() == modes().FULL and q > 1:
        _adjust_for_spec_decode(cc, q, vllm_config.parallel_config.tensor_parallel_size)
    return sorted(cc.cudagraph_capture_sizes), int(cc.max_cudagraph_capture_size)


def _adjust_for_spec_decode(cc, q: int, tp: int) -> None:
    """``adjust_cudagraph_sizes_for_spec_decode`` (0.27-0.29 also take the TP size)."""
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
    if split_sizing(vllm_config):
        return split.explicit(vllm_config)
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
        if split_sizing(vc):
            for setting in split.candidates(vc, fc):
                if _covers(owner, split.resized(vc, setting), fc):
                    return split.fix_text(setting, fam) + complete, setting
            return f"decode graphs up to {fam.hi} requests at query length {fam.q}{complete}", {}
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
                    f"sizes plus {short(extra)}>{complete}", {"cudagraph_capture_sizes": sizes})
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


def short(sizes: list[int], keep: int = 6) -> str:
    if len(sizes) <= keep:
        return ",".join(map(str, sizes))
    return f"{','.join(map(str, sizes[:3]))},...,{sizes[-1]} ({len(sizes)} sizes)"


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
    unit: str = "tokens"        # what ``added`` counts: token sizes, or decode requests (0.34)
    summary: str = ""           # the resulting ceiling, in the release's own terms

    @property
    def extra_graphs(self) -> int:
        return self.graphs_after - self.graphs_before


def audit(owner: GraphOwner, kv_decodes: int | None = None) -> Coverage:
    """:func:`coverage.audit`, with the verified setting that covers each gap."""
    cov = coverage.audit(owner, kv_decodes)
    for r in cov.rows:
        if not r.ok:
            r.fix, r.fix_setting = suggest_fix(owner, r)
    return cov


def complete(runner, kv_cache_config, *, force: bool = False,
             fields=()) -> Completion | None:
    """Extend the capture sizes so every reachable uniform decode has a graph (see the
    module docstring). ``fields``: the patch's declarations of the two config fields
    written (sizes, max size); without them the fields are set directly. Returns what was
    done, or None when there are no graphs at all."""
    vc = runner.vllm_config
    cc = vc.compilation_config
    mode = cc.cudagraph_mode
    if mode is None or mode == modes().NONE or mode.decode_mode() == modes().NONE:
        return None
    v2 = is_v2_runner(runner)
    if v2:
        owner = v2_probe(vc, mode, int(runner.decode_query_len),
                         getattr(runner, "lora_capture_cases", None),
                         getattr(runner, "adaptive_verification", None) is not None)
    else:
        owner = v1_probe(vc, mode, 1 + num_spec(vc))
    before = coverage.audit(owner, kv_decodes_of(vc, kv_cache_config))
    gaps = [r for r in before.rows if not r.ok and not r.family.no_draft
            and r.reason in ("over_max_capture_size", "not_captured_for_draft_length")
            and r.family.q in owner.query_lens()]
    if not gaps:
        return Completion([], before.graphs, before.graphs,
                          "every reachable uniform decode already has a graph")
    if not force and explicit_sizes(vc, v2=v2):
        return Completion([], before.graphs, before.graphs,
                          "cudagraph_capture_sizes was set explicitly; kept as given")
    if split_sizing(vc):
        added, fields_set = split.completion(vc, gaps)
        for name, value in fields_set.items():
            decl = next((f for f in fields if f.attr == name), None)
            if decl is not None:
                decl.set(cc, value)
            else:
                setattr(cc, name, value)
        after = _probe_like(owner, vc)
        return Completion(added, before.graphs, after.num_graphs(), unit="requests",
                          summary=f"decode request sizes now up to "
                                  f"{max(cc.decode_cudagraph_capture_request_sizes)}")
    current = sorted(cc.cudagraph_capture_sizes or [])
    added = sorted({s for r in gaps for s in completion_sizes(r, current)})
    sizes = sorted(set(current) | set(added))
    if fields:
        fields[0].set(cc, sizes)
        fields[1].set(cc, sizes[-1])
    else:
        cc.cudagraph_capture_sizes, cc.max_cudagraph_capture_size = sizes, sizes[-1]
    after = _probe_like(owner, vc)
    return Completion(added, before.graphs, after.num_graphs(),
                      summary=f"max_cudagraph_capture_size is now {sizes[-1]}")

