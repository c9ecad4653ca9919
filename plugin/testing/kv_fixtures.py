"""Builders of REAL vLLM scheduler-side KV objects, for tests and benchmarks.

Everything here constructs the installed vLLM's own classes (``KVCacheManager``,
coordinators, single-type managers, ``BlockPool``, ``Request``, ``Scheduler``); nothing is
mocked, so what the allocator fixes are tested and measured on is vLLM's own code. Builders
pass only the keyword arguments the installed vLLM accepts, so they work across the
supported versions.

* :func:`hybrid_manager` - full attention + Mamba groups over one pool, the shape that
  trips vLLM's per-group allocation (align mode when prefix caching is on);
* :func:`make_request` - a ``Request`` with a block hasher, so prefix caching works;
* :func:`state` / :func:`state_diff` - a comparable picture of the manager and pool
  (free-queue order, ref counts, per-request lists and dicts, hashes) to prove a call left
  the state exactly as before;
* :func:`make_scheduler` / :func:`scheduler_step` - a real ``Scheduler`` over the tiny
  Llama config with a hand-sized pool, stepped without a model (empty runner output); the
  builders (with ``accepted``, ``attention_spec``, ``kv_cache_config``) live in
  :mod:`vllm_kvguard.tools.tiny_models`: ``kvguard demo`` runs them without this package.
"""
from __future__ import annotations

import itertools
from typing import Any

import torch

from vllm_kvguard.tools.tiny_models import BLOCK_SIZE, accepted, attention_spec, kv_cache_config
# The real Scheduler builders live with the tool that needs them at run time
# (``kvguard demo``); here for the tests and the self-tests.
from vllm_kvguard.tools.tiny_models import make_scheduler, make_vllm_config  # noqa: F401


# ------------------------------------------------------------------------- specs & managers
def mamba_spec(block_size: int = BLOCK_SIZE, mode: str = "align", nsb: int = 0,
               checkpoint: int | None = 1):
    """A ``MambaSpec``. ``checkpoint``: the prefill-checkpoint alignment vLLM 0.32+'s
    Mamba2 and GDN layers set (``num_prefill_checkpoint_blocks=1``; Mamba2: alignment 1),
    None for none (Mamba1); ignored where the field does not exist (0.27.1)."""
    from vllm.v1 import kv_cache_interface as kci

    extra = {} if checkpoint is None else dict(
        num_prefill_checkpoint_blocks=1, prefill_checkpoint_alignment=checkpoint)
    return kci.MambaSpec(**accepted(kci.MambaSpec, dict(
        block_size=block_size, shapes=((4, 8),), dtypes=(torch.bfloat16,),
        mamba_cache_mode=mode, num_speculative_blocks=nsb, **extra)))


