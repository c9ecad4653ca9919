"""Spec-aware KV capacity report, logged once when the scheduler's KV cache is built.

vLLM logs "Maximum concurrency for N tokens per request: X" from ``num_blocks`` (null
block included) over per-request blocks from each spec's ``max_memory_usage_bytes``, and
its Mamba FULL-decode check (``max_num_seqs > num_blocks``) ignores the 1+nsb / 2+nsb
blocks a speculative Mamba sequence holds, the null block and the attention groups.
This report recomputes, from the reserved-block model
(:func:`vllm_kvguard.fixes.estimation.estimate.reserved_blocks`), per KV-cache group:

* blocks one request holds at its peak on the way to ``max_model_len`` (what admitting
  and prefilling one takes), without and with speculative decoding;
* the true maximum concurrency: how many ``max_model_len`` requests the scheduler runs at
  once. Only the request being admitted needs its admission count free (vLLM's own gate,
  :mod:`.certificate`); each other one holds what it holds decoding at ``max_model_len``
  (a sliding-window group: about its window, not its prefill peak). vLLM's own figure
  charges every request the peak and is printed beside it;
* on models with Mamba groups: how many decoding sequences fit at once against
  ``max_num_seqs`` (what FULL decode CUDA graphs are captured for), with a warning naming
  the numbers and the flag to change when they do not.

Cost: the per-group figures (about 170 reserved-block evaluations per group) are computed
once per KV configuration (the specs and the scalar settings they depend on) and reused by
every later ``Scheduler`` built with it; the loops call
:func:`~vllm_kvguard.fixes.estimation.estimate.reserved_blocks` directly unless a third-party
``kvguard_reserved_blocks`` implementation is registered (then the hook answers, uncached).
"""
from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass, field

from vllm_kvguard.fixes.estimation import estimate as _estimate
from vllm_kvguard.fixes.estimation.estimate import (dcp_size, device_groups, lookahead_tokens,
                                         manager_block_size, num_spec, reserved,
                                         reserved_blocks)
from vllm_kvguard.fixes.estimation.schedule import checkpointing_of_configs, in_flight
from vllm_kvguard.hookspecs import hookimpl
from vllm_kvguard.log import once
from vllm_kvguard.report import count


@dataclass
class GroupCapacity:
    index: int
    kind: str
    block_size: int          # the manager's allocation granularity (x DCP where sharded)
    plain: int               # peak blocks per request at max_model_len, no speculation
    spec: int                # ... with this engine's speculative decoding
    decode: int              # blocks one short decoding sequence holds (with speculation)
    is_mamba: bool = False
    hold: int = 0            # blocks one request holds decoding at max_model_len


@dataclass
class Capacity:
    groups: list[GroupCapacity]
    num_blocks: int
    max_model_len: int
    max_num_seqs: int
    num_spec_tokens: int
    lookahead: int
    vllm_concurrency: float | None
    full_decode_graphs: bool | None
    per_request_plain: int = 0
    per_request_spec: int = 0
    decode_blocks: int = 0
    admit_blocks: int = 0    # free blocks admitting and prefilling one max_model_len request takes
    admit_by: str = ""       # what binds that count
    hold_blocks: int = 0     # blocks one request holds decoding at max_model_len
    basis: str = ""          # where the admission count comes from
    warnings: list[str] = field(default_factory=list)

    @property
    def usable(self) -> int:
        return self.num_blocks - 1               # block 0 is the null block

    @property
    def true_concurrency(self) -> int | float:
        """``max_model_len`` requests running at once: one being admitted (needs
        :attr:`admit_blocks` free), each other one decoding (holds :attr:`hold_blocks`)."""
        if not self.hold_blocks:
            return float("inf")
        if self.admit_blocks > self.usable:
            return 0
        return 1 + (self.usable - self.admit_blocks) // self.hold_blocks

    @property
    def has_mamba(self) -> bool:
        return any(g.is_mamba for g in self.groups)

    @property
    def decodes_that_fit(self) -> int:
        return self.usable // self.decode_blocks if self.decode_blocks else self.max_num_seqs


