"""The reserved-block model: what vLLM's scheduler-side allocator holds for one request.

Warmup, profiling, the startup capacity report and the planner all need "how many blocks
does a request of N tokens hold in this KV-cache group", speculative decoding included.
:func:`reserved_blocks` answers it with one pure function per spec type that equals the
managers' own arithmetic (a parity fuzz checks it against the real allocator on every
pin). The null block is counted at pool level (``num_blocks - 1`` usable). Unknown specs
return None; third-party ``kvguard_reserved_blocks`` hookimpls may answer first.
:func:`warmup_block_count` is vLLM's own warmup count (``_reserved_block_count``) answered
by this model, in each pin's signature (0.34: DCP and the per-request row cap).
"""
from __future__ import annotations

from typing import NamedTuple

from vllm_kvguard.hookspecs import hookimpl


class Reserved(NamedTuple):
    table: int      # block-table entries, null entries included (len(req_to_blocks[rid]))
    physical: int   # distinct non-null pool blocks the request holds


class Checkpointing(NamedTuple):
    """What decides, besides the spec and the step, whether a Mamba align step reserves a
    prefill checkpoint block (vLLM 0.32+ ``MambaManager._needs_internal_checkpoint``; the
    Mamba2 and GDN layers' specs have one): the block pool's ``hash_block_size`` and
    ``num_hash_lookahead_tokens``, the manager's ``cache_hit_alignment_tokens`` and
    ``drop_eagle_checkpoint_block``; under sparse retention (the coordinator's
    ``retention_interval`` 0, vLLM's engine default) only the step reaching the request's
    prefill end (``max(prompt, num_tokens - 1)``) takes one: ``prefill_end`` (left 0, every
    step may: an upper bound)."""
    hash_block_size: int
    alignment_tokens: int
    hash_lookahead: int = 0
    drop_eagle: bool = False
    sparse: bool = False
    prefill_end: int = 0

    def at(self, prefill_end: int) -> "Checkpointing":
        """These numbers for a request whose prefill ends at ``prefill_end`` (only sparse
        retention reads it)."""
        return self._replace(prefill_end=prefill_end) if self.sparse else self


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
    spec is DCP-sharded. 0.32+: ``spec.dcp_sharded``; 0.27.1: every attention spec."""
    if dcp <= 1 or _is(spec, "MambaSpec"):     # Mamba state is replicated, never sharded
        return spec.block_size
    return spec.block_size * (dcp if getattr(spec, "dcp_sharded", True) else 1)


def reserved_blocks(spec, num_tokens: int, *, num_lookahead_tokens: int = 0,
                    max_model_len: int, num_encoder_tokens: int = 0, dcp: int = 1,
                    num_computed_tokens: int = 0, num_settled_tokens: int | None = None,
                    checkpointing: Checkpointing | None = None,
                    max_blocks_per_req: int | None = None) -> Reserved | None:
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
                                ``nsb`` + the state blocks at or above the settled one
                                (:func:`_align_states`)
    cross-attention             ``cdiv(encoder_len, B)``, static
    circular buffer             one ring block
    ==========================  ==========================================================

    ``num_tokens``: the request's high-water mark (computed + scheduled this step, drafts
    included, at most ``max_model_len``); ``num_lookahead_tokens``: the scheduler's
    lookahead (``VllmConfig.num_lookahead_tokens``: k for EAGLE/draft models, 0 for
    ngram); ``num_encoder_tokens``: encoder length (cross-attention); ``dcp``: decode
    context parallel size; ``num_computed_tokens``: tokens computed before this step (where
    its query starts); ``num_settled_tokens``: of those, the ones whose step has settled
    (vLLM frees on ``num_computed_tokens - num_in_flight_tokens``; default: all; the
    async scheduler's previous step is the one in flight); ``checkpointing``: the
    manager's numbers for a Mamba align prefill checkpoint (default: hash block and
    alignment equal to the spec's block size); ``max_blocks_per_req``: the block-table
    row length vLLM 0.34+ caps attention tables at (:func:`row_cap`; it never binds when
    it is taken at the same DCP size).
    """
    return capped(spec, _reserved_blocks(
        spec, num_tokens, num_lookahead_tokens=num_lookahead_tokens,
        max_model_len=max_model_len, num_encoder_tokens=num_encoder_tokens, dcp=dcp,
        num_computed_tokens=num_computed_tokens, num_settled_tokens=num_settled_tokens,
        checkpointing=checkpointing), max_blocks_per_req)


