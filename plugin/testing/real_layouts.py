"""Real models' KV-cache layouts on vLLM's REAL ``Scheduler``, for the admission truth tests.

A :class:`RealLayout` names a model's ``config.json`` (``unit_tests/data/configs``) and the
engine settings; its groups, windows, block sizes and Mamba modes are what vLLM's own layer
classes report (the planner's path: the model class on the meta device under vLLM's CUDA
platform, :mod:`vllm_kvguard.tools.plan.layer_specs`) and vLLM's own ``KVCacheConfig``
(:func:`vllm_kvguard.tools.plan.preflight.kv_cache_config`). The pool is then cut to
``num_blocks`` so the limits bind below ``max_model_len``. It steps like
:class:`.sched_layouts.Layout` (``run_alone``, ``true_limits``).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

from vllm_kvguard.testing.sched_layouts import Unsupported

#: the real configs shipped with the tests
CONFIGS = Path(__file__).resolve().parents[2] / "unit_tests" / "data" / "configs"

_built: dict = {}


@dataclass(frozen=True)
class RealLayout:
    """``model``: a folder of :data:`CONFIGS`; ``async_sched``: vLLM's ``AsyncScheduler``
    stepped as EngineCore's batch queue of 2 runs it (the 0.34 engine's default), else
    ``Scheduler``; ``prefix_caching`` False puts hybrid models in Mamba mode ``none``."""

    model: str
    num_blocks: int
    max_model_len: int = 2048
    budget: int = 512
    async_sched: bool = False
    prefix_caching: bool = True
    small_prompt: int = 8

    @property
    def overlap(self) -> bool:
        return self.async_sched

    @property
    def name(self) -> str:
        bits = [self.model, f"nb={self.num_blocks}", f"B={self.budget}",
                f"mml={self.max_model_len}"]
        bits += [] if self.prefix_caching else ["pc=off"]
        bits += ["async"] if self.async_sched else []
        return " ".join(bits)

    def configs(self):
        """(vllm_config, kv_cache_config) as vLLM builds them for this model (cached)."""
        key = (self.model, self.max_model_len, self.budget, self.prefix_caching)
        if key not in _built:
            from vllm_kvguard.tools.plan import layer_specs, preflight
            from vllm_kvguard.tools.plan.cudagraph import engine_args

            args = engine_args(str(CONFIGS / self.model), max_num_seqs=8,
                               max_model_len=self.max_model_len,
                               max_num_batched_tokens=self.budget,
                               enable_prefix_caching=self.prefix_caching)
            try:
                built = layer_specs.build(args, within=lambda vc, specs: (
                    preflight.kv_cache_config(vc, specs, num_gpu_blocks=None,
                                              kv_bytes=1 << 40)))
            except Exception as exc:      # noqa: BLE001 - a pin that cannot build it here
                raise Unsupported(f"{self.model}: {type(exc).__name__}: "
                                  f"{str(exc)[:160]}") from exc
            _built[key] = (built.vllm_config, built.result)
        return _built[key]

    @property
    def block_size(self) -> int:
        """The block size requests are hashed at (EngineCore's hash block size)."""
        from vllm_kvguard.fixes.estimation.schedule import block_sizes

        return block_sizes(*self.configs())[1]

    def scheduler(self):
        """A fresh real scheduler over this model's KV cache, cut to ``num_blocks``, built
        as EngineCore builds it (``schedule.build_scheduler``)."""
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler
        from vllm.v1.core.sched.scheduler import Scheduler

        from vllm_kvguard.fixes.estimation.schedule import build_scheduler

        vc, kcc = self.configs()
        kcc = copy.copy(kcc)
        kcc.num_blocks = self.num_blocks
        vc.cache_config.num_gpu_blocks = self.num_blocks
        vc.scheduler_config.async_scheduling = self.async_sched
        return build_scheduler(vc, kcc, AsyncScheduler if self.async_sched else Scheduler)
