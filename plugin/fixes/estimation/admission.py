"""The door: a request that can never run is refused before EngineCore, with its numbers.

EngineCore's certificate (:mod:`.certificate`) publishes its limits when the scheduler is
built, as plain JSON numbers (:data:`KEYS`): in memory (:func:`publish`) and in that
process's entry of the ``collective_rpc`` reply that also carries the counters
(:mod:`vllm_kvguard.remote`). A front end in another process validates every engine's
limits on receipt (a malformed entry is ignored) and uses the tightest; nothing is
unpickled, nothing is written to disk. Its input processing refuses a prompt above the
prompt limit, or a prompt + ``max_tokens`` above the total limit, with a ``ValueError``
(``LLM.generate`` raises it, ``vllm serve`` answers HTTP 400). No limits known (or
``KVGUARD_ADMISSION=off``): vLLM's behaviour. Outside the proven range the admission
patch's self-test runs in the scheduler's process before :func:`publish`; nothing is
published there until it has passed (failed: the door admits every request).
"""
from __future__ import annotations

import logging
import sys

from vllm_kvguard import remote, report
from vllm_kvguard.hookspecs import hookimpl
from vllm_kvguard.hostcall import KvguardOutcome
from vllm_kvguard.log import once

NAME = "admission"                     # the patch
KEY = NAME                             # the limits' key in EngineCore's remote entry
KEYS = {"prompt_limit": int, "total_limit": int, "start_limit": int, "max_model_len": int,
        "usable": int, "prompt_group": str, "total_group": str, "start_group": str,
        "statement": str}
MAX_TEXT = 2000                        # a longer group name or statement is cut here
ROOM = ("give the KV cache more room (gpu_memory_utilization, kv_cache_memory_bytes or "
        "VLLM_CPU_KVCACHE_SPACE) or change max_model_len")
_published: list = []                  # this process's own engine (EngineCore, in-process)


def _validation_error() -> tuple:
    """vLLM's own request-validation error, where it has one: the API server maps it to
    HTTP 400 and ``AsyncLLM`` re-raises it as is (any other error from input processing
    becomes ``EngineGenerateError``, an HTTP 500)."""
    try:
        from vllm.exceptions import VLLMValidationError
    except ImportError:
        return ()
    return (VLLMValidationError,)


_VALIDATION = _validation_error()


class Refused(KvguardOutcome, *_VALIDATION, ValueError):
    """A request that can never fit, refused before it reaches EngineCore."""


def validated(raw) -> dict | None:
    """``raw`` as limits (exactly :data:`KEYS`, of their types, in range), else None."""
    if not isinstance(raw, dict):
        return None
    out = {}
    for key, kind in KEYS.items():
        value = raw.get(key)
        if type(value) is not kind:
            return None                                 # (bool is not an int here)
        out[key] = value[:MAX_TEXT] if kind is str else value
    mml = out["max_model_len"]
    if mml < 1 or out["usable"] < 0 or not (0 <= out["prompt_limit"] <= mml
                                            and 0 <= out["total_limit"] <= mml
                                            and 0 <= out["start_limit"] <= mml):
        return None
    return out


def tightest(all_limits: list[dict]) -> dict | None:
    """The smallest limits of several engines (data parallelism: a request may go to any),
    each with the group that binds it there."""
    if not all_limits:
        return None
    out = dict(min(all_limits, key=lambda d: (d["total_limit"], d["prompt_limit"])))
    for key in ("prompt", "start"):
        low = min(all_limits, key=lambda d: d[f"{key}_limit"])
        out[f"{key}_limit"], out[f"{key}_group"] = low[f"{key}_limit"], low[f"{key}_group"]
    for key in ("max_model_len", "usable"):
        out[key] = min(d[key] for d in all_limits)
    return out


def publish(limits: dict) -> None:
    """Make ``limits`` (:data:`KEYS`) the door's, in this process and, through the
    counters' ``collective_rpc`` reply, for a front end in another process."""
    off = _unproven()
    if off:
        once(logging.INFO, ("admission-unproven",), "vllm-kvguard: admission limits not "
             "published (%s); requests are not checked at the door", off)
        return
    checked = validated(limits)
    if checked is None:
        once(logging.INFO, ("admission-publish",), "vllm-kvguard: admission limits not "
             "published (malformed: %.200r); requests are not checked at the door", limits)
        return
    _published[:] = [checked]
    remote.offer(KEY, checked)


