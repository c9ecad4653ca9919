"""Host surface: ``BlockPool.get_new_blocks`` (test-only fault injection).

Targets
    ``vllm.v1.core.block_pool.BlockPool.get_new_blocks``
        -> hook ``kvguard_inject_fault`` -> :mod:`vllm_kvguard.fixes.faults`
Why
    Allocator faults must happen inside EngineCore, another process; vLLM loads our
    entry point there, so the plugin itself is the injector. Enabled only by
    ``KVGUARD_FAULTS`` (works with ``KVGUARD_PATCHES=none`` to show vLLM's own behaviour).
Upstream
    none: a rehearsal tool, not a fix.
Remove when
    never (test tooling); it is off unless KVGUARD_FAULTS is set.
"""
from vllm_kvguard.manager import hook
from vllm_kvguard.hostcall import HostCall, hooked
from vllm_kvguard.registry import Patch, Target

NAME = "faults"


@hooked(NAME)
def get_new_blocks(call: HostCall):
    exc = hook().kvguard_inject_fault(pool=call.instance, num_blocks=call.arg(0, "num_blocks"))
    if exc is not None:
        raise exc
    return call()


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
    summary="test-only allocator fault injection (KVGUARD_FAULTS)",
    targets=[Target("vllm.v1.core.block_pool", "BlockPool.get_new_blocks", get_new_blocks)],
    vllm_versions=">=0.27.1,<0.34",
    upstream=(),
    remove_when="never: rehearsal tooling, off unless KVGUARD_FAULTS is set",
    setup=_setup,
    teardown=_teardown,
)
