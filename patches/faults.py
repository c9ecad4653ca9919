"""Host surface: test-only fault injection (allocator, KV connector).

Targets
    ``vllm.v1.core.block_pool.BlockPool.get_new_blocks``
        -> hook ``kvguard_inject_fault`` -> :mod:`vllm_kvguard.fixes.faults`
    ``KVConnectorBase_V1.__init__`` -> for a scheduler-role connector, its
        ``get_num_new_matched_tokens`` / ``update_state_after_alloc`` ask hook
        ``kvguard_inject_connector_fault`` first
    ``Scheduler.update_from_output`` -> hook ``kvguard_inject_freeze`` (the step blocks
        forever: a frozen EngineCore), then ``kvguard_inject_load_failure`` (the worker's
        report of this step's KV loads, with some of them failed)
Run-time changes
    ``KVConnectorBase_V1`` methods per scheduler-side connector: the faulting shadow.
Why
    Faults must happen inside EngineCore, another process; vLLM loads our entry point
    there, so the plugin itself is the injector. Enabled only by ``KVGUARD_FAULTS``
    (works with ``KVGUARD_PATCHES=none`` to show vLLM's own behaviour).
Upstream
    none: a rehearsal tool, not a fix.
Remove when
    never (test tooling); it is off unless KVGUARD_FAULTS is set.
"""
from vllm_kvguard.manager import hook
from vllm_kvguard.hostcall import HostCall, hooked
from vllm_kvguard.registry import InstanceAttr, Patch, Target

NAME = "faults"
BASE = "vllm.distributed.kv_transfer.kv_connector.v1.base"
PHASES = {"lookup": "get_num_new_matched_tokens", "update": "update_state_after_alloc"}
SHADOWS = {phase: InstanceAttr(BASE, "KVConnectorBase_V1", method,
                               "raises the injected connector fault, then calls the method")
           for phase, method in PHASES.items()}


@hooked(NAME)
def get_new_blocks(call: HostCall):
    exc = hook().kvguard_inject_fault(pool=call.instance, num_blocks=call.arg(0, "num_blocks"))
    if exc is not None:
        raise exc
    return call()


@hooked(NAME)
def connector_init(call: HostCall):
    result = call()
    connector, role = call.instance, call.arg(1, "role")
    if getattr(role, "name", str(role)).upper().endswith("SCHEDULER"):
        for phase, change in SHADOWS.items():
            change.set(connector, _faulting(connector, phase, getattr(connector, PHASES[phase])))
    return result


@hooked(NAME)
def update_from_output(call: HostCall):
    hook().kvguard_inject_freeze(scheduler=call.instance)
    mro = hook().kvguard_inject_load_failure(
        scheduler=call.instance, scheduler_output=call.arg(0, "scheduler_output"),
        model_runner_output=call.arg(1, "model_runner_output"))
    if mro is not None:
        call.args, call.kwargs = (call.arg(0, "scheduler_output"), mro), {}
    return call()


def _faulting(connector, phase, fn):
    def faulting(request, *args, **kwargs):
        exc = hook().kvguard_inject_connector_fault(connector=connector, phase=phase,
                                                    request=request)
        if exc is not None:
            raise exc
        return fn(request, *args, **kwargs)

    faulting.__name__ = fn.__name__
    return faulting


_live: list = []


def injector():
    """The injector this patch registered (None when not applied): tests reset it."""
    return _live[0] if _live else None


def _setup(flags):
    from vllm_kvguard.fixes.faults import Injector
    from vllm_kvguard.manager import register

    _live[:] = [Injector(flags.faults)]
    register(_live[0], "kvguard.faults")


def _teardown():
    from vllm_kvguard.manager import unregister

    unregister("kvguard.faults")
    _live.clear()


PATCH = Patch(
    name=NAME,
    summary="test-only allocator / KV connector / frozen-step fault injection (KVGUARD_FAULTS)",
    targets=[Target("vllm.v1.core.block_pool", "BlockPool.get_new_blocks", get_new_blocks),
             Target(BASE, "KVConnectorBase_V1.__init__", connector_init),
             Target("vllm.v1.core.sched.scheduler", "Scheduler.update_from_output",
                    update_from_output)],
    changes=tuple(SHADOWS.values()),
    vllm_versions=">=0.27.1,<0.35",
    upstream=(),
    remove_when="never: rehearsal tooling, off unless KVGUARD_FAULTS is set",
    setup=_setup,
    teardown=_teardown,
)
