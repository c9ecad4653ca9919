"""Self-test of the ``cudagraph`` patch: the coverage probe the startup audit and the
planner use runs on the installed vLLM's own graph owner class (V2 ``CudaGraphManager``,
or V1 ``CudagraphDispatcher`` where it still exists) with vLLM's own capture sizing: every
decode family is found, the smallest decode dispatches to a graph, and the widest shape
the audit calls covered really does.

It runs in the model runner's process (the patch calls it as ``initialize_kv_cache``
starts, before graph keys, capture or any fix of ours), on the runner's own ``VllmConfig``
and owner class; where that engine intends no decode graphs (eager, CPU), on a copy of its
config sized by vLLM for FULL decode graphs, so the probe is still proven.
"""
from __future__ import annotations

import copy

from vllm_kvguard.verify import SelfTestFailed


def _graph_config(vllm_config):
    """``vllm_config`` when it intends decode graphs, else a copy with FULL decode graphs
    sized by vLLM's own ``_set_cudagraph_sizes`` (the live config is never touched)."""
    from vllm.config import CUDAGraphMode

    from vllm_kvguard.fixes.cudagraph.split_sizing import USER_FIELDS

    cc = vllm_config.compilation_config
    mode = cc.cudagraph_mode
    if mode is not None and mode.decode_mode() != CUDAGraphMode.NONE and \
            cc.cudagraph_capture_sizes:
        return vllm_config
    shadow, cc = copy.copy(vllm_config), copy.copy(cc)
    model = copy.copy(vllm_config.model_config)
    object.__setattr__(model, "enforce_eager", False)
    object.__setattr__(shadow, "compilation_config", cc)
    object.__setattr__(shadow, "model_config", model)
    cc.cudagraph_mode = CUDAGraphMode.FULL_DECODE_ONLY
    for name in USER_FIELDS:
        if hasattr(cc, name):
            setattr(cc, name, None)
    type(shadow)._set_cudagraph_sizes(shadow)
    return shadow


def _owner(runner, vllm_config):
    """A graph owner of the runner's own class (V1 dispatcher or V2 manager; no runner: V1
    where vLLM still has it) for ``vllm_config``, keys built, nothing captured."""
    import importlib.util

    from vllm_kvguard.fixes.cudagraph.graph_owners import is_v2_runner, v1_probe, v2_probe
    from vllm_kvguard.fixes.estimation.estimate import num_spec
    from vllm_kvguard.patches.cudagraph import V1_RUNNER

    mode = vllm_config.compilation_config.cudagraph_mode
    q = 1 + num_spec(vllm_config)
    v2 = is_v2_runner(runner) if runner is not None else \
        importlib.util.find_spec(V1_RUNNER) is None
    if not v2:
        return v1_probe(vllm_config, mode, q)
    real = getattr(runner, "cudagraph_manager", None)
    return v2_probe(vllm_config, mode, int(getattr(runner, "decode_query_len", q)),
                    cls=type(real) if real is not None else None)


def check(runner=None, vllm_config=None) -> None:
    """``runner``: the engine's model runner (its process, before its KV cache is set up);
    None (``kvguard doctor``, tests): the runner vLLM has (V1 up to 0.33) on
    ``vllm_config`` (default: the tiny Llama's)."""
    from vllm_kvguard.fixes.cudagraph import planner

    if vllm_config is None:
        if runner is not None:
            vllm_config = runner.vllm_config
        else:
            from vllm_kvguard.testing import kv_fixtures as kf

            vllm_config = kf.make_vllm_config(num_gpu_blocks=64, max_num_batched_tokens=2048,
                                              max_num_seqs=64)
    owner = _owner(runner, _graph_config(vllm_config))
    cov = planner.audit(owner)
    if not cov.rows:
        raise SelfTestFailed(f"the {owner.kind} coverage probe found no decode shape")
    row = cov.rows[0]
    q = row.family.q
    if row.covered < 1:
        raise SelfTestFailed(f"the {owner.kind} probe sees no graph for a 1-request decode")
    mode, _tokens = owner.probe(row.family.lo + row.covered - 1, q)
    if "NONE" in str(mode).upper():
        raise SelfTestFailed(f"the audit calls {row.family.lo + row.covered - 1} requests "
                             f"covered, {owner.kind} dispatch runs them eager")