def _reserved_blocks(spec, num_tokens: int, *, num_lookahead_tokens: int, max_model_len: int,
                     num_encoder_tokens: int, dcp: int, num_computed_tokens: int,
                     num_settled_tokens: int | None = None,
                     checkpointing: Checkpointing | None = None) -> Reserved | None:
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
    start = max(0, num_computed_tokens)
    computed = start if num_settled_tokens is None else max(0, min(num_settled_tokens, start))
    if _is(spec, "MambaSpec"):
        nsb = getattr(spec, "num_speculative_blocks", 0)
        if spec.mamba_cache_mode == "align":
            table = _cdiv(num_tokens, bsz) + nsb
            held = _align_states(spec, bsz, num_tokens, start, computed, checkpointing)
            return Reserved(table, min(table, nsb + held))
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


def _align_states(spec, bsz: int, end: int, start: int, settled: int,
                  checkpointing: Checkpointing | None) -> int:
    """State blocks a Mamba align request holds after the step ``[start, end)`` with
    ``settled`` tokens settled. Each step keeps its running state in the block of its
    last token and, on a prefill checkpoint, one in the block before it; vLLM frees
    every block below the block of the last settled token (``remove_skipped_blocks``:
    ``processed - 1`` tokens skipped, then ``last_state_block_idx``). So what is held:
    this step's blocks, the state the step starts from, and, while the previous step
    ``[settled, start)`` is in flight, that step's checkpoint and the state it started
    from."""
    def state(n: int) -> int:
        return _cdiv(n, bsz) - 1

    held = {state(end)}
    if _checkpoint(spec, bsz, start, end, checkpointing):
        held.add(state(end) - 1)
    if start > 0:
        held.add(state(start))
    if settled < start:
        if settled > 0:
            held.add(state(settled))
        if _checkpoint(spec, bsz, settled, start, checkpointing):
            held.add(state(start) - 1)
    floor = state(settled) if settled > 0 else 0
    return sum(1 for i in held if i >= floor)


def _checkpoint(spec, bsz: int, start: int, end: int,
                checkpointing: Checkpointing | None) -> bool:
    """Whether the Mamba align step ``[start, end)`` reserves a prefill checkpoint block:
    vLLM's own ``get_mamba_prefill_checkpoint_position`` and
    ``is_mamba_prefill_checkpoint_valid`` (0.32+), as ``_needs_internal_checkpoint``
    calls them (0.34 single_type_kv_cache_manager.py 1664-1695, 1756-1768)."""
    if not getattr(spec, "num_prefill_checkpoint_blocks", 0) or end <= start:
        return False
    fns = _checkpoint_functions()
    if fns is None:
        return False
    position, valid, lookahead_kw = fns
    c = checkpointing or Checkpointing(spec.block_size, spec.block_size)
    if (c.sparse and end < c.prefill_end) or _cdiv(end, bsz) - 2 < 0:
        return False
    extra = {"num_hash_lookahead_tokens": c.hash_lookahead} if lookahead_kw else {}
    pos = position(end, c.alignment_tokens, c.drop_eagle, **extra)
    return bool(valid(query_start=start, query_end=end, checkpoint_position=pos,
                      hash_block_size=c.hash_block_size, mamba_block_size=bsz,
                      checkpoint_alignment=getattr(spec, "prefill_checkpoint_alignment",
                                                   None)))


_CHECKPOINT_FNS: tuple | None = None


def _checkpoint_functions():
    """vLLM's two checkpoint functions and whether the first takes the hash lookahead
    (0.33+), or None where this vLLM has no prefill checkpoints (0.27.1)."""
    global _CHECKPOINT_FNS
    if _CHECKPOINT_FNS is None:
        import inspect

        from vllm.v1 import kv_cache_interface as kci

        position = getattr(kci, "get_mamba_prefill_checkpoint_position", None)
        valid = getattr(kci, "is_mamba_prefill_checkpoint_valid", None)
        _CHECKPOINT_FNS = () if position is None or valid is None else (
            position, valid,
            "num_hash_lookahead_tokens" in inspect.signature(position).parameters)
    return _CHECKPOINT_FNS or None