def peak_blocks(spec, *, max_model_len: int, step: int, chunk: int, lookahead: int,
                encoder_len: int = 0, dcp: int = 1, estimate=None, lagged: bool = False,
                checkpointing=None) -> int:
    """The most blocks one request holds in the group on its way to ``max_model_len``, over
    every prompt length: prefill in ``chunk``-token chunks, then decode steps of ``step``.
    ``estimate`` is the reserved-block function (default: :func:`_estimator`); ``lagged``:
    each step is allocated while the one before it is in flight (async scheduling; the
    Mamba align groups: a windowed group's lag is its longer chunk, see
    :func:`_group_figures`); ``checkpointing``: the group's Mamba prefill-checkpoint numbers.

    What a step holds depends on where it starts (``C``) only through ``C`` modulo the
    block size and, for sliding-window / chunked-local groups, the window; so scanning one
    such period below the top covers every case (monotone groups peak at the top)."""
    mml = max_model_len
    bsz = manager_block_size(spec, dcp)
    window = max(int(getattr(spec, "sliding_window", 0) or 0),
                 int(getattr(spec, "attention_chunk_size", 0) or 0))
    period = min(mml, (math.lcm(window, bsz) if window else bsz) + 2 * bsz + step)
    lag_chunk, lag_step = (chunk, step) if lagged else (0, 0)
    # (tokens, computed, settled): prefill chunks, then decode steps
    points = {(min(chunk, mml), 0, 0), (mml, max(0, mml - step), max(0, mml - step - lag_step))}
    points.update((min(c + step, mml), c, max(0, c - lag_step))
                  for c in range(max(0, mml - step - period), mml))
    top = max(0, mml - chunk)
    points.update((min(c + chunk, mml), c, max(0, c - lag_chunk))
                  for c in range(max(0, top - period), min(mml, top + 2 * bsz + 1)))
    fn = estimate or _estimator()
    best = 0
    for n, c, settled in points:
        r = fn(spec, n, num_lookahead_tokens=lookahead, max_model_len=mml,
               num_encoder_tokens=encoder_len, dcp=dcp, num_computed_tokens=c,
               num_settled_tokens=settled,
               checkpointing=checkpointing and checkpointing.at(n))
        if r is None:
            raise LookupError(type(spec).__name__)
        best = max(best, r.physical)
    return best


def _without_spec_blocks(spec):
    if getattr(spec, "num_speculative_blocks", 0) and dataclasses.is_dataclass(spec):
        return dataclasses.replace(spec, num_speculative_blocks=0)
    return spec


def _describe(spec) -> str:
    name = type(spec).__name__
    if hasattr(spec, "mamba_cache_mode"):
        return f"{name}({spec.mamba_cache_mode}, nsb={getattr(spec, 'num_speculative_blocks', 0)})"
    if getattr(spec, "sliding_window", None):
        return f"{name}(window={spec.sliding_window})"
    return name


def _vllm_concurrency(vllm_config, kv_cache_config) -> float | None:
    try:
        from vllm.v1.core.kv_cache_utils import get_max_concurrency_for_kv_cache_config

        return float(get_max_concurrency_for_kv_cache_config(vllm_config, kv_cache_config))
    except Exception:
        return None


def _full_decode_graphs(vllm_config) -> bool | None:
    try:
        return bool(vllm_config.compilation_config.cudagraph_mode.has_full_cudagraphs())
    except Exception:
        return None


def _third_party_estimates() -> bool:
    """Whether a ``kvguard_reserved_blocks`` implementation other than ours is registered."""
    from vllm_kvguard.manager import impls

    return any(impl.plugin is not _estimate for impl in impls("kvguard_reserved_blocks"))


def _estimator():
    """:func:`reserved_blocks` itself, or the hook path when a third party may answer."""
    return reserved if _third_party_estimates() else reserved_blocks


#: {KV configuration key: per-group figures}; bounded (one entry per distinct KV config).
_GROUPS_CACHE: dict = {}
_GROUPS_CACHE_MAX = 64


def _spec_key(spec):
    try:
        hash(spec)
        return (type(spec), spec)
    except TypeError:                       # a spec with an unhashable field
        return (type(spec), repr(spec))


