"""The reserved-block model: what vLLM's scheduler-side allocator holds for one request.

Warmup, profiling, the startup capacity report and the planner all need "how many blocks
does a request of N tokens hold in this KV-cache group", speculative decoding included.
:func:`reserved_blocks` answers it with one pure function per spec type that equals the
managers' own arithmetic (a parity fuzz checks it against the real allocator on every
pin). The null block is counted at pool level (``num_blocks - 1`` usable). Unknown specs
return None; third-party ``kvguard_reserved_blocks`` hookimpls may answer first.
"""
from __future__ import annotations

from typing import NamedTuple

from vllm_kvguard.hookspecs import hookimpl


class Reserved(NamedTuple):
    table: int      # block-table entries, null entries included (len(req_to_blocks[rid]))
    physical: int   # distinct non-null pool blocks the request holds


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _spec_classes() -> dict[str, type]:
    """vLLM's spec classes by name (absent ones are missing from the dict)."""
    global _CLASSES
    if _CLASSES is None:
        from vllm.v1 import kv_cache_interface as kci

        names = ("UniformTypeKVCacheSpecs", "HiSparseHotSpec", "HiSparseResidentSpec",
                 "CircularBufferSpec", "CrossAttentionSpec", "EncoderOnlyAttentionSpec",
                 "MambaSpec", "SlidingWindowSpec", "ChunkedLocalAttentionSpec",
                 "FullAttentionSpec", "AttentionSpec")
        _CLASSES = {n: getattr(kci, n) for n in names if isinstance(getattr(kci, n, None), type)}
    return _CLASSES


_CLASSES: dict[str, type] | None = None


def _is(spec, name: str) -> bool:
    cls = _spec_classes().get(name)
    return cls is not None and isinstance(spec, cls)


def manager_block_size(spec, dcp: int = 1) -> int:
    """The allocation granularity of the group's manager: ``block_size`` x DCP where the
    spec is DCP-sharded. 0.32+: ``spec.dcp_sharded``; 0.29: full attention only
    (``kv_cache_utils.dcp_world_size_for_kv_cache_spec``); 0.27.1: every attention spec."""
    if dcp <= 1 or _is(spec, "MambaSpec"):     # Mamba state is replicated, never sharded
        return spec.block_size
    if hasattr(spec, "dcp_sharded"):
        return spec.block_size * (dcp if spec.dcp_sharded else 1)
    rule = _dcp_rule()
    return spec.block_size * (rule(spec, dcp) if rule is not None else dcp)


def _dcp_rule():
    try:
        from vllm.v1.core import kv_cache_utils
    except Exception:
        return None
    return getattr(kv_cache_utils, "dcp_world_size_for_kv_cache_spec", None)


