"""Model-runner-V2 kernel warmup: spec-aware, in-bounds and best-effort.

vLLM's V2 warmup hand-builds ``SchedulerOutput``s with dummy requests and block ids it
picks itself. It under-counts speculative blocks on 0.27.1 (vllm#51438), can hand out a
block id beyond the pool on a tight pool (every version: its one-request floor), and a
failing step aborts startup with the dummy requests still held. This fix sizes the
warmup with :func:`~vllm_kvguard.fixes.estimation.estimate.reserved_blocks` (DCP and, as
vLLM 0.34 does, the per-request row cap), rewrites every dummy request's block ids within
the pool (0.34: the blocks warmup may commit, ``num_committable_kv_blocks``), and on a
failed step finishes the dummy requests, restores the connector and block 0, and lets
startup continue with one warning. Each ``_warmup_kernels`` call (0.34 runs a second,
greedy one under drafts) is guarded on its own.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

from vllm_kvguard.fixes.estimation.estimate import lookahead_tokens, reserved, row_cap
from vllm_kvguard.hookspecs import hookimpl
from vllm_kvguard.log import logger, once
from vllm_kvguard.report import count


class NoRoom(RuntimeError):
    """The warmup plan needs more blocks than the pool has (raised before sending)."""


class _Proxy:
    """Delegates every attribute to ``target`` except the ``overrides``."""

    def __init__(self, target, **overrides):
        object.__setattr__(self, "_target", target)
        object.__setattr__(self, "_overrides", overrides)

    def __getattr__(self, name):
        overrides = object.__getattribute__(self, "_overrides")
        if name in overrides:
            return overrides[name]
        return getattr(object.__getattribute__(self, "_target"), name)

    def __setattr__(self, name, value):
        setattr(object.__getattribute__(self, "_target"), name, value)


class _NullConnector:
    def set_disabled(self, disabled):
        pass


class _DryKVCache(_Proxy):
    """An extensible KV cache (0.34+) a dry run may read but not commit."""

    def commit(self, *args, **kwargs):
        pass


def committable_blocks(runner) -> int:
    """The blocks warmup may address: ``num_committable_kv_blocks`` (0.34+: fewer than the
    pool with an extensible KV cache), else the pool's ``num_blocks``."""
    try:
        from vllm.v1.worker.extensible_kv_cache import num_committable_kv_blocks
    except ImportError:
        return int(runner.kv_cache_config.num_blocks)
    return int(num_committable_kv_blocks(runner))


@dataclass
class WarmupPlan:
    """What the pool and the allocator look like to the warmup."""

    specs: list
    num_blocks: int
    lookahead: int
    max_model_len: int
    encoder_len: int = 0
    dcp: int = 1
    caps: list = field(default_factory=list)    # per-request row cap per spec (or None)

    @classmethod
    def of(cls, runner) -> "WarmupPlan":
        kvc = runner.kv_cache_config
        vc = runner.vllm_config
        parallel = getattr(vc, "parallel_config", None)
        specs = [g.kv_cache_spec for g in kvc.kv_cache_groups]
        mml = int(runner.max_model_len)
        return cls(specs=specs, num_blocks=committable_blocks(runner),
                   lookahead=lookahead_tokens(vc), max_model_len=mml,
                   encoder_len=int(getattr(getattr(runner, "model_state", None),
                                           "max_encoder_len", 0) or 0),
                   dcp=int(getattr(parallel, "decode_context_parallel_size", 1) or 1),
                   caps=[_cap(s, vc, mml) for s in specs])

    def tables(self, num_tokens: int, computed: int) -> list[int]:
        out = []
        for i, spec in enumerate(self.specs):
            r = reserved(spec, num_tokens, num_lookahead_tokens=self.lookahead,
                         max_model_len=self.max_model_len,
                         num_encoder_tokens=self.encoder_len, dcp=self.dcp,
                         num_computed_tokens=computed,
                         max_blocks_per_req=self.caps[i] if self.caps else None)
            if r is None:
                raise LookupError(f"no block model for KV spec {type(spec).__name__}")
            out.append(r.table)
        return out

    def unmodelled(self) -> list[str]:
        """Names of the group specs the block model does not know."""
        return [type(s).__name__ for s in self.specs
                if reserved(s, 1, max_model_len=self.max_model_len) is None]


def _cap(spec, vllm_config, max_model_len: int) -> int | None:
    try:
        return row_cap(spec, vllm_config, max_model_len)
    except Exception:       # a config stand-in without the fields the spec reads
        return None


