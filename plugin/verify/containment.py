"""Self-test of the ``containment`` patch: a real ``Scheduler`` with a KV connector that
vLLM's own factory loads (so the patch's wrapper guards it), where the connector's
``get_num_new_matched_tokens`` raises for one of two requests: ``schedule()`` goes on,
that request finishes with an error and the other one runs to its length."""
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


def _scheduler():
    from vllm.config import KVTransferConfig
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    from vllm_kvguard.testing import kv_fixtures as kf

    config = kf.make_vllm_config(num_gpu_blocks=64)
    config.scheduler_config.disable_hybrid_kv_cache_manager = True
    config.kv_transfer_config = KVTransferConfig(
        kv_connector="SelfTestConnector", kv_role="kv_both", kv_connector_module_path=__name__,
        kv_connector_extra_config={"defers": 0})
    kcc = kf.kv_cache_config([kf.attention_spec()], 64)
    return Scheduler(**kf.accepted(Scheduler.__init__, dict(
        vllm_config=config, kv_cache_config=kcc,
        structured_output_manager=StructuredOutputManager(config),
        block_size=kf.BLOCK_SIZE, log_stats=False)))


def check() -> None:
    from vllm_kvguard.testing import kv_fixtures as kf

    sched = _scheduler()
    for i, rid in enumerate(("kvguard-selftest-ok", BAD)):
        sched.add_request(kf.make_request(rid, range(3 + i, 43 + i), max_tokens=2))
    reasons: dict[str, str] = {}
    try:
        for _ in range(8):
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
