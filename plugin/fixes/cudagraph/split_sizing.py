"""vLLM 0.34+ capture sizing, in its own terms: prefill token sizes and decode REQUEST sizes.

From 0.34 ``cudagraph_capture_sizes`` / ``max_cudagraph_capture_size`` are deprecated (set,
they log a deprecation and cannot be combined with the new fields); a uniform decode of
``n`` requests x ``q`` tokens has a FULL graph when ``n`` pads up to one of
``decode_cudagraph_capture_request_sizes`` (default: those the 512-token ceiling holds at
``q``, e.g. up to 128 requests at 3 drafts off Blackwell). This module re-runs vLLM's own
``_set_cudagraph_sizes`` on a copy of the config with candidate settings (to verify a fix)
and resolves the fields :func:`completion` writes for ``KVGUARD_CUDAGRAPH_COMPLETE``.
"""
from __future__ import annotations

import copy

#: The capture-size fields a user sets (all reset on a shadow before re-sizing).
USER_FIELDS = ("cudagraph_capture_sizes", "max_cudagraph_capture_size",
               "prefill_cudagraph_capture_token_sizes", "max_prefill_cudagraph_capture_tokens",
               "decode_cudagraph_capture_request_sizes",
               "max_decode_cudagraph_capture_requests")
#: What :func:`completion` writes on the live config (vLLM's resolved values).
WRITTEN = ("decode_cudagraph_capture_request_sizes", "max_decode_cudagraph_capture_requests",
           "cudagraph_capture_sizes", "max_cudagraph_capture_size")


def resized(vllm_config, setting: dict, *, keep_prefill: bool = True):
    """A copy of ``vllm_config`` sized by vLLM's own ``_set_cudagraph_sizes`` as if the user
    had set only ``setting`` (and, with ``keep_prefill``, today's prefill token sizes)."""
    shadow = copy.copy(vllm_config)
    cc = copy.copy(vllm_config.compilation_config)
    object.__setattr__(shadow, "compilation_config", cc)
    prefill = list(cc.prefill_cudagraph_capture_token_sizes or [])
    for name in USER_FIELDS:
        setattr(cc, name, None)
    if keep_prefill:
        cc.prefill_cudagraph_capture_token_sizes = prefill
    for name, value in setting.items():
        setattr(cc, name, list(value) if isinstance(value, list) else value)
    type(shadow)._set_cudagraph_sizes(shadow)
    return shadow


def explicit(vllm_config) -> bool:
    """Whether the decode request sizes are the user's own list, not what vLLM derives by
    default, from ``max_decode_cudagraph_capture_requests`` or from the deprecated bare
    ``max_cudagraph_capture_size``. Unknown counts as explicit."""
    cc = vllm_config.compilation_config
    current = sorted(cc.decode_cudagraph_capture_request_sizes or [])
    derivations = ({}, {"max_decode_cudagraph_capture_requests": max(current or [0]) or None},
                   {"max_cudagraph_capture_size": cc.max_cudagraph_capture_size})
    try:
        for setting in derivations:
            shadow = resized(vllm_config, setting, keep_prefill=False)
            if sorted(shadow.compilation_config.decode_cudagraph_capture_request_sizes
                      or []) == current:
                return False
    except Exception:
        pass
    return True


def candidates(vllm_config, fc) -> list[dict]:
    """Settings that may cover ``fc``'s family, simplest first: the decode request ceiling
    (with the decode token budget where one is set below it), then an explicit list."""
    fam = fc.family
    cc = vllm_config.compilation_config
    out = [{"max_decode_cudagraph_capture_requests": fam.hi}]
    budget = getattr(cc, "max_decode_cudagraph_capture_tokens", None)
    if budget is not None and budget < fam.hi * fam.q:
        out[0]["max_decode_cudagraph_capture_tokens"] = fam.hi * fam.q
    current = sorted(cc.decode_cudagraph_capture_request_sizes or [])
    sizes = sorted(set(current) | set(added_requests(fc, current)))
    out.append({"decode_cudagraph_capture_request_sizes": sizes})
    return out


def fix_text(setting: dict, fam) -> str:
    if "decode_cudagraph_capture_request_sizes" in setting:
        sizes = setting["decode_cudagraph_capture_request_sizes"]
        head = (f"compilation_config decode_cudagraph_capture_request_sizes=<{len(sizes)} "
                f"request counts up to {sizes[-1]}>")
    else:
        head = "compilation_config " + ", ".join(f"{k}={v}" for k, v in setting.items())
    return (f"{head} (decode graphs up to {fam.hi} requests x {fam.q} tokens; not together "
            f"with the deprecated cudagraph_capture_sizes / max_cudagraph_capture_size)")


def request_grid(max_requests: int) -> list[int]:
    """vLLM's own request-count grid (``decode_cudagraph_capture_grid``)."""
    from vllm.config.compilation import decode_cudagraph_capture_grid

    return list(decode_cudagraph_capture_grid(max_requests))


def added_requests(fc, current: list[int]) -> list[int]:
    """Request counts to add so every count from ``fc``'s first gap up to its widest
    reachable decode pads to a captured one."""
    fam = fc.family
    start = fc.first_gap or fam.lo
    return sorted({n for n in request_grid(fam.hi) if n >= start} - set(current))


def completion(vllm_config, gaps) -> tuple[list[int], dict]:
    """``(request counts added, {field: value} to write)`` so every gap in ``gaps`` has a
    decode graph; the token fields are what vLLM's sizing records for the new list."""
    cc = vllm_config.compilation_config
    current = sorted(cc.decode_cudagraph_capture_request_sizes or [])
    added = sorted({n for r in gaps for n in added_requests(r, current)})
    sizes = sorted(set(current) | set(added))
    shadow = resized(vllm_config, {"decode_cudagraph_capture_request_sizes": sizes})
    resolved = shadow.compilation_config
    return added, {name: getattr(resolved, name) for name in WRITTEN}
