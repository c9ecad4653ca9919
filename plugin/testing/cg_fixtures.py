"""Shared pieces of the CUDA-graph unit tests: real vLLM configs planned as on a GPU.

:func:`plan` builds the config vLLM would have on a GPU (CUDA-graph mode, capture sizes,
speculative decoding) from this CPU machine, so coverage and fallback logic is tested on
vLLM's own tables. :func:`vllm_logging_configured` is a module-scoped autouse fixture:
import it into a test module to apply it there. :data:`RUNNERS` are the model runners the
installed vLLM has (V1 is gone from 0.34.0); :data:`requires_v1` skips a V1-only test there.
:func:`real_v2_manager` builds vLLM's own ``CudaGraphManager`` with its real ``__init__``.
"""
from __future__ import annotations

import pytest

from vllm_kvguard.tools.plan.cudagraph import has_v1_runner, plan_config

NGRAM3 = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
RUNNERS = ["v1", "v2"] if has_v1_runner() else ["v2"]
requires_v1 = pytest.mark.skipif(not has_v1_runner(),
                                 reason="model runner V1 was removed in vLLM 0.34.0")


@pytest.fixture(scope="module", autouse=True)
def vllm_logging_configured():
    """vLLM configures logging on its first config build in a process and that resets the
    handlers of its child loggers (ours): let it happen before a test captures our log."""
    plan_config(cudagraph_mode="FULL_DECODE_ONLY", max_num_seqs=8)


def real_v2_manager(vc, mode, q: int, mocker):
    """vLLM's ``CudaGraphManager`` built by its own ``__init__``; only the pipeline group
    (torch.distributed) and the graph pool (a GPU) are replaced."""
    import inspect

    from vllm.v1.worker.gpu import cudagraph_utils

    pp = mocker.Mock(is_first_rank=True, is_last_rank=True)
    mocker.patch.object(cudagraph_utils, "get_pp_group", return_value=pp)
    mocker.patch.object(cudagraph_utils.current_platform, "get_global_graph_pool",
                        return_value=None, create=True)
    cls = cudagraph_utils.CudaGraphManager
    if "decode_query_lens" in inspect.signature(cls.__init__).parameters:     # 0.34+
        return cls(vc, None, mode, vc.get_decode_cudagraph_query_lens(q))
    return cls(vc, None, mode, q)


def plan(runner=None, mode="FULL_DECODE_ONLY", **kw):
    kw.setdefault("max_num_seqs", 256)
    kw.setdefault("max_num_batched_tokens", 8192)
    kw.setdefault("speculative_config", NGRAM3)
    return plan_config(cudagraph_mode=mode, runner=runner, **kw)