def _group_figures(specs, *, mml: int, k: int, la: int, dcp: int, chunk: int, enc: int,
                   estimate, inflight: int = 0, lagged: bool = False,
                   checkpoints: tuple = ()) -> list[GroupCapacity]:
    """Per non-host group: (index, spec) -> :class:`GroupCapacity` (the costly part).
    Windowed groups (sliding window, chunked local) free blocks on the processed-token
    basis, so they hold the ``inflight`` tokens of every batch not yet settled: their
    prefill steps are ``inflight`` tokens long, as vLLM reserves them. Mamba align groups
    keep the state blocks of a step in flight (``lagged``: async scheduling) and take
    prefill checkpoint blocks (``checkpoints``: (group index, numbers))."""
    out = []
    ckpts = dict(checkpoints)
    for i, spec in specs:
        windowed = bool(getattr(spec, "sliding_window", None)
                        or getattr(spec, "attention_chunk_size", None))
        step_chunk = max(chunk, inflight) if windowed else chunk
        no_spec = _without_spec_blocks(spec)
        mamba = dict(lagged=lagged and not windowed, checkpointing=ckpts.get(i))
        with_spec = peak_blocks(spec, max_model_len=mml, step=1 + k, chunk=step_chunk,
                                lookahead=la, encoder_len=enc, dcp=dcp, estimate=estimate,
                                **mamba)
        if k == 0 and la == 0 and no_spec is spec:   # the same pass: no speculation at all
            plain = with_spec
        else:
            plain = peak_blocks(no_spec, max_model_len=mml, step=1, chunk=step_chunk,
                                lookahead=0, encoder_len=enc, dcp=dcp, estimate=estimate,
                                **mamba)
        is_mamba = hasattr(spec, "mamba_cache_mode")
        bsz = manager_block_size(spec, dcp)
        # A short decoding sequence: attention at its smallest; Mamba at its worst step
        # (align holds 2 + nsb on the step that enters a new block).
        starts = range(1, min(mml, bsz + k + 2)) if is_mamba else (1,)
        decode = 0
        for c in starts:
            r = estimate(spec, min(mml, c + 1 + k), num_lookahead_tokens=la,
                         max_model_len=mml, num_encoder_tokens=enc, dcp=dcp,
                         num_computed_tokens=c)
            if r is None:
                raise LookupError(type(spec).__name__)
            decode = max(decode, r.physical)
        out.append(GroupCapacity(i, _describe(spec), bsz, plain, with_spec, decode,
                                 is_mamba=is_mamba))
    return out


def _groups(specs, **settings) -> list[GroupCapacity]:
    """:func:`_group_figures`, computed once per KV configuration (fresh copies returned).
    Uncached when a third-party ``kvguard_reserved_blocks`` may answer."""
    if _third_party_estimates():
        return _group_figures(specs, estimate=reserved, **settings)
    key = (tuple((i, _spec_key(s)) for i, s in specs), tuple(sorted(settings.items())))
    figures = _GROUPS_CACHE.get(key)
    if figures is None:
        figures = _group_figures(specs, estimate=reserved_blocks, **settings)
        if len(_GROUPS_CACHE) >= _GROUPS_CACHE_MAX:
            _GROUPS_CACHE.clear()
        _GROUPS_CACHE[key] = figures
    return [dataclasses.replace(g) for g in figures]


def clear_cache() -> None:
    _GROUPS_CACHE.clear()


def in_flight_tokens(vllm_config) -> int:
    """Tokens scheduled but not yet settled: vLLM's ``max_in_flight_tokens`` (one token
    budget per concurrent batch: 2 with async scheduling) where it has it, else one budget."""
    value = getattr(vllm_config, "max_in_flight_tokens", None)
    if value is None:
        return int(vllm_config.scheduler_config.max_num_batched_tokens)
    return int(value)


def model_certificate(vllm_config, kv_cache_config, checkpoints: dict | None = None):
    """A :class:`~.certificate.Certificate` from the configs alone, for where no scheduler is
    at hand: no vLLM gate, so admission is the reserved-block model's largest prefill chunk.
    ``checkpoints``: the Mamba prefill-checkpoint numbers (default: from the configs)."""
    from vllm_kvguard.fixes.estimation.certificate import Certificate
    from vllm_kvguard.fixes.estimation.schedule import Schedule

    sched = vllm_config.scheduler_config
    schedule = Schedule(budget=int(sched.max_num_batched_tokens), gate=False,
                        chunked=bool(getattr(sched, "enable_chunked_prefill", True)),
                        in_flight=in_flight(vllm_config))
    return Certificate(groups=tuple(device_groups(kv_cache_config)),
                       usable=int(kv_cache_config.num_blocks) - 1,
                       max_model_len=int(vllm_config.model_config.max_model_len),
                       schedule=schedule, lookahead=lookahead_tokens(vllm_config),
                       draft_tokens=num_spec(vllm_config), dcp=dcp_size(vllm_config),
                       checkpoints=(_checkpoints(vllm_config, kv_cache_config)
                                    if checkpoints is None else checkpoints))


def _checkpoints(vllm_config, kv_cache_config, cert=None) -> dict:
    """The Mamba prefill-checkpoint numbers: ``cert``'s (read from vLLM's scheduler), else
    from the configs; none where those cannot say (the model's default, an upper bound)."""
    if cert is not None:
        return cert.checkpoints
    try:
        return checkpointing_of_configs(vllm_config, kv_cache_config)
    except Exception:               # noqa: BLE001 - configs vLLM cannot resolve sizes for
        return {}


