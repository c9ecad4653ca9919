"""Building a vLLM model on the meta device on a machine without CUDA, for its KV specs.

The model's layers ask for a one-process distributed world, the worker's scratch workspace,
CUDA streams for MoE overlap and vLLM's compiled CUDA ops while they are built; here those
are a gloo world of one, a workspace on the meta device, vLLM's own switch that turns the
MoE stream off, and placeholders for ops the compiled library lacks here (never run).
Used by :mod:`vllm_kvguard.tools.plan.layer_specs`.
"""
from __future__ import annotations

import socket


def ensure_distributed(vllm_config) -> None:
    """A one-process world (gloo), as the model's parallel layers ask for one."""
    import torch
    import torch.distributed as dist
    from vllm.config import set_current_vllm_config
    from vllm.distributed import (destroy_model_parallel,
                                  ensure_model_parallel_initialized,
                                  init_distributed_environment)
    from vllm.distributed.parallel_state import get_ep_group, model_parallel_is_initialized

    with set_current_vllm_config(vllm_config):
        # vLLM's own call is idempotent: it starts torch.distributed only if nothing has,
        # and makes its world group if another user of torch.distributed left none
        port = 0
        if not dist.is_initialized():
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
        init_distributed_environment(world_size=1, rank=0, local_rank=0,
                                     distributed_init_method=f"tcp://127.0.0.1:{port}",
                                     backend="gloo")
        if model_parallel_is_initialized() and vllm_config.model_config.is_moe:
            try:
                get_ep_group()
            except AssertionError:            # made for a dense model: no EP group
                destroy_model_parallel()
        ensure_model_parallel_initialized(1, 1)
    from vllm.v1.worker import workspace             # the worker's scratch buffers

    if not workspace.is_workspace_manager_initialized():
        workspace.init_workspace_manager(torch.device("meta"))


class no_cuda_streams:
    """MoE layers take an auxiliary CUDA stream and events when built, for overlap at run
    time: vLLM's own switch ``VLLM_DISABLE_SHARED_EXPERTS_STREAM`` is on while the model is
    only built here (it changes no KV figure)."""

    NAME = "VLLM_DISABLE_SHARED_EXPERTS_STREAM"

    def __enter__(self):
        import os

        self.old = os.environ.get(self.NAME)
        os.environ[self.NAME] = "1"
        return self

    def __exit__(self, *exc):
        import os

        if self.old is None:
            os.environ.pop(self.NAME, None)
        else:
            os.environ[self.NAME] = self.old
        return False


class op_placeholders:
    """Layers look up vLLM's compiled CUDA ops when built (``torch.ops._C.silu_and_mul``);
    where that library cannot load here (a CUDA wheel on a machine without CUDA), a
    placeholder answers for an op it lacks while the model is built; it cannot run. An op
    that only asks whether a kernel supports the device (``cutlass_scaled_mm_supports_*``,
    called by fp8 layers as they are built on vLLM 0.27.1) answers no: the layer then
    plans another kernel, which holds no KV cache either."""

    NAMESPACES = ("_C", "_moe_C")

    def __enter__(self):
        import torch

        self.saved = {}
        for ns in self.NAMESPACES:
            real = getattr(torch.ops, ns)
            self.saved[ns] = torch.ops.__dict__.get(ns)
            setattr(torch.ops, ns, _OpsOrPlaceholder(real))
        return self

    def __exit__(self, *exc):
        import torch

        for ns, old in self.saved.items():
            if old is None:
                torch.ops.__dict__.pop(ns, None)
            else:
                setattr(torch.ops, ns, old)
        return False


class _OpsOrPlaceholder:
    def __init__(self, real):
        self._real = real

    def __getattr__(self, name):
        try:
            return getattr(self._real, name)
        except AttributeError:
            if "_supports_" in name or name.endswith("_supported"):
                return lambda *_a, **_k: False
            def not_runnable(*_a, **_k):
                raise RuntimeError(f"torch.ops op {name} is a placeholder: the model is "
                                   f"only built here to read its KV-cache specs")
            return not_runnable


#: The MLA prefill class :class:`mla_prefill_placeholder` registers (vLLM resolves the
#: CUSTOM entry by this module path).
PLACEHOLDER = None


class mla_prefill_placeholder:
    """vLLM 0.27.1 picks an MLA layer's prefill kernel in a function of its own (later
    releases ask the platform, where the stand-in answers). Where none loads here, the
    first prefill class that imports, with its base class's ``__init__`` (no scratch
    workspace), stands in for the build, through vLLM's own CUSTOM
    registration and ``attention_config.mla_prefill_backend`` (prefill kernels compute,
    they hold no KV cache: the specs are unchanged); ``misses`` records why."""

    def __init__(self, vllm_config, misses: dict):
        self.config, self.misses, self.set = vllm_config, misses, False

    def __enter__(self):
        global PLACEHOLDER
        attention = getattr(self.config, "attention_config", None)
        if (not getattr(self.config.model_config, "use_mla", False) or attention is None
                or getattr(attention, "mla_prefill_backend", 1) is not None):
            return self
        try:
            from vllm.platforms.interface import Platform
            from vllm.v1.attention.backends.mla.prefill.base import MLAPrefillBackend
            from vllm.v1.attention.backends.mla.prefill.registry import (
                MLAPrefillBackendEnum, register_mla_prefill_backend)
            from vllm.v1.attention.backends.mla.prefill.selector import \
                get_mla_prefill_backend
        except ImportError:
            return self
        if hasattr(Platform, "get_mla_prefill_backend_cls"):
            return self                       # asked through the platform (0.32+)
        try:
            get_mla_prefill_backend(self.config)
            return self
        except ValueError as exc:
            why = str(exc)
        for member in MLAPrefillBackendEnum:
            try:
                base = member.get_class()
            except Exception:                 # noqa: BLE001 - not importable here
                continue
            PLACEHOLDER = type("PlannedMLAPrefill", (base,), {     # builds nothing
                "__module__": __name__, "__init__": MLAPrefillBackend.__init__,
                "validate_configuration": classmethod(lambda cls, *a, **k: [])})
            register_mla_prefill_backend(MLAPrefillBackendEnum.CUSTOM,
                                         f"{__name__}.PLACEHOLDER")
            attention.mla_prefill_backend = MLAPrefillBackendEnum.CUSTOM
            self.misses.setdefault("MLA prefill", why[:120])
            self.set = True
            break
        return self

    def __exit__(self, *exc):
        if self.set:
            self.config.attention_config.mla_prefill_backend = None
        return False