def _uncapped(spec) -> bool:
    """Specs vLLM's warmup count returns before its row cap (Mamba, cross, ring)."""
    if _is(spec, "UniformTypeKVCacheSpecs"):
        spec = spec.first_spec
    return any(_is(spec, n) for n in ("MambaSpec", "CrossAttentionSpec", "CircularBufferSpec"))


def capped(spec, r: Reserved | None, max_blocks_per_req: int | None) -> Reserved | None:
    """``r`` with its table capped at the block-table row (vLLM 0.34+'s warmup rule)."""
    if r is None or max_blocks_per_req is None or _uncapped(spec):
        return r
    table = min(r.table, max_blocks_per_req)
    return Reserved(table, min(r.physical, table))


def row_cap(spec, vllm_config, max_model_len: int) -> int | None:
    """The block-table row length vLLM 0.34+ caps a warmup request's table at
    (``spec.max_num_blocks_per_req``, at the config's DCP size); None where uncapped."""
    if _is(spec, "UniformTypeKVCacheSpecs"):
        spec = spec.first_spec
    fn = getattr(spec, "max_num_blocks_per_req", None)
    if fn is None or vllm_config is None or _uncapped(spec):
        return None
    return int(fn(vllm_config, max_model_len))


def reserved(spec, num_tokens: int, *, num_lookahead_tokens: int = 0, max_model_len: int,
             num_encoder_tokens: int = 0, dcp: int = 1, num_computed_tokens: int = 0,
             num_settled_tokens: int | None = None, checkpointing: Checkpointing | None = None,
             max_blocks_per_req: int | None = None) -> Reserved | None:
    """What callers use: the ``kvguard_reserved_blocks`` hook (a third-party impl may answer
    for a custom spec first), or :func:`reserved_blocks` when no impl answers; capped at
    ``max_blocks_per_req`` either way."""
    from vllm_kvguard.manager import hook

    kwargs = dict(num_lookahead_tokens=num_lookahead_tokens, max_model_len=max_model_len,
                  num_encoder_tokens=num_encoder_tokens, dcp=dcp,
                  num_computed_tokens=num_computed_tokens,
                  num_settled_tokens=num_settled_tokens, checkpointing=checkpointing)
    result = hook().kvguard_reserved_blocks(spec=spec, num_tokens=num_tokens, **kwargs)
    if result is None:
        result = reserved_blocks(spec, num_tokens, **kwargs)
    return capped(spec, result, max_blocks_per_req)


def warmup_block_count(num_tokens: int, kvcache_spec, *, num_lookahead_tokens: int,
                       max_model_len: int, max_encoder_len: int, vllm_config=None,
                       dcp_world_size: int = 1) -> int | None:
    """vLLM's ``_reserved_block_count`` (V2 warmup), answered by :func:`reserved`, in every
    pin's signature: 0.32/0.33 count at the spec's block size with no cap; 0.34 passes
    ``vllm_config`` (the row cap, :func:`row_cap`) and ``dcp_world_size``. Like vLLM, a
    cross-attention table is counted at the spec's block size (the allocator shards it by
    DCP, so vLLM's warmup count is the larger). None for a spec with no model."""
    spec = kvcache_spec
    first = spec.first_spec if _is(spec, "UniformTypeKVCacheSpecs") else spec
    dcp = 1 if _is(first, "CrossAttentionSpec") else int(dcp_world_size or 1)
    r = reserved(spec, num_tokens, num_lookahead_tokens=num_lookahead_tokens,
                 max_model_len=max_model_len, num_encoder_tokens=max_encoder_len or 0,
                 dcp=dcp, num_computed_tokens=0,
                 max_blocks_per_req=row_cap(spec, vllm_config, max_model_len))
    return r.table if r is not None else None


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
                            num_encoder_tokens, dcp, num_computed_tokens, num_settled_tokens,
                            checkpointing):
    return reserved_blocks(spec, num_tokens, num_lookahead_tokens=num_lookahead_tokens,
                           max_model_len=max_model_len, num_encoder_tokens=num_encoder_tokens,
                           dcp=dcp, num_computed_tokens=num_computed_tokens,
                           num_settled_tokens=num_settled_tokens, checkpointing=checkpointing)