@dataclass
class BlockRewriter:
    """Re-assigns the block ids of warmup ``SchedulerOutput``s from the model, in bounds."""

    plan: WarmupPlan
    next_id: int = 1
    held: dict = field(default_factory=dict)        # req id -> [tokens, [table per group]]
    registered: list = field(default_factory=list)  # dummy requests the worker was sent
    max_id: int = 0
    num_new_reqs: int = 0

    def _alloc(self, n: int) -> list[int]:
        if n <= 0:
            return []
        if self.next_id + n > self.plan.num_blocks:
            raise NoRoom(f"warmup needs block id {self.next_id + n - 1} but the pool has "
                         f"{self.plan.num_blocks} blocks")
        ids = list(range(self.next_id, self.next_id + n))
        self.next_id += n
        self.max_id = ids[-1]
        return ids

    def rewrite(self, so) -> None:
        scheduled = so.num_scheduled_tokens
        for nr in so.scheduled_new_reqs:
            computed = int(getattr(nr, "num_computed_tokens", 0) or 0)
            n = computed + scheduled.get(nr.req_id, 0)
            tables = self.plan.tables(n, computed)
            nr.block_ids = tuple(self._alloc(t) for t in tables)
            self.held[nr.req_id] = [n, tables]
            self.num_new_reqs += 1
        cached = so.scheduled_cached_reqs
        for i, rid in enumerate(getattr(cached, "req_ids", ()) or ()):
            if rid not in self.held:
                continue
            computed = int(cached.num_computed_tokens[i])
            state = self.held[rid]
            n = max(state[0], computed + scheduled.get(rid, 0))
            tables = self.plan.tables(n, computed)
            deltas = [max(0, t - h) for t, h in zip(tables, state[1])]
            cached.new_block_ids[i] = (tuple(self._alloc(d) for d in deltas)
                                       if any(deltas) else None)
            state[0], state[1] = n, [max(t, h) for t, h in zip(tables, state[1])]

    def forward(self, execute):
        """``execute`` with every output rewritten first; tracks what the worker saw."""

        def execute_rewritten(so):
            self.rewrite(so)
            for nr in so.scheduled_new_reqs:
                if nr.req_id not in self.registered:
                    self.registered.append(nr.req_id)
            finished = set(getattr(so, "finished_req_ids", ()) or ())
            result = execute(so)
            if finished:
                self.registered = [r for r in self.registered if r not in finished]
            return result

        return execute_rewritten


def _runner_for(runner, max_num_seqs: int | None, dry: bool):
    overrides = {}
    if max_num_seqs is not None:
        overrides["scheduler_config"] = _Proxy(runner.scheduler_config,
                                               max_num_seqs=max_num_seqs)
    if dry:
        overrides.update(kv_connector=_NullConnector(), kv_block_zeroer=None, speculator=None)
        kv_cache = getattr(runner, "extensible_kv_cache", None)
        if kv_cache is not None:
            overrides["extensible_kv_cache"] = _DryKVCache(kv_cache)
    return _Proxy(runner, **overrides) if overrides else runner


def dry_run(fn, runner, plan: WarmupPlan, max_num_seqs: int | None, rest, kwargs):
    """Run the real warmup against a recording executor; the rewriter, or NoRoom."""
    rw = BlockRewriter(plan)
    finished = []

    def record(so):
        rw.rewrite(so)
        if getattr(so, "finished_req_ids", None):
            finished.append(True)

    try:
        fn(_runner_for(runner, max_num_seqs, dry=True), record, lambda *_a, **_k: None,
           *rest, **kwargs)
    except NoRoom:
        raise
    except Exception:
        if not finished:        # device sync after the cleanup step may fail off-GPU
            raise
    return rw


def choose_cap(fn, runner, plan: WarmupPlan, rest,
               kwargs) -> tuple[int | None, BlockRewriter | None]:
    """(max_num_seqs for the warmup or None to keep it, the fitting dry run) or (0, None)."""
    try:
        return None, dry_run(fn, runner, plan, None, rest, kwargs)
    except NoRoom:
        pass
    lo, hi, best = 1, int(runner.scheduler_config.max_num_seqs) - 1, (0, None)
    while lo <= hi:
        mid = (lo + hi) // 2
        try:
            best = (mid, dry_run(fn, runner, plan, mid, rest, kwargs))
            lo = mid + 1
        except NoRoom:
            hi = mid - 1
    return best


def rollback(runner, execute, registered: list[str]) -> None:
    """Finish the dummy requests, re-enable the connector, re-zero block 0."""
    from vllm.v1.core.sched.output import SchedulerOutput

    if registered:
        cleanup = SchedulerOutput.make_empty()
        cleanup.finished_req_ids = set(registered)
        execute(cleanup)
    connector = getattr(runner, "kv_connector", None)
    if connector is not None:
        connector.set_disabled(False)
    speculator = getattr(runner, "speculator", None)       # as vLLM's own cleanup (0.34)
    if speculator is not None and hasattr(speculator, "reset_state"):
        speculator.reset_state()
    zeroer = getattr(runner, "kv_block_zeroer", None)
    if zeroer is not None:
        zeroer.zero_block_ids([0])


