"""Host surface: the front end's input processing (refusal at the door).

Targets
    ``vllm.v1.engine.input_processor.InputProcessor.process_inputs`` (all pins)
        -> hook ``kvguard_admit`` -> :mod:`vllm_kvguard.fixes.estimation.admission`: a request whose
        prompt cannot be admitted, or whose prompt plus ``max_tokens`` can never complete
        (by the limits its EngineCore published at startup, through the ``warmup`` patch's
        startup report, and handed over as JSON numbers in the counters' ``collective_rpc``
        reply) is refused with a ``ValueError`` naming its numbers, the binding group and
        the settings that give room: ``LLM.generate`` raises it, ``vllm serve`` answers
        HTTP 400, nothing enters EngineCore. ``KVGUARD_ADMISSION=off`` leaves this patch
        out. Its setup registers the door (``admission.DOOR``) in the process that takes
        requests.
    ``vllm.v1.engine.async_llm.AsyncLLM.add_request`` (all pins)
        -> :func:`vllm_kvguard.remote.first_reply`: until the engine's first reply has
        come (or failed, or 10 s passed), a request waits for it, so the first request
        after ``vllm serve`` starts is checked too. ``LLMEngine`` asks synchronously.
    Outside the proven range its self-test (:func:`vllm_kvguard.verify.estimation.admission`)
        runs where the limits are made, not here: in the scheduler's process, on a copy of
        that engine's config, as the ``warmup`` patch's ``Scheduler.__init__`` wrapper
        calls :func:`vllm_kvguard.verify.due` before the certificate publishes. Failed
        there: no limits published (the door admits every request), the patch is off in
        that process and, once the verdict arrives in the counters' reply, here too.
Why
    Without it such a request is admitted, grows until it can never be readmitted and
    waits forever, holding the queue (vllm#39734, vllm#53130, vllm#45414, vllm#53868;
    vllm#52530, which would have refused it, closed without the HTTP 400).
Remove when
    vLLM refuses never-fitting requests at input validation with an HTTP 400.
"""
import logging

from vllm_kvguard import remote
from vllm_kvguard.hostcall import HostCall, hooked
from vllm_kvguard.log import once
from vllm_kvguard.manager import hook
from vllm_kvguard.registry import Patch, Target

NAME = "admission"


@hooked(NAME)
def process_inputs(call: HostCall):
    request = call()
    hook().kvguard_admit(request=request)
    return request


@hooked(NAME)
def add_request(call: HostCall):
    """``AsyncLLM.add_request``: the engine's limits are known before the first request
    is checked (after the first reply, at no cost)."""
    if call.instance is None or remote.first_reply_ended(call.instance):
        return call()
    return _after_first_reply(call)


async def _after_first_reply(call: HostCall):
    try:
        await remote.first_reply(call.instance)
    except Exception as exc:                 # never in the request's way
        once(logging.INFO, ("admission-first-reply", type(exc).__name__),
             "vllm-kvguard: waiting for the engine's admission limits failed (%s: %s)",
             type(exc).__name__, exc)
    return await call()


def _setup(flags):
    from vllm_kvguard.fixes.estimation import admission
    from vllm_kvguard.manager import register

    register(admission.DOOR, "kvguard.door")


def _teardown():
    from vllm_kvguard.manager import unregister

    unregister("kvguard.door")


PATCH = Patch(
    name=NAME,
    summary="refusal at the door: a request that can never fit is a ValueError (HTTP 400)",
    targets=[Target("vllm.v1.engine.input_processor", "InputProcessor.process_inputs",
                    process_inputs),
             Target("vllm.v1.engine.async_llm", "AsyncLLM.add_request", add_request)],
    vllm_versions=">=0.27.1,<0.35",
    upstream=("vllm#39734", "vllm#53130", "vllm#45414", "vllm#53868", "vllm#52530"),
    remove_when="vLLM refuses never-fitting requests at input validation (HTTP 400)",
    setup=_setup,
    teardown=_teardown,
)