def _unproven() -> str:
    """Why the admission patch's limits may not be published here ("" if they may): its
    self-test failed in this process tree or has not run yet where it is due."""
    verify = sys.modules.get("vllm_kvguard.verify")
    if verify is None:                 # never loaded: inside the proven range
        return ""
    if verify.pending(NAME):
        return "its self-test has not run here"
    return verify.failed(NAME)


def published() -> dict | None:
    """This process's limits, else the tightest valid limits of the engines the front end
    asks (a malformed entry is ignored, with one INFO line); None: nothing known."""
    if _published:
        return dict(_published[0])
    good = []
    for raw in remote.offered(KEY):
        limits = validated(raw)
        if limits is None:
            once(logging.INFO, ("admission-malformed",), "vllm-kvguard: an engine's "
                 "admission limits were malformed and are ignored: %.200r", raw)
        else:
            good.append(limits)
    best = tightest(good)
    if best is not None:
        once(logging.INFO, ("admission-received",), "vllm-kvguard: the door has %d engine(s)' "
             "admission limits: prompt <= %d, prompt + max_tokens <= %d tokens", len(good),
             best["prompt_limit"], best["total_limit"])
    return best


def clear_published() -> None:
    _published.clear()
    remote.offer(KEY, None)


def _refuse(message: str, parameter: str, value) -> None:
    report.count("admission", "refused")
    if _VALIDATION:                         # vLLM's validation error: name the parameter
        raise Refused(message, parameter=parameter, value=value)
    raise Refused(message)


def check(limits: dict, request_id, prompt_len: int, max_tokens: int | None) -> None:
    """Raise :class:`Refused` when the prompt cannot be admitted or prompt + max_tokens
    can never complete by ``limits``; ``max_tokens`` None is what vLLM makes it
    (``max_model_len - prompt_len``, in ``InputProcessor.process_inputs``)."""
    p_lim, t_lim, mml = limits["prompt_limit"], limits["total_limit"], limits["max_model_len"]
    if max_tokens is None:
        max_tokens = max(mml - prompt_len, 0)
    total, room = prompt_len + max_tokens, t_lim - prompt_len
    head = f"vllm-kvguard: request {request_id} can never fit the KV cache: "
    tail = f" Here: {limits['statement']}."
    if prompt_len > p_lim or room < 1:
        at_most = min(p_lim, t_lim - 1) if room < 1 else p_lim
        group = limits["prompt_group"] if prompt_len > p_lim else limits["total_group"]
        _refuse(f"{head}the prompt alone cannot be admitted: at most {max(at_most, 0)} "
                f"tokens here, this prompt has {prompt_len} (what binds it: {group}). "
                f"Shorten the prompt, or {ROOM}.{tail}", "prompt", prompt_len)
    if prompt_len > limits["start_limit"] and total > min(p_lim + 1, t_lim):
        room = min(p_lim + 1, t_lim) - prompt_len
        _refuse(f"{head}a prompt over {limits['start_limit']} tokens is preempted as it "
                f"starts decoding (what binds it: {limits['start_group']}) and re-admitted "
                f"one token longer each time, so prompt + max_tokens can be at most "
                f"{min(p_lim + 1, t_lim)}; this request has {prompt_len} + {max_tokens} = "
                f"{total}. max_tokens <= {room} would fit, or a prompt of at most "
                f"{limits['start_limit']} tokens. Or {ROOM}.{tail}", "max_tokens", max_tokens)
    if total > t_lim:
        _refuse(f"{head}prompt {prompt_len} + max_tokens {max_tokens} = {total} tokens, and "
                f"at most {t_lim} can ever complete here (what binds it: "
                f"{limits['total_group']}); max_tokens <= {room} would fit. Or {ROOM}.{tail}",
                "max_tokens", max_tokens)


def door_check(request_id, prompt_len: int, max_tokens: int | None) -> None:
    """:func:`check` against the :func:`published` limits (none known: vLLM decides)."""
    limits = published()
    if limits is not None:
        check(limits, request_id, prompt_len, max_tokens)


class Door:
    """The front end's check, registered by the ``admission`` patch (the process that
    takes requests need not be the one that builds a scheduler, so the door does not
    ride on the startup report that publishes the limits)."""

    @hookimpl
    def kvguard_admit(self, request):
        """One ``EngineCoreRequest`` (generation requests only)."""
        params = getattr(request, "sampling_params", None)
        tokens = getattr(request, "prompt_token_ids", None)
        if tokens is None:
            tokens = getattr(request, "prompt_embeds", None)
        if params is None or tokens is None:
            return
        door_check(request.request_id, len(tokens), getattr(params, "max_tokens", None))


DOOR = Door()
