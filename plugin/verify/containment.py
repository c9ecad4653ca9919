"""Self-test of the ``containment`` patch: a real ``Scheduler`` with a KV connector that
vLLM's own factory loads (so the patch's wrapper guards it), where the connector's
``get_num_new_matched_tokens`` raises for one of two requests: ``schedule()`` goes on,
that request finishes with an error and the other one runs to its length.

It runs in the scheduler's process on a copy of the engine's own ``VllmConfig`` (the
patch calls it before EngineCore builds its Scheduler): no config is built for it there."""
from __future__ import annotations

from vllm_kvguard.verify import SelfTestFailed

BAD = "kvguard-selftest-bad"


def _connector_class():
    from vllm_kvguard.testing.connector_fixtures import DeferringConnector

    class SelfTestConnector(DeferringConnector):
        def get_num_new_matched_tokens(self, request, num_computed_tokens):
            if request.request_id == BAD:
                raise KeyError(f"connector lost its state for {request.request_id}")
            return super().get_num_new_matched_tokens(request, num_computed_tokens)

    return SelfTestConnector


def __getattr__(name):                  # vLLM's factory loads the class from this module
    if name == "SelfTestConnector":
        cls = _connector_class()
        globals()[name] = cls
        return cls
    raise AttributeError(name)


def _scheduler(vllm_config):
    """A second, private ``Scheduler`` on a copy of ``vllm_config`` (vLLM's own, in the
    scheduler's process) with the self-test connector and a 64-block pool of its own."""
    import copy

    from vllm.config import KVTransferConfig
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    from vllm_kvguard.testing import kv_fixtures as kf

    config = copy.copy(vllm_config)
    sched_cfg = copy.copy(vllm_config.scheduler_config)
    sched_cfg.disable_hybrid_kv_cache_manager = True
    model_cfg = copy.copy(vllm_config.model_config)
    object.__setattr__(model_cfg, "skip_tokenizer_init", True)   # no tokenizer load
    for name, value in (("scheduler_config", sched_cfg), ("model_config", model_cfg),
                        ("kv_events_config", None), ("ec_transfer_config", None),
                        ("kv_transfer_config", KVTransferConfig(
                            kv_connector="SelfTestConnector", kv_role="kv_both",
                            kv_connector_module_path=__name__,
                            kv_connector_extra_config={"defers": 0}))):
        if hasattr(config, name):
            object.__setattr__(config, name, value)
    block_size = int(vllm_config.cache_config.block_size or kf.BLOCK_SIZE)
    kcc = kf.kv_cache_config([kf.attention_spec(block_size)], 64)
    return Scheduler(**kf.accepted(Scheduler.__init__, dict(
        vllm_config=config, kv_cache_config=kcc,
        structured_output_manager=StructuredOutputManager(config),
        block_size=block_size, hash_block_size=block_size, log_stats=False))), block_size


def check(vllm_config=None) -> None:
    """``vllm_config``: the engine's own (EngineCore, before its Scheduler is built); None
    (``kvguard doctor``, tests): the tiny Llama's."""
    from vllm_kvguard.testing import kv_fixtures as kf

    if vllm_config is None:
        vllm_config = kf.make_vllm_config(num_gpu_blocks=64)
    sched, block_size = _scheduler(vllm_config)
    for i, rid in enumerate(("kvguard-selftest-ok", BAD)):
        sched.add_request(kf.make_request(rid, range(3 + i, 43 + i), block_size=block_size,
                                          max_tokens=2))
    reasons: dict[str, str] = {}
    try:
        for _ in range(32):
            _out, outputs = kf.scheduler_step(sched)
            for eco in outputs.values():
                reasons.update({o.request_id: str(o.finish_reason).upper()
                                for o in eco.outputs if o.finish_reason is not None})
            if len(reasons) == 2:
                break
    except KeyError as exc:
        raise SelfTestFailed(f"one request's connector error escaped schedule(): {exc}") \
            from None
    if "LENGTH" not in reasons.get("kvguard-selftest-ok", ""):
        raise SelfTestFailed(f"the healthy request did not finish: {reasons}")
    if not any(w in reasons.get(BAD, "") for w in ("ERROR", "ABORT")):
        raise SelfTestFailed(f"the failing request was not ended: {reasons}")
    if sched.requests or kf.used_blocks(sched.kv_cache_manager):
        raise SelfTestFailed("requests or blocks left behind after both ended")
