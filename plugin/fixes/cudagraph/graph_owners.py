"""The graph owners: the vLLM objects that map a batch to a CUDA graph, behind one interface.

Model runner V1 has a ``CudagraphDispatcher`` (up to vLLM 0.33), model runner V2 a
``CudaGraphManager`` (0.34: uniform decode graphs keyed by request count per query length).
:class:`GraphOwner` says what an owner is meant to run (its intended mode, the query
lengths and LoRA cases it captures) and asks its own ``dispatch`` what a batch shape gets.
This module also knows each owner's ``dispatch`` signature and the vLLM frames whose
locals carry a batch's shape, so the fallback accounting can recognise them by code object.
Probing never changes an owner: a V2 probe dispatches on a shallow copy.
"""
from __future__ import annotations

import copy
import inspect
import sys

V1_SIGNATURE = ("self", "num_tokens", "uniform_decode", "has_lora", "num_active_loras",
                "valid_modes", "invalid_modes")
#: V2 ``dispatch`` parameters after ``num_active_loras`` (0.27.1: none; 0.29: max_query_len;
#: 0.32+: max_query_len, num_ubatches), mapped to how many of them a call passes.
V2_HEAD = ("self", "num_reqs", "num_tokens", "uniform_token_count", "num_active_loras")
V2_TAILS = {(): 0, ("max_query_len",): 1, ("max_query_len", "num_ubatches"): 2}

#: How many frames :func:`frame_locals` looks up the stack for the frame it wants.
FRAME_LIMIT = 8

_quiet = [0]


class quiet:
    """Dispatches made inside this block (probes, re-dispatches of ours) are not counted."""

    def __enter__(self):
        _quiet[0] += 1

    def __exit__(self, *exc):
        _quiet[0] -= 1
        return False


def is_quiet() -> bool:
    return _quiet[0] > 0


def modes():
    from vllm.config import CUDAGraphMode

    return CUDAGraphMode


class GraphOwner:
    """The object that maps batches to graphs (``obj``), seen through one small interface."""

    kind = ""

    def __init__(self, obj, vllm_config):
        self.obj = obj
        self.vllm_config = vllm_config

    @property
    def mode(self):
        return self.obj.cudagraph_mode

    @property
    def max_capture_size(self) -> int:
        return int(self.vllm_config.compilation_config.max_cudagraph_capture_size or 0)

    def intended(self):
        """The mode a uniform decode batch is meant to run (NONE: no graphs at all)."""
        return self.mode.decode_mode()

    def query_lens(self) -> list[int]:
        raise NotImplementedError

    def lora_cases(self) -> list[int]:
        raise NotImplementedError

    def probe(self, num_reqs: int, q: int, lora: int = 0):
        """``(mode, padded tokens)`` the owner's own ``dispatch`` picks for a uniform
        decode of ``num_reqs`` requests x ``q`` tokens (never counted as a fallback)."""
        raise NotImplementedError

    def num_graphs(self) -> int:
        raise NotImplementedError


class V1Owner(GraphOwner):
    kind = "V1"

    def query_lens(self) -> list[int]:
        return [int(self.obj.uniform_decode_query_len)]

    def lora_cases(self) -> list[int]:
        if self.mode == modes().NONE or not hasattr(self.obj, "_get_lora_cases"):
            return [0]
        return sorted(set([0] + list(self.obj._get_lora_cases())))

    def probe(self, num_reqs: int, q: int, lora: int = 0):
        uq = self.obj.uniform_decode_query_len
        mode, desc = type(self.obj).dispatch(self.obj, num_reqs * q, uniform_decode=(q == uq),
                                             has_lora=lora > 0, num_active_loras=lora)
        return mode, int(desc.num_tokens)

    def num_graphs(self) -> int:
        return sum(len(keys) for keys in self.obj.cudagraph_keys.values())


class V2Owner(GraphOwner):
    kind = "V2"

    @property
    def max_capture_size(self) -> int:
        """The widest uniform decode graph the sizing allows, in tokens (0.34: the decode
        request sizes at the widest query length, within the recorded token ceiling)."""
        cc = self.vllm_config.compilation_config
        ceiling = int(cc.max_cudagraph_capture_size or 0)
        if not split_sizing(self.vllm_config):
            return ceiling
        budget = min(ceiling, int(getattr(cc, "max_decode_cudagraph_capture_tokens", 0)
                                  or ceiling))
        reqs = max(cc.decode_cudagraph_capture_request_sizes or [0])
        return min(budget, reqs * max(self.query_lens()))

    def query_lens(self) -> list[int]:
        qs = {d.uniform_token_count for descs in self.obj._capture_descs.values()
              for d in descs if getattr(d, "uniform_token_count", None)}
        return sorted(qs) or [int(self.obj.decode_query_len)]

    def lora_cases(self) -> list[int]:
        return sorted(set([0] + list(getattr(self.obj, "lora_capture_cases", None) or [0])))

    def probe(self, num_reqs: int, q: int, lora: int = 0):
        obj = self.obj
        kwargs = {"max_query_len": q} if takes_max_query_len(type(obj)) else {}
        view = copy.copy(obj)            # dispatch answers only once graphs exist
        view._graphs_captured = True
        with quiet():
            desc = type(obj).dispatch(view, num_reqs, num_reqs * q, q, lora, **kwargs)
        return desc.cg_mode, int(desc.num_tokens)

    def num_graphs(self) -> int:
        return sum(len(descs) for descs in self.obj._capture_descs.values())


def takes_max_query_len(cls) -> bool:
    """Whether V2 ``dispatch`` takes ``max_query_len`` (0.29+)."""
    try:
        return "max_query_len" in inspect.signature(cls.dispatch).parameters
    except (TypeError, ValueError):
        return False