def _concurrency(cap: "Capacity", cert) -> None:
    """Admission count and decode holding at ``max_model_len`` from ``cert``."""
    mml = cap.max_model_len
    cap.admit_blocks, cap.admit_by = cert.admission(mml)
    held = dict(cert.holding(mml))
    for g in cap.groups:
        g.hold = held.get(g.index, 0)
    cap.hold_blocks = sum(held.values())
    cap.basis = ("vLLM's admission gate" if cert.gate is not None and cert.schedule.gate
                 else "reserved-block model")


def differs(cap: "Capacity") -> bool:
    """Whether our concurrency and vLLM's differ by more than 10 % (vLLM's figure is a
    fraction of a request: it is high only if its whole requests are more than ours)."""
    v, t = cap.vllm_concurrency, cap.true_concurrency
    if v is None or t == float("inf"):
        return False
    return t > 1.1 * v or (int(v) > t and v > 1.1 * t)


def overstated(cap: "Capacity") -> bool:
    """Whether vLLM's concurrency figure overstates the spec-aware one by more than rounding
    (1 request and 1%), decided on the unrounded figures."""
    return cap.vllm_concurrency is not None and (
        cap.vllm_concurrency - cap.true_concurrency > max(1.0, 0.01 * cap.vllm_concurrency))


def compute(vllm_config, kv_cache_config, cert=None) -> Capacity:
    """The report; ``cert``: the certificate of vLLM's scheduler over these configs
    (:func:`.certificate.of_scheduler`), else :func:`model_certificate`."""
    mml = int(vllm_config.model_config.max_model_len)
    sched = vllm_config.scheduler_config
    k = num_spec(vllm_config)
    la = lookahead_tokens(vllm_config)
    dcp = dcp_size(vllm_config)
    chunk = int(sched.max_num_batched_tokens) if getattr(
        sched, "enable_chunked_prefill", True) else mml
    enc = int(getattr(sched, "max_num_encoder_input_tokens", 0) or 0)
    cap = Capacity(groups=[], num_blocks=int(kv_cache_config.num_blocks), max_model_len=mml,
                   max_num_seqs=int(sched.max_num_seqs), num_spec_tokens=k, lookahead=la,
                   vllm_concurrency=_vllm_concurrency(vllm_config, kv_cache_config),
                   full_decode_graphs=_full_decode_graphs(vllm_config))
    specs = device_groups(kv_cache_config)
    inflight = in_flight_tokens(vllm_config) if getattr(
        sched, "enable_chunked_prefill", True) else mml
    checkpoints = _checkpoints(vllm_config, kv_cache_config, cert)
    cap.groups = _groups(specs, mml=mml, k=k, la=la, dcp=dcp, chunk=chunk, enc=enc,
                         inflight=inflight, lagged=in_flight(vllm_config) > 0,
                         checkpoints=tuple(sorted(checkpoints.items())))
    cap.per_request_plain = sum(g.plain for g in cap.groups)
    cap.per_request_spec = sum(g.spec for g in cap.groups)
    cap.decode_blocks = sum(g.decode for g in cap.groups)
    try:
        _concurrency(cap, cert if cert is not None else model_certificate(
            vllm_config, kv_cache_config, checkpoints))
    except Exception as exc:       # noqa: BLE001 - no certificate: the peak-based figure
        cap.admit_blocks = cap.hold_blocks = cap.per_request_spec
        cap.admit_by = cap.basis = f"peak blocks/request (no certificate: {type(exc).__name__})"
    per_group = ", ".join(f"group {g.index}: {g.decode}" for g in cap.groups)
    if cap.has_mamba and cap.decodes_that_fit < cap.max_num_seqs:
        graphs = {True: "FULL decode CUDA graphs are captured for batch sizes that can never "
                        "run", False: "FULL decode graphs are off",
                  None: "FULL decode graph mode unknown"}[cap.full_decode_graphs]
        cap.warnings.append(
            f"max_num_seqs={cap.max_num_seqs} decodes do not fit: each decoding sequence holds "
            f"{cap.decode_blocks} blocks ({per_group}"
            f", Mamba speculative blocks included), so at most {cap.decodes_that_fit} of the "
            f"{cap.usable} usable blocks' sequences decode at once; {graphs}. Lower "
            f"--max-num-seqs to {max(1, cap.decodes_that_fit)} or give the KV cache more memory.")
    # Warn only when it matters: fewer than max_num_seqs full-length requests fit, or vLLM's
    # figure overstates the truth by more than rounding (1 request and 1%); else INFO only.
    if cap.vllm_concurrency is not None and (cap.true_concurrency < cap.max_num_seqs
                                             or overstated(cap)):
        spec = (f"with speculative decoding ({k} draft tokens/step, lookahead {la}) "
                if k or la else "")
        cap.warnings.append(
            f"vLLM reports maximum concurrency {cap.vllm_concurrency:.2f}x for "
            f"{mml} tokens per request; {spec}the scheduler runs "
            f"{cap.true_concurrency} at once (admitting one takes {cap.admit_blocks} of "
            f"{cap.usable} usable blocks, each running one holds {cap.hold_blocks}).")
    return cap


