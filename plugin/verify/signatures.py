"""The parameters each wrapper reads from its host call, by position and name.

A wrapper reads ``call.arg(i, name)``: the ``i``-th positional argument (after ``self``)
or the keyword ``name``. When a vLLM release renames or moves that parameter, the name
still resolves but the wrapper would read the wrong value: :func:`signature_drift` checks
the installed callables against this table (cheap: ``inspect.signature`` only).
"""
from __future__ import annotations

import inspect

from vllm_kvguard.lookup import resolve

_SCHED = "vllm.v1.core.sched.scheduler.Scheduler."
_WARMUP = "vllm.v1.worker.gpu.warmup."
_KV = "vllm.distributed.kv_transfer.kv_connector."

#: declared target name -> ((position after self, parameter name), ...)
SIGNATURES: dict[str, tuple[tuple[int, str], ...]] = {
    "vllm.v1.core.kv_cache_manager.KVCacheManager.allocate_slots":
        ((0, "request"), (1, "num_new_tokens")),
    _SCHED + "_build_kv_connector_meta": ((0, "connector"),),
    _SCHED + "update_from_output": ((0, "scheduler_output"), (1, "model_runner_output")),
    _KV + "factory.KVConnectorFactory.create_connector": ((1, "role"),),
    _KV + "v1.base.KVConnectorBase_V1.__init__": ((1, "role"),),
    "vllm.v1.core.block_pool.BlockPool.get_new_blocks": ((0, "num_blocks"),),
    "vllm.ray.ray_env.get_env_vars_to_copy": ((1, "additional_vars"),),
    "vllm.v1.engine.core.EngineCore.collective_rpc": ((0, "method"),),
    "vllm.v1.engine.core.EngineCore._initialize_kv_caches": ((0, "vllm_config"),),
    _WARMUP + "_warmup_kernels": ((0, "model_runner"),),
    _WARMUP + "warmup_kernels": ((0, "model_runner"),),
    _WARMUP + "_reserved_block_count": ((0, "num_tokens"), (1, "kvcache_spec"),
                                        (-1, "max_model_len")),
    "vllm.v1.worker.gpu_model_runner.GPUModelRunner.initialize_kv_cache":
        ((0, "kv_cache_config"),),
    "vllm.v1.worker.gpu.model_runner.GPUModelRunner.initialize_kv_cache":
        ((0, "kv_cache_config"),),
}


def _params(target) -> list[inspect.Parameter] | None:
    resolved = resolve(target.module, target.qualname)
    if resolved is None:
        return None
    parent, attr, _raw = resolved
    fn = getattr(parent, attr)
    fn = getattr(fn, "__wrapped__", fn) if getattr(type(fn), "__kvguard_wrapper__", False) \
        else fn
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None
    if params and params[0].name in ("self", "cls") and isinstance(parent, type):
        params = params[1:]
    return params


def problems(target) -> list[str]:
    """``name: ...`` for each expected parameter the installed callable lacks or moved."""
    want = SIGNATURES.get(target.name)
    if not want:
        return []
    params = _params(target)
    if params is None:
        return []                    # absent targets are the drift guard's to name
    names = [p.name for p in params]
    var_kw = any(p.kind is p.VAR_KEYWORD for p in params)
    out = []
    for index, name in want:
        if name not in names:
            if not var_kw:
                out.append(f"{target.name}({name}=...) has no parameter {name!r}")
            continue
        p = params[names.index(name)]
        positional = p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        if index >= 0 and positional and names.index(name) != index:
            out.append(f"{target.name}: {name!r} moved to position {names.index(name)}")
    return out


def signature_drift(patch, version=None, modules=None) -> list[str]:
    """:func:`problems` of every target of ``patch`` (in ``modules`` only, if given)."""
    out = []
    for target in patch.targets_in(version):
        if modules is None or target.module in modules:
            out += problems(target)
    return out
