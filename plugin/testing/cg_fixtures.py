"""Shared pieces of the CUDA-graph unit tests: real vLLM configs planned as on a GPU.

:func:`plan` builds the config vLLM would have on a GPU (CUDA-graph mode, capture sizes,
speculative decoding) from this CPU machine, so coverage and fallback logic is tested on
vLLM's own tables. :func:`vllm_logging_configured` is a module-scoped autouse fixture:
import it into a test module to apply it there.
"""
from __future__ import annotations

import pytest

from vllm_kvguard.tools.plan import plan_config

NGRAM3 = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}


@pytest.fixture(scope="module", autouse=True)
def vllm_logging_configured():
    """vLLM configures logging on its first config build in a process and that resets the
    handlers of its child loggers (ours): let it happen before a test captures our log."""
    plan_config(cudagraph_mode="FULL_DECODE_ONLY", max_num_seqs=8)


def plan(runner="v1", mode="FULL_DECODE_ONLY", **kw):
    kw.setdefault("max_num_seqs", 256)
    kw.setdefault("max_num_batched_tokens", 8192)
    kw.setdefault("speculative_config", NGRAM3)
    return plan_config(cudagraph_mode=mode, runner=runner, **kw)