def verdict_line(cap: Capacity) -> str | None:
    """Which concurrency figure is right and why, when ours and vLLM's differ by > 10 %."""
    if not differs(cap):
        return None
    v, t = cap.vllm_concurrency, cap.true_concurrency
    charge = (f"it divides all {cap.num_blocks} blocks (the null block too) by "
              f"{cap.num_blocks / v:.1f} per request")
    if t > v:
        return (f"  vLLM's {v:.2f}x is low: {charge}, a prefill peak, as if every request "
                f"were prefilling at once; only the request being admitted needs that "
                f"({cap.admit_blocks} free), one decoding at max_model_len holds "
                f"{cap.hold_blocks}, so the scheduler runs {t}")
    return (f"  vLLM's {v:.2f}x is high: {charge}; admitting one takes {cap.admit_blocks} of "
            f"{cap.usable} usable and each running one holds {cap.hold_blocks}, so the "
            f"scheduler runs {t}")


def format_report(cap: Capacity) -> list[str]:
    vllm_fig = "n/a" if cap.vllm_concurrency is None else f"{cap.vllm_concurrency:.2f}x"
    lines = [f"vllm-kvguard KV capacity: num_blocks={cap.num_blocks} (usable {cap.usable}), "
             f"max_model_len={cap.max_model_len}, draft_tokens={cap.num_spec_tokens}, "
             f"lookahead={cap.lookahead}"]
    for g in cap.groups:
        lines.append(f"  group {g.index} {g.kind} block_size={g.block_size}: peak "
                     f"blocks/request at max_model_len plain={g.plain} spec={g.spec}; held "
                     f"decoding at max_model_len={g.hold}; short decode={g.decode}")
    lines.append(f"  per request: peak plain={cap.per_request_plain} "
                 f"spec={cap.per_request_spec}; blocks to admit one max_model_len request="
                 f"{cap.admit_blocks} ({cap.basis}); blocks one request holds decoding at "
                 f"max_model_len={cap.hold_blocks}")
    lines.append(f"  true max concurrency={cap.true_concurrency} max_model_len requests at "
                 f"once (1 + ({cap.usable} - {cap.admit_blocks}) // {cap.hold_blocks}) vs "
                 f"vLLM {vllm_fig}")
    verdict = verdict_line(cap)
    if verdict:
        lines.append(verdict)
    if cap.has_mamba:
        lines.append(f"  Mamba decode: {min(cap.decodes_that_fit, cap.max_num_seqs)} of "
                     f"max_num_seqs={cap.max_num_seqs} sequences fit "
                     f"(decode blocks/sequence={cap.decode_blocks}, FULL decode graphs="
                     f"{cap.full_decode_graphs})")
    return lines


_last: list[Capacity] = []


def last_report() -> Capacity | None:
    """The capacity computed at the last startup in this process (tests, tools)."""
    return _last[-1] if _last else None


@hookimpl
def kvguard_startup_report(vllm_config, kv_cache_config, scheduler):
    """The report's lines; its warnings logged once. With ``scheduler`` (None: none built),
    admission is counted by vLLM's own gate on it (:func:`.certificate.of_scheduler`)."""
    cert = None
    if scheduler is not None:
        from vllm_kvguard.fixes.estimation import certificate

        try:
            cert = certificate.of_scheduler(scheduler)
        except Exception as exc:     # noqa: BLE001 - the model's certificate instead
            once(logging.INFO, ("capacity-gate", type(exc).__name__),
                 "vllm-kvguard: capacity without vLLM's admission gate (%s)", exc)
    try:
        cap = compute(vllm_config, kv_cache_config, cert)
    except LookupError as exc:
        once(logging.INFO, ("capacity-unknown", str(exc)),
             "vllm-kvguard: no spec-aware capacity report: KV spec %s is not modelled", exc)
        return None
    _last[:] = [cap]
    for w in cap.warnings:
        count("capacity", "warning")
        once(logging.WARNING, ("capacity", w), "vllm-kvguard: %s", w)
    return format_report(cap)
