"""Builders for checking the reserved-block model against the installed vLLM's REAL
``KVCacheManager``: one KV-cache group per spec, with the DCP size and the scheduler's
block granularity (LCM of the groups') that :func:`.kv_fixtures.make_manager` does not take,
spec builders that skip where a spec type does not exist in the installed vLLM, and
``held``: the blocks a request holds in one group, as the model's ``Reserved``.
Shared by the estimate parity fuzz, the capacity report and the warmup guard tests.
"""
from __future__ import annotations

import math

import pytest
from vllm.v1 import kv_cache_interface as kci

from vllm_kvguard.fixes.estimation.estimate import Reserved
from vllm_kvguard.testing.kv_fixtures import accepted, attention_spec, kv_cache_config, mamba_spec
from vllm_kvguard.testing.kv_fixtures import make_request as _make_request


def spec_class(name: str):
    cls = getattr(kci, name, None)
    if cls is None:
        pytest.skip(f"{name} does not exist in this vLLM")
    return cls


def spec_full(block_size: int):
    return attention_spec(block_size)


def spec_swa(block_size: int, window: int):
    return attention_spec(block_size, "SlidingWindowSpec", sliding_window=window)


def spec_chunked(block_size: int, chunk: int):
    return attention_spec(block_size, "ChunkedLocalAttentionSpec", attention_chunk_size=chunk)


def spec_cross(block_size: int):
    return attention_spec(block_size, "CrossAttentionSpec")


def spec_mamba(block_size: int, mode: str = "none", nsb: int = 0, checkpoint: int | None = 1):
    spec_class("MambaSpec")
    return mamba_spec(block_size, mode, nsb, checkpoint)


def lag_reason() -> str | None:
    """Why a Mamba align step allocated with the previous one in flight is not modelled
    on this vLLM, or None: vLLM 0.27.1 frees a request's old state blocks only down to the
    first null entry (its ``_remove_blocks_in_range``), so under async scheduling one
    state block per prefill chunk can stay until the request ends; 0.32+ retires them
    (``MambaManager._remove_blocks_in_range``)."""
    from vllm.v1.core.single_type_kv_cache_manager import MambaManager

    if "_remove_blocks_in_range" in vars(MambaManager):
        return None
    return ("this vLLM keeps a Mamba align state block behind every null entry while a step "
            "is in flight (retired from 0.32)")


def make_manager(specs, num_blocks: int, max_model_len: int, *, dcp: int = 1,
                 enable_caching: bool = False, hash_block_size: int | None = None,
                 retention: int | None = None):
    """A real KVCacheManager over ``specs`` (one group each), with a DCP size, the
    scheduler's block granularity (LCM of the groups'), a hash block size (default: that
    granularity) and a prefix-cache retention interval, which kv_fixtures.make_manager
    does not take."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    block_size = math.lcm(*(s.block_size for s in specs))
    kwargs = dict(kv_cache_config=kv_cache_config(specs, num_blocks, retention),
                  max_model_len=max_model_len, scheduler_block_size=block_size,
                  hash_block_size=hash_block_size or block_size,
                  max_in_flight_tokens=max_model_len,
                  enable_caching=enable_caching, dcp_world_size=dcp)
    return KVCacheManager(**accepted(KVCacheManager.__init__, kwargs))


def make_request(rid: str, num_prompt_tokens: int):
    return _make_request(rid, range(num_prompt_tokens), max_tokens=1 << 20)


def allocate(manager, request, num_new_tokens: int, *, k: int = 0, encoder: int = 0):
    kwargs = dict(num_lookahead_tokens=k)
    if encoder:
        kwargs["num_encoder_tokens"] = encoder
    return manager.allocate_slots(request, num_new_tokens, **kwargs)


def held(manager, rid: str, group: int = 0) -> Reserved:
    blocks = manager.coordinator.single_type_managers[group].req_to_blocks.get(rid, [])
    real = [b.block_id for b in blocks if not b.is_null]
    assert len(real) == len(set(real)), "a block twice in one request"
    return Reserved(len(blocks), len(real))