def reserved_blocks(spec, num_tokens: int, *, num_lookahead_tokens: int = 0,
                    max_model_len: int, num_encoder_tokens: int = 0, dcp: int = 1,
                    num_computed_tokens: int = 0) -> Reserved | None:
    """Blocks the allocator reserves for one request in the group of ``spec``.

    Per spec type (``N`` = ``num_tokens``, ``k`` = lookahead, ``B`` = block size x DCP,
    ``C`` = ``num_computed_tokens``, ``nsb`` = Mamba speculative blocks):

    ==========================  ==========================================================
    full attention (MLA, sink)  ``cdiv(min(N + k, max_model_len), B)``
    sliding window              same table; ``(C - window + 1 - extra) // B`` leading nulls
    chunked local               same table; ``(C // chunk) * chunk // B`` leading nulls
    Mamba none / all            ``cdiv(min(N + k, max_model_len) + bs * nsb, B)``;
                                ``(C - 1) // B`` leading nulls
    Mamba align                 ``cdiv(N, bs) + nsb`` entries, lookahead-free, uncapped;
                                ``1 + nsb`` physical, ``2 + nsb`` entering a new block
    cross-attention             ``cdiv(encoder_len, B)``, static
    circular buffer             one ring block
    ==========================  ==========================================================

    ``num_tokens``: the request's high-water mark (computed + scheduled this step, drafts
    included, at most ``max_model_len``); ``num_lookahead_tokens``: the scheduler's
    lookahead (``VllmConfig.num_lookahead_tokens``: k for EAGLE/draft models, 0 for
    ngram); ``num_encoder_tokens``: encoder length (cross-attention); ``dcp``: decode
    context parallel size; ``num_computed_tokens``: tokens processed before this step.
    """
    names = _spec_classes()
    if "UniformTypeKVCacheSpecs" in names and _is(spec, "UniformTypeKVCacheSpecs"):
        spec = spec.first_spec
    if _is(spec, "HiSparseHotSpec") or _is(spec, "HiSparseResidentSpec"):
        return None
    if _is(spec, "EncoderOnlyAttentionSpec"):
        return None
    if _is(spec, "CircularBufferSpec"):
        return Reserved(1, 1)
    if not (_is(spec, "AttentionSpec") or _is(spec, "MambaSpec")):
        return None
    bsz = manager_block_size(spec, dcp)
    if _is(spec, "CrossAttentionSpec"):
        n = _cdiv(num_encoder_tokens, bsz)
        return Reserved(n, n)
    computed = max(0, num_computed_tokens)
    if _is(spec, "MambaSpec"):
        nsb = getattr(spec, "num_speculative_blocks", 0)
        if spec.mamba_cache_mode == "align":
            # Lookahead-free, uncapped range; interior entries are null, the running
            # state plus nsb speculative blocks are real, and a step that enters a new
            # block keeps the previous state block until the next step frees it.
            table = _cdiv(num_tokens, bsz) + nsb
            crossed = computed > 0 and _cdiv(num_tokens, bsz) > _cdiv(computed, bsz)
            physical = 1 + nsb + int(crossed)
            return Reserved(table, min(table, physical))
        need = min(num_tokens + num_lookahead_tokens, max_model_len) + spec.block_size * nsb
        table = _cdiv(need, bsz)
        skipped = (computed - 1) // bsz if computed > 0 else 0
        return Reserved(table, table - min(skipped, table))
    table = _cdiv(min(num_tokens + num_lookahead_tokens, max_model_len), bsz)
    skipped_tokens = 0
    if _is(spec, "SlidingWindowSpec"):
        skipped_tokens = max(0, computed - spec.sliding_window + 1
                             - getattr(spec, "extra_retained_tokens", 0))
    elif _is(spec, "ChunkedLocalAttentionSpec"):
        skipped_tokens = computed // spec.attention_chunk_size * spec.attention_chunk_size
    # Full attention, MLA, sink and sliding-window-as-full keep every block; R-SWA
    # (full-attention subclass evicting a middle gap) is an upper bound here.
    skipped = min(skipped_tokens // bsz, table)
    return Reserved(table, table - skipped)


def reserved(spec, num_tokens: int, *, num_lookahead_tokens: int = 0, max_model_len: int,
             num_encoder_tokens: int = 0, dcp: int = 1,
             num_computed_tokens: int = 0) -> Reserved | None:
    """What callers use: the ``kvguard_reserved_blocks`` hook (a third-party impl may answer
    for a custom spec first), or :func:`reserved_blocks` when no impl answers."""
    from vllm_kvguard.manager import hook

    kwargs = dict(num_lookahead_tokens=num_lookahead_tokens, max_model_len=max_model_len,
                  num_encoder_tokens=num_encoder_tokens, dcp=dcp,
                  num_computed_tokens=num_computed_tokens)
    result = hook().kvguard_reserved_blocks(spec=spec, num_tokens=num_tokens, **kwargs)
    return result if result is not None else reserved_blocks(spec, num_tokens, **kwargs)


def device_groups(kv_cache_config) -> list:
    """(group index, spec) of every KV-cache group on the device pool (host-resident groups
    left out; a ``UniformTypeKVCacheSpecs`` stands for its first spec)."""
    out = []
    for i, group in enumerate(kv_cache_config.kv_cache_groups):
        if getattr(group, "host_resident", False):
            continue
        spec = group.kv_cache_spec
        if type(spec).__name__ == "UniformTypeKVCacheSpecs":
            spec = spec.first_spec
        out.append((i, spec))
    return out


def num_spec(vllm_config) -> int:
    """Draft tokens per step (``speculative_config.num_speculative_tokens``; 0 without)."""
    sc = getattr(vllm_config, "speculative_config", None)
    return int(getattr(sc, "num_speculative_tokens", 0) or 0) if sc is not None else 0


def dcp_size(vllm_config) -> int:
    """Decode context parallel size (1 without DCP)."""
    return int(getattr(vllm_config.parallel_config, "decode_context_parallel_size", 1) or 1)


def lookahead_tokens(vllm_config) -> int:
    """``VllmConfig.num_lookahead_tokens`` (0.32+), or the scheduler's own rule (0.27.1)."""
    value = getattr(type(vllm_config), "num_lookahead_tokens", None)
    if value is not None:
        return int(vllm_config.num_lookahead_tokens)
    sc = getattr(vllm_config, "speculative_config", None)
    if sc is None:
        return 0
    k = int(getattr(sc, "num_speculative_tokens", 0) or 0)

    def uses(name: str) -> bool:
        fn = getattr(sc, name, None)
        return bool(fn()) if callable(fn) else False

    if uses("use_dflash"):
        return k + 1
    if uses("use_eagle") or uses("uses_draft_model") or uses("use_dspark"):
        return k
    return 0


@hookimpl(trylast=True)
def kvguard_reserved_blocks(spec, num_tokens, num_lookahead_tokens, max_model_len,
                            num_encoder_tokens, dcp, num_computed_tokens):
    return reserved_blocks(spec, num_tokens, num_lookahead_tokens=num_lookahead_tokens,
                           max_model_len=max_model_len, num_encoder_tokens=num_encoder_tokens,
                           dcp=dcp, num_computed_tokens=num_computed_tokens)
