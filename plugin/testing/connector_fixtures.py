"""A KV connector that defers its match, loaded by vLLM's own connector factory.

``DeferringConnector`` answers ``get_num_new_matched_tokens`` with ``(None, False)`` (the
connector's "ask me again next step", as LMCache or a P/D connector do while a lookup is
in flight) ``defers`` times per request, then ``(matched_tokens, is_async)``, like the
``MockKVConnector`` of vLLM's ``tests/v1/kv_connector/unit/utils.py`` (which ships only
in the sdist). :func:`make_connector_scheduler` builds a real ``Scheduler`` with it,
through ``KVTransferConfig(kv_connector_module_path=...)``.
"""
from __future__ import annotations

from collections import defaultdict

from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1,
                                                               KVConnectorMetadata,
                                                               SupportsHMA)

from vllm_kvguard.testing.kv_fixtures import (BLOCK_SIZE, accepted, attention_spec,
                                              kv_cache_config, make_vllm_config)


class DeferringConnector(KVConnectorBase_V1):
    """Defers each request's match ``defers`` times (``kv_connector_extra_config``)."""

    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config
        self.matched = int(extra.get("matched_tokens", 0))
        self.is_async = bool(extra.get("is_async", False))
        self._left = defaultdict(lambda: int(extra.get("defers", 0)))

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        if self._left[request.request_id] > 0:
            self._left[request.request_id] -= 1
            return None, False
        return self.matched, self.is_async

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        pass

    def build_connector_meta(self, scheduler_output):
        return KVConnectorMetadata()

    # Worker-side methods: never called by a scheduler-only test.
    def start_load_kv(self, forward_context, **kwargs):
        pass

    def wait_for_layer_load(self, layer_name):
        pass

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        pass

    def wait_for_save(self):
        pass


def make_connector_scheduler(*, defers: int, is_async: bool = False, matched_tokens: int = 0,
                             num_gpu_blocks: int = 10000, block_size: int = BLOCK_SIZE,
                             max_num_inflight_kv_loads: int | None = None, **transfer):
    """A real ``Scheduler`` with prefix caching and a :class:`DeferringConnector`;
    ``transfer``: more ``KVTransferConfig`` fields (``kv_load_failure_policy``);
    ``max_num_inflight_kv_loads`` (0.34+): the scheduler asks ``may_load_async``."""
    from vllm.config import KVTransferConfig
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    config = make_vllm_config(num_gpu_blocks=num_gpu_blocks, block_size=block_size)
    config.scheduler_config.disable_hybrid_kv_cache_manager = True    # one group: no HMA
    if max_num_inflight_kv_loads is not None:
        config.scheduler_config.max_num_inflight_kv_loads = max_num_inflight_kv_loads
    config.kv_transfer_config = KVTransferConfig(
        kv_connector="DeferringConnector", kv_role="kv_both",
        kv_connector_module_path=__name__,
        kv_connector_extra_config={"defers": defers, "is_async": is_async,
                                   "matched_tokens": matched_tokens}, **transfer)
    kcc = kv_cache_config([attention_spec(block_size)], num_gpu_blocks)
    return Scheduler(**accepted(Scheduler.__init__, dict(
        vllm_config=config, kv_cache_config=kcc,
        structured_output_manager=StructuredOutputManager(config), block_size=block_size,
        log_stats=False)))


class HybridHitConnector(DeferringConnector, SupportsHMA):
    """A hybrid-capable (``SupportsHMA``) connector that reports a synchronous external
    hit of ``matched_tokens`` for every prompt longer than that, nothing for shorter ones.
    Its worker side loads nothing: the hit blocks keep whatever the pool holds, so only
    the scheduler's accounting of such a request is meaningful, never its outputs."""

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        if request.num_prompt_tokens <= self.matched:
            return 0, False
        return max(0, self.matched - num_computed_tokens), False

    def request_finished_all_groups(self, request, block_ids):
        return False, None
