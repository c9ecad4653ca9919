"""Host surface: the scheduler-side KV connector's per-request calls.

Targets
    ``KVConnectorFactory.create_connector`` -> for a scheduler-role connector, hook
        ``kvguard_guard_connector_call`` per method -> :mod:`vllm_kvguard.fixes.containment.containment`
    ``Scheduler._build_kv_connector_meta`` -> hook ``kvguard_connector_meta_built``
    ``EngineCore._initialize_kv_caches`` -> outside the proven range only, the patch's
        self-test (:func:`vllm_kvguard.verify.due`) on the engine's own config, before
        EngineCore builds its Scheduler (the first scheduler-role connector is the fallback
        point for a Scheduler built without an EngineCore); nothing inside the range
Run-time changes
    ``KVConnectorBase_V1`` methods per scheduler-side connector (``get_num_new_matched_tokens``,
    ``update_state_after_alloc``, ``request_finished``, ``request_finished_all_groups``,
    and on 0.34+ ``may_load_async``, asked as a request enters the waiting queues with
    ``--max-num-inflight-kv-loads``): the guarded call, an instance attribute over
    whatever the connector has.
Why
    A connector's exception for one request escapes ``Scheduler.schedule`` (or
    ``add_request``) and kills EngineCore with every request on it.
Upstream
    vllm#43884, vllm#50454, vllm#51013, vllm#54914, vllm#46283.
Remove when
    vLLM's scheduler contains a connector's per-request failure to that request.
"""
from __future__ import annotations

from vllm_kvguard import manager as plugins
from vllm_kvguard import verify
from vllm_kvguard.hostcall import HostCall, hooked
from vllm_kvguard.registry import InstanceAttr, Patch, Target
from vllm_kvguard.versions import vllm_version

NAME = "containment"
BASE = "vllm.distributed.kv_transfer.kv_connector.v1.base"
METHODS = ("get_num_new_matched_tokens", "update_state_after_alloc", "request_finished",
           "request_finished_all_groups", "may_load_async")
SINCE = {"may_load_async": ">=0.34"}       # the releases that have the method
GUARDS = {m: InstanceAttr(BASE, "KVConnectorBase_V1", m, "the call, contained to its request",
                          required=m != "request_finished_all_groups", overwrite=True,
                          versions=SINCE.get(m, ""))
          for m in METHODS}


def _is_scheduler_role(role) -> bool:
    return getattr(role, "name", str(role)).upper().endswith("SCHEDULER")


@hooked(NAME)
def create_connector(call: HostCall):
    scheduler_role = _is_scheduler_role(call.arg(1, "role"))
    if scheduler_role and not verify.due(NAME, vllm_config=call.arg(0, "config")):
        return call()                   # its self-test failed here: reverted, vLLM as is
    connector = call()
    if scheduler_role:
        version = vllm_version()
        for method, change in GUARDS.items():
            fn = getattr(connector, method, None)
            if fn is None or not change.exists_in(version):
                continue
            guarded = plugins.hook().kvguard_guard_connector_call(
                connector=connector, method=method, fn=fn)
            if guarded is not None:
                change.set(connector, guarded)
    return connector


@hooked(NAME)
def build_kv_connector_meta(call: HostCall):
    meta = call()
    plugins.hook().kvguard_connector_meta_built(scheduler=call.instance,
                                                connector=call.arg(0, "connector"))
    return meta


@hooked(NAME)
def initialize_kv_caches(call: HostCall):
    kv_cache_config = call()
    verify.due(NAME, vllm_config=call.arg(0, "vllm_config"))
    return kv_cache_config


def _setup(flags):
    from vllm_kvguard.fixes.containment.containment import Containment

    plugins.register(Containment(), "kvguard.containment")


def _teardown():
    plugins.unregister("kvguard.containment")


PATCH = Patch(
    name=NAME,
    summary="per-request containment of KV connector failures",
    targets=[
        Target("vllm.distributed.kv_transfer.kv_connector.factory",
               "KVConnectorFactory.create_connector", create_connector),
        Target("vllm.v1.core.sched.scheduler", "Scheduler._build_kv_connector_meta",
               build_kv_connector_meta),
        Target("vllm.v1.engine.core", "EngineCore._initialize_kv_caches",
               initialize_kv_caches),
    ],
    changes=tuple(GUARDS.values()),
    vllm_versions=">=0.27.1,<0.35",
    upstream=("vllm#43884", "vllm#50454", "vllm#51013", "vllm#54914", "vllm#46283"),
    remove_when="vLLM's scheduler contains a KV connector's per-request failure to "
                "that request",
    setup=_setup,
    teardown=_teardown,
)