@hookimpl
def kvguard_warmup(model_runner, call):
    fn = call.wrapped
    execute, sample = call.arg(1, "worker_execute_model"), call.arg(2, "worker_sample_tokens")
    rest, kwargs = tuple(call.args[3:]), dict(call.kwargs)
    for name in ("model_runner", "worker_execute_model", "worker_sample_tokens"):
        kwargs.pop(name, None)
    plan = WarmupPlan.of(model_runner)
    unknown = plan.unmodelled()
    if unknown:
        once(logging.INFO, ("warmup-unmodelled", tuple(unknown)),
             "vllm-kvguard: V2 warmup left as vLLM plans it: no block model for KV spec(s) %s "
             "(a kvguard_reserved_blocks hookimpl can add one)", ", ".join(unknown))
        return None
    cap, fitted = choose_cap(fn, model_runner, plan, rest, kwargs)
    if fitted is None:
        count("warmup", "skipped_no_room")
        once(logging.WARNING, ("warmup-skip",),
             "vllm-kvguard: skipping the V2 kernel warmup: not even one warmup request fits "
             "the %d-block KV pool when it reserves what the allocator would (lookahead %d, "
             "max_model_len %d); kernels compile on the first real steps instead. A larger "
             "pool (--num-gpu-blocks-override / --kv-cache-memory-bytes) avoids this.",
             plan.num_blocks, plan.lookahead, plan.max_model_len)
        return False
    if cap is not None:
        count("warmup", "capped")
        once(logging.WARNING, ("warmup-cap",),
             "vllm-kvguard: V2 kernel warmup capped at %d dummy request(s) (max_num_seqs %d) "
             "so every warmup block id stays below the pool's %d blocks",
             cap, model_runner.scheduler_config.max_num_seqs, plan.num_blocks)
    rewriter = BlockRewriter(plan)
    runner = _runner_for(model_runner, cap, dry=False)
    call.args = (runner, rewriter.forward(execute), sample) + rest
    call.kwargs = kwargs
    try:
        call()
    except Exception as exc:
        try:
            rollback(model_runner, execute, rewriter.registered)
        except Exception as cleanup_exc:
            logger.error("vllm-kvguard: V2 warmup failed (%s: %s) and its rollback failed too "
                         "(%s: %s); raising the warmup error", type(exc).__name__, exc,
                         type(cleanup_exc).__name__, cleanup_exc)
            raise exc from None
        count("warmup", "rolled_back")
        once(logging.WARNING, ("warmup-failed",),
             "vllm-kvguard: V2 kernel warmup step failed (%s: %s); rolled back (dummy "
             "requests finished, KV connector re-enabled, block 0 re-zeroed), startup "
             "continues without the rest of the warmup", type(exc).__name__, exc)
        return False
    count("warmup", "ok")
    logger.debug("vllm-kvguard: V2 warmup ran in bounds: %d request(s), highest block id %d "
                 "of %d", rewriter.num_new_reqs, rewriter.max_id, plan.num_blocks)
    return True


# ------------------------------------------------------------------ MRV1 sampler profiling
class KDraftRejectionSampler:
    """Stands in for ``runner.rejection_sampler`` during ``_dummy_sampler_run``: a call
    profiled with one draft per request is re-shaped to ``k`` drafts per request (the
    shapes of the real first speculative step), then run by the real sampler."""

    def __init__(self, real, k: int):
        self.real, self.k = real, k

    def __getattr__(self, name):
        return getattr(self.real, name)

    def __call__(self, metadata, draft_probs, logits, *args, **kwargs):
        import torch

        counts = list(getattr(metadata, "num_draft_tokens", ()) or ())
        if self.k > 1 and counts and all(n == 1 for n in counts):
            num_reqs, k = len(counts), self.k
            metadata = type(metadata).make_dummy([[0] * k for _ in range(num_reqs)],
                                                 logits.device)
            vocab = logits.shape[-1]
            if draft_probs is not None:
                draft_probs = torch.softmax(torch.rand(num_reqs * k, vocab, device=logits.device,
                                                       dtype=torch.float32), dim=-1)
            logits = torch.randn(num_reqs * (k + 1), vocab, device=logits.device,
                                 dtype=logits.dtype)
        return self.real(metadata, draft_probs, logits, *args, **kwargs)


@hookimpl
def kvguard_dummy_sampler_run(runner, call):
    spec = getattr(runner, "speculative_config", None)
    k = int(getattr(spec, "num_speculative_tokens", 0) or 0) if spec is not None else 0
    real = getattr(runner, "rejection_sampler", None)
    if k <= 1 or real is None:
        return None
    runner.rejection_sampler = KDraftRejectionSampler(real, k)
    try:
        call()
    finally:
        runner.rejection_sampler = real
    count("profile", "k_drafts")
    return True
