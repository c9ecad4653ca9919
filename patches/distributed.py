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
Why
    The plugin is configured by the environment; Ray workers on a cluster started
    without ``KVGUARD`` would otherwise run with the plugin off, silently.
Upstream
    none filed (vLLM's prefix list is fixed; ``VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY``
    is the user's alternative).
Remove when
    vLLM copies plugin-declared variables to Ray workers.
"""
from __future__ import annotations

import os

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


def _setup(flags):
    from vllm_kvguard.fixes import worker_env
    from vllm_kvguard.manager import register

    register(worker_env, "kvguard.worker_env")


def _teardown():
    from vllm_kvguard.manager import unregister

    unregister("kvguard.worker_env")


TARGETS = {f"{MODULE}.get_env_vars_to_copy"}

PATCH = Patch(
    name=NAME,
    summary="every KVGUARD* variable travels with vLLM to its Ray workers",
    targets=[Target(MODULE, "get_env_vars_to_copy", get_env_vars_to_copy,
                    also_at=("vllm.v1.engine.utils", "vllm.v1.executor.ray_executor"))],
    uses=(Private(MODULE, "get_env_vars_to_copy", ("additional_vars",)),),
    vllm_versions=">=0.27.1,<0.34",
    upstream=(),
    remove_when="vLLM copies plugin-declared environment variables to Ray workers",
    setup=_setup,
    teardown=_teardown,
)
