"""Host surface: vLLM's health check and EngineCore's construction.

Targets
    ``vllm.v1.engine.async_llm.AsyncLLM.check_health`` (behind ``GET /health``) -> after
        vLLM's own check passed, hook ``kvguard_check_health`` ->
        :mod:`vllm_kvguard.fixes.health.verdict`; a reason is raised as vLLM's own
        ``EngineDeadError``, which vLLM's route answers with 503 (its body stays empty:
        the route writes none; the reason is logged and on ``/metrics``).
    ``vllm.v1.engine.core.EngineCoreProc.run_busy_loop`` and ``DPEngineCoreProc``'s
        (entered once, after ``__init__``, which is where vLLM loads this plugin) -> hook
        ``kvguard_engine_core_started`` -> :mod:`vllm_kvguard.fixes.health.heartbeat`
        offers the rank's heartbeat to the front end (it rides the counters'
        ``collective_rpc`` reply). The allocator patch's ``kvguard_after_schedule`` hook
        updates it every step.
Why
    vLLM's ``/health`` reads only whether EngineCore has errored: a frozen EngineCore (a
    stuck collective or CUDA call, a KV load that never completes) or a wedged queue
    answers 200 while every request hangs; a busy engine must stay 200.
Upstream
    vllm#39863, vllm#19849 (open PR vllm#36451 adds an engine ping).
Remove when
    vLLM's ``check_health`` reports an EngineCore that holds work and completes no step.
"""
from __future__ import annotations

from vllm_kvguard.hostcall import HostCall, hooked
from vllm_kvguard.manager import hook
from vllm_kvguard.registry import Patch, Private, Target

NAME = "health"
ASYNC, CORE = "vllm.v1.engine.async_llm", "vllm.v1.engine.core"


@hooked(NAME)
def check_health(call: HostCall):
    return _checked(call)


async def _checked(call: HostCall) -> None:
    await call()                # vLLM's own check first: a dead engine answers as before
    reason = hook().kvguard_check_health(engine=call.instance)
    if reason:
        from vllm.v1.engine.exceptions import EngineDeadError

        raise EngineDeadError(f"vllm-kvguard: {reason}")


@hooked(NAME)
def run_busy_loop(call: HostCall):
    hook().kvguard_engine_core_started(engine_core=call.instance)
    return call()               # EngineCore's loop: returns at shutdown


def _setup(flags):
    from vllm_kvguard.fixes.health import heartbeat, verdict
    from vllm_kvguard.manager import register

    register(heartbeat.Heartbeat(), "kvguard.heartbeat")
    verdict._live[:] = [verdict.Verdict(flags.health_stall_s if flags else 300.0)]
    register(verdict._live[0], "kvguard.health")


def _teardown():
    from vllm_kvguard import remote
    from vllm_kvguard.fixes.health import heartbeat, verdict
    from vllm_kvguard.manager import unregister

    unregister("kvguard.heartbeat")
    unregister("kvguard.health")
    remote.offer(heartbeat.KEY, None)
    for v in verdict._live:
        v.close()
    verdict._live.clear()


PATCH = Patch(
    name=NAME,
    summary="/health answers 503 when EngineCore holds work and completes no step, or "
            "its queue is wedged; EngineCore's heartbeat on /metrics",
    targets=[Target(ASYNC, "AsyncLLM.check_health", check_health),
             Target(CORE, "EngineCoreProc.run_busy_loop", run_busy_loop),
             Target(CORE, "DPEngineCoreProc.run_busy_loop", run_busy_loop)],
    uses=(Private(ASYNC, "AsyncLLM", ("output_processor", "errored")),
          Private("vllm.v1.engine.output_processor", "OutputProcessor",
                  ("get_num_unfinished_requests",)),
          Private(CORE, "EngineCoreProc", ("vllm_config",)),
          Private("vllm.v1.core.sched.scheduler", "Scheduler", ("running", "waiting"))),
    vllm_versions=">=0.27.1,<0.35",
    upstream=("vllm#39863", "vllm#19849", "vllm#36451"),
    remove_when="vLLM's check_health reports an EngineCore that holds work and "
                "completes no step",
    setup=_setup,
    teardown=_teardown,
)
