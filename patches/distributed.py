"""Host surface: the environment vLLM copies from the driver to its Ray workers.

Targets
    ``vllm.ray.ray_env.get_env_vars_to_copy`` (also bound in ``vllm.v1.engine.utils``
    and ``vllm.v1.executor.ray_executor``)
        -> hook ``kvguard_worker_env_vars`` -> :mod:`vllm_kvguard.fixes.worker_env`
        The names the hook returns are passed as vLLM's own ``additional_vars``, so every
        ``KVGUARD*`` variable of the process that starts the executor reaches each Ray
        worker (legacy ``RayExecutor``, and the Ray data-parallel EngineCore actors),
        through vLLM's exclusions and its log line. ``RayExecutorV2`` copies the whole
        driver environment itself (node-local values win) and needs nothing.
    ``vllm.v1.engine.core.EngineCore.collective_rpc``
        -> :func:`vllm_kvguard.remote.engine_reply` when asked for ``"kvguard_snapshot"``
        (EngineCore's and every worker's counters, and EngineCore's admission limits as
        JSON numbers); any other call passes unchanged. The front end asks every
        data-parallel engine through the client's ``call_utility_all_async`` (0.32+).
    ``AsyncLLM.__init__`` / ``LLMEngine.__init__``
        -> :func:`vllm_kvguard.remote.attach`: the front end knows whom to ask.
Why
    The plugin is configured by the environment; Ray workers on a cluster started
    without ``KVGUARD`` would otherwise run with the plugin off, silently. Workers'
    counters (on other nodes, too) reach ``/metrics`` through vLLM's own RPC path.
Upstream
    none filed (vLLM's prefix list is fixed; ``VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY``
    is the user's alternative).
Remove when
    vLLM copies plugin-declared variables to Ray workers (the env target), and lets a
    plugin add its counters to the stats EngineCore sends the front end (the RPC targets).
"""
from __future__ import annotations

import os

from vllm_kvguard import remote
from vllm_kvguard.hostcall import HostCall, hooked
from vllm_kvguard.manager import hook
from vllm_kvguard.registry import Patch, Private, Target

NAME = "distributed"
MODULE = "vllm.ray.ray_env"


@hooked(NAME)
def get_env_vars_to_copy(call: HostCall):
    extra: set[str] = set()
    for names in hook().kvguard_worker_env_vars(environ=os.environ):
        extra.update(names or ())
    if extra:
        given = set(call.arg(1, "additional_vars") or ())
        if len(call.args) > 1:
            call.args = (call.args[0], given | extra, *call.args[2:])
        else:
            call.kwargs = {**call.kwargs, "additional_vars": given | extra}
    return call()


@hooked(NAME)
def engine_collective_rpc(call: HostCall):
    if call.arg(0, "method") == remote.METHOD:
        return remote.engine_reply(call.instance)
    return call()


@hooked(NAME)
def async_llm_init(call: HostCall):
    result = call()
    remote.attach(call.instance, is_async=True)
    return result


@hooked(NAME)
def llm_engine_init(call: HostCall):
    result = call()
    remote.attach(call.instance, is_async=False)
    return result


def _setup(flags):
    from vllm_kvguard.fixes import worker_env
    from vllm_kvguard.manager import register

    register(worker_env, "kvguard.worker_env")


def _teardown():
    from vllm_kvguard.manager import unregister

    unregister("kvguard.worker_env")


CORE, ASYNC, SYNC = "vllm.v1.engine.core", "vllm.v1.engine.async_llm", "vllm.v1.engine.llm_engine"
TARGETS = {f"{MODULE}.get_env_vars_to_copy", f"{CORE}.EngineCore.collective_rpc",
           f"{ASYNC}.AsyncLLM.__init__", f"{SYNC}.LLMEngine.__init__"}

PATCH = Patch(
    name=NAME,
    summary="every KVGUARD* variable travels with vLLM to its Ray workers; their "
            "counters come back through vLLM's collective_rpc",
    targets=[Target(MODULE, "get_env_vars_to_copy", get_env_vars_to_copy,
                    also_at=("vllm.v1.engine.utils", "vllm.v1.executor.ray_executor")),
             Target(CORE, "EngineCore.collective_rpc", engine_collective_rpc),
             Target(ASYNC, "AsyncLLM.__init__", async_llm_init),
             Target(SYNC, "LLMEngine.__init__", llm_engine_init)],
    uses=(Private(MODULE, "get_env_vars_to_copy", ("additional_vars",)),
          Private(CORE, "EngineCore", ("model_executor",)),
          Private(ASYNC, "AsyncLLM", ("collective_rpc", "errored", "engine_core")),
          Private("vllm.v1.engine.core_client", "AsyncMPClient", ("call_utility_all_async",),
                  ">=0.32"),
          Private(SYNC, "LLMEngine", ("collective_rpc",))),
    vllm_versions=">=0.27.1,<0.35",
    upstream=(),
    remove_when="vLLM copies plugin-declared environment variables to Ray workers",
    setup=_setup,
    teardown=_teardown,
)