def make_manager(specs, *, num_blocks: int, max_model_len: int = 1024,
                 enable_caching: bool = True, block_size: int | None = None, **extra):
    """A real ``KVCacheManager`` with one KV-cache group per spec over one pool;
    ``extra``: more of its keyword arguments (``metrics_collector``)."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    bs = block_size or specs[0].block_size
    kwargs = dict(kv_cache_config=kv_cache_config(specs, num_blocks),
                  max_model_len=max_model_len, scheduler_block_size=bs, hash_block_size=bs,
                  max_in_flight_tokens=max_model_len, enable_caching=enable_caching, **extra)
    return KVCacheManager(**accepted(KVCacheManager.__init__, kwargs))


def hybrid_manager(num_blocks: int, *, enable_caching: bool = True, nsb: int = 0,
                   mamba_mode: str | None = None, block_size: int = BLOCK_SIZE,
                   max_model_len: int = 1024, mamba_first: bool = False):
    """Full attention + Mamba over one pool. Mamba is in ``align`` mode when prefix caching
    is on and ``none`` otherwise (what vLLM's config picks), unless ``mamba_mode`` says."""
    mode = mamba_mode or ("align" if enable_caching else "none")
    specs = [attention_spec(block_size), mamba_spec(block_size, mode, nsb)]
    if mamba_first:
        specs.reverse()
    return make_manager(specs, num_blocks=num_blocks, max_model_len=max_model_len,
                        enable_caching=enable_caching)


_hash_ready = False


def block_hasher(block_size: int = BLOCK_SIZE):
    global _hash_ready
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    if not _hash_ready:
        init_none_hash(sha256)
        _hash_ready = True
    return get_request_block_hasher(block_size, sha256)


def make_request(rid: str, prompt_token_ids, *, block_size: int = BLOCK_SIZE,
                 max_tokens: int = 1 << 16):
    from vllm import SamplingParams
    from vllm.v1.request import Request

    return Request(**accepted(Request.__init__, dict(
        request_id=rid, prompt_token_ids=list(prompt_token_ids),
        sampling_params=SamplingParams(max_tokens=max_tokens), pooling_params=None,
        eos_token_id=None, block_hasher=block_hasher(block_size))))


def prefill(manager, request, *, lookahead: int = 0, external: int = 0):
    """Admit ``request`` like the scheduler's waiting loop: local prefix hit, then the
    prompt in chunks ending on a block boundary (Mamba align saves a reusable state only
    there). Returns the last ``allocate_slots`` result (None: no room);
    ``request.num_computed_tokens`` follows what was allocated."""
    blocks, hit, _ = manager.get_computed_blocks(request)
    bs = groups(manager)[0].block_size
    start, total = hit + external, request.num_tokens
    cut = (total - 1) // bs * bs
    out = None
    for i, end in enumerate([cut, total] if start < cut < total else [total]):
        if i == 0:
            out = manager.allocate_slots(request, end - start, num_new_computed_tokens=hit,
                                         new_computed_blocks=blocks,
                                         num_lookahead_tokens=lookahead,
                                         num_external_computed_tokens=external)
        else:
            out = manager.allocate_slots(request, end - request.num_computed_tokens,
                                         num_lookahead_tokens=lookahead)
        if out is None:
            return None
        request.num_computed_tokens = end
    return out


def groups(manager):
    return manager.coordinator.single_type_managers


def settle(manager, request) -> None:
    """Apply now what the next ``allocate_slots`` of a running request does first and a
    rollback keeps (as vLLM's own "no room" return does): ``remove_skipped_blocks``."""
    manager.remove_skipped_blocks(request.request_id, request.num_computed_tokens)


def free_ids(manager) -> list[int]:
    """Free-queue block ids in eviction order."""
    return [b.block_id for b in manager.block_pool.free_block_queue.get_all_free_blocks()]


def used_blocks(manager) -> int:
    pool = manager.block_pool
    return pool.num_gpu_blocks - 1 - pool.get_num_free_blocks()


# ------------------------------------------------------------------------- state pictures
_MAMBA_DICTS = ("last_state_block_idx", "_num_retired_blocks", "_checkpoints")


def _ids(blocks):
    return [None if b is None else b.block_id for b in blocks]


def _value(v):
    """Block objects inside a per-request value, as ids (KVCacheBlock compares by fields)."""
    if hasattr(v, "block_id"):
        return ("block", v.block_id)
    if isinstance(v, (tuple, list)):
        return tuple(_value(x) for x in v)
    return v


def state(manager) -> dict[str, Any]:
    """Everything ``allocate_slots`` may change, as plain comparable data."""
    pool = manager.block_pool
    out: dict[str, Any] = {
        "free": free_ids(manager),
        "num_free": pool.get_num_free_blocks(),
        "ref": [b.ref_cnt for b in pool.blocks if not b.is_null],
        "hashes": {b.block_id: (b.block_hash, getattr(b, "block_hash_num_tokens", None))
                   for b in pool.blocks if b.block_hash is not None},
        "extra_hashes": {k: set(v) for k, v in
                         getattr(pool, "cached_block_hashes_by_block", {}).items()},
    }
    for g, m in enumerate(groups(manager)):
        p = f"g{g}."
        # An empty table and none are the same to vLLM (a defaultdict its own "no room"
        # path fills with empty lists), and a rollback cannot always tell them apart.
        out[p + "req_to_blocks"] = {r: _ids(b) for r, b in m.req_to_blocks.items() if b}
        out[p + "num_cached_block"] = dict(m.num_cached_block)
        out[p + "partial_hit"] = {r: _value(v) for r, v in
                                  getattr(m, "_partial_hit_reqs", {}).items()}
        out[p + "pending_cow"] = [_value(v) for v in getattr(m, "_pending_cow_copies", [])]
        out[p + "new_block_ids"] = list(getattr(m, "new_block_ids", []))
        for name in _MAMBA_DICTS + ("_producer_partial_tail_reqs",):
            if hasattr(m, name):
                out[p + name] = {r: _value(v) for r, v in getattr(m, name).items()}
        for name in ("_allocated_block_reqs", "cached_blocks_this_step"):
            if hasattr(m, name):
                out[p + name] = set(getattr(m, name))
        if hasattr(m, "_pending_boundary_state_offloads"):
            out[p + "offloads"] = [_value(v) for v in m._pending_boundary_state_offloads]
    return out


#: What vLLM itself leaves changed when allocate_slots returns None at its capacity check
#: (the Mamba predictor's per-attempt checkpoint) or only defers a same-step hit.
AS_VLLM_LEAVES_THEM = ("_checkpoints", "cached_blocks_this_step")


def state_diff(before: dict, after: dict, *, hashes_may_shrink: bool = True,
               ignore=AS_VLLM_LEAVES_THEM) -> list[str]:
    """Differences between two :func:`state` pictures (empty: identical).

    With ``hashes_may_shrink`` the prefix cache may have *forgotten* hashes (what a
    rollback cannot undo) but must not have gained or changed any. Keys ending in a name
    of ``ignore`` are skipped.
    """
    diffs = []
    for key in sorted(set(before) | set(after)):
        if any(key.endswith(name) for name in ignore):
            continue
        a, b = before.get(key), after.get(key)
        if hashes_may_shrink and key == "hashes":
            extra = {k: v for k, v in b.items() if a.get(k) != v}
            if extra:
                diffs.append(f"hashes gained/changed: {extra}")
            continue
        if hashes_may_shrink and key == "extra_hashes":
            for blk, hs in b.items():
                if not hs <= a.get(blk, set()):
                    diffs.append(f"extra hashes gained on block {blk}")
            continue
        if a != b:
            diffs.append(f"{key}: {a!r} -> {b!r}")
    return diffs


_token = itertools.count(7)


def scheduler_step(scheduler, sample_token: int | None = None, finished_recving=None):
    """One ``schedule()`` + ``update_from_output`` with every scheduled request sampling
    one token (no model); ``finished_recving``: request ids whose asynchronous KV load the
    (stand-in) worker reports done. Returns (scheduler_output, engine_core_outputs)."""
    from vllm.v1.outputs import ModelRunnerOutput

    out = scheduler.schedule()
    req_ids = list(out.num_scheduled_tokens)
    sampled = []
    for rid in req_ids:
        req = scheduler.requests[rid]
        done_prefill = req.num_computed_tokens >= req.num_tokens   # already advanced
        sampled.append([sample_token or next(_token) % 900 + 3] if done_prefill else [])
    mro = ModelRunnerOutput(**accepted(ModelRunnerOutput, dict(
        req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=sampled, logprobs=None, prompt_logprobs_dict={},
        pooler_output=[])))
    if finished_recving:
        from vllm.v1.outputs import KVConnectorOutput

        mro.kv_connector_output = KVConnectorOutput(finished_recving=set(finished_recving))
    return out, scheduler.update_from_output(out, mro)