def dispatch_params(cls) -> tuple[str, ...]:
    try:
        return tuple(inspect.signature(cls.dispatch).parameters)
    except (TypeError, ValueError, AttributeError):
        return ()


def owner_of(runner) -> GraphOwner | None:
    """The graph owner of a model runner (V2 ``cudagraph_manager`` or V1
    ``cudagraph_dispatcher``), or None when it has none (yet)."""
    obj = getattr(runner, "cudagraph_manager", None)
    if obj is not None and hasattr(obj, "_candidates"):
        return V2Owner(obj, runner.vllm_config)
    obj = getattr(runner, "cudagraph_dispatcher", None)
    if obj is not None and hasattr(obj, "cudagraph_keys"):
        return V1Owner(obj, runner.vllm_config)
    return None


def is_v2_runner(runner) -> bool:
    """Model runner V2 (``vllm.v1.worker.gpu.model_runner``) rather than V1."""
    flag = getattr(runner, "kvguard_runner_v2", None)       # the offline planner's stand-in
    if isinstance(flag, bool):
        return flag
    return type(runner).__module__.startswith("vllm.v1.worker.gpu.")


def split_sizing(vllm_config) -> bool:
    """vLLM 0.34+: capture sizing split into prefill token sizes and decode request sizes
    (``decode_cudagraph_capture_request_sizes``), model runner V2 only."""
    return hasattr(vllm_config.compilation_config, "decode_cudagraph_capture_request_sizes")


def v1_probe(vllm_config, mode, q: int) -> V1Owner:
    """A fresh ``CudagraphDispatcher`` with keys for the current capture sizes."""
    from vllm.v1.cudagraph_dispatcher import CudagraphDispatcher

    d = CudagraphDispatcher(vllm_config)
    d.initialize_cudagraph_keys(mode, q)
    return V1Owner(d, vllm_config)


def v2_probe(vllm_config, mode, decode_query_len: int, lora_capture_cases=None,
             varlen_decode: bool = False, cls=None) -> V2Owner:
    """A new ``CudaGraphManager`` with candidates for the current capture sizes, built
    without its ``__init__`` (which needs an initialised pipeline group and a graph pool):
    only the attributes ``_init_candidates`` and ``dispatch`` read. The unit tests check it
    against the real ``__init__`` on every pinned version."""
    if cls is None:
        from vllm.v1.worker.gpu.cudagraph_utils import CudaGraphManager as cls
    m = cls.__new__(cls)
    pc = vllm_config.parallel_config
    max_reqs = vllm_config.scheduler_config.max_num_seqs
    if split_sizing(vllm_config):       # 0.34: per query length, the most requests it has
        decode_max_reqs = {q: min(n, max_reqs) for q, n in sorted(
            vllm_config.get_decode_cudagraph_query_lens(decode_query_len).items())}
        decode_query_len = max(decode_max_reqs)
    else:
        decode_max_reqs = None
    attrs = dict(
        vllm_config=vllm_config, device=None,
        max_num_reqs=vllm_config.scheduler_config.max_num_seqs,
        compilation_config=vllm_config.compilation_config, cudagraph_mode=mode,
        decode_query_len=decode_query_len, varlen_decode=varlen_decode, ubatch_runner=None,
        dp_size=pc.data_parallel_size, tp_size=pc.tensor_parallel_size,
        is_first_pp_rank=True, is_last_pp_rank=True,
        lora_capture_cases=list(lora_capture_cases or [0]), graphs={}, pool=None,
        _graphs_captured=False, _max_full_descs_to_capture=None, _capture_mem_samples=None,
        _candidates={}, _capture_descs={}, use_breakable_cg=False, breakable_cg_runner=None)
    if decode_max_reqs is not None:
        attrs.update(decode_max_reqs=decode_max_reqs, decode_request_sizes=None,
                     _decode_descs={}, capture_stream=None)
    for name, value in attrs.items():
        if not isinstance(getattr(cls, name, None), property):
            setattr(m, name, value)
    if hasattr(m, "_build_lora_dispatch_map"):
        m._lora_dispatch_map, m._max_lora_case = m._build_lora_dispatch_map()
    m._init_candidates()
    return V2Owner(m, vllm_config)


# ----------------------------------------------------------------------------- frames
def v1_caller_code(runner):
    """The code object of the V1 runner method that calls ``dispatch`` with the batch shape
    in its locals (``num_reqs``, ``max_num_scheduled_tokens``), or None."""
    fn = getattr(type(runner), "_determine_batch_execution_and_padding", None) if runner else None
    fn = inspect.unwrap(fn) if fn is not None else None
    code = getattr(fn, "__code__", None)
    if code is None or not {"num_reqs", "max_num_scheduled_tokens"} <= set(code.co_varnames):
        return None
    return code


def v2_dispatch_code(cls):
    """The code object of V2 ``CudaGraphManager.dispatch`` (whose miss path builds the
    eager descriptor)."""
    return inspect.unwrap(cls.dispatch).__code__


def frame_locals(code, limit: int = FRAME_LIMIT) -> dict | None:
    """Locals of the nearest frame up the stack running ``code`` (at most ``limit`` frames
    above the caller), or None."""
    if code is None:
        return None
    frame = sys._getframe(1)
    for _ in range(limit):
        if frame is None:
            return None
        if frame.f_code is code:
            return frame.f_locals
        frame = frame.f_back
    return None


def uniform_reason(rec, num_tokens, has_lora, without_lora) -> str:
    """Why a uniform decode missed its graph: LoRA, over the capture ceiling, or no graph
    at this draft length."""
    if has_lora and without_lora() is rec.best:
        return "lora"
    if num_tokens > rec.max_size:
        return "over_max_capture_size"
    return "not_captured_for_draft_length"
