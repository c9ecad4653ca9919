"""Host surface: the front end's input processing (refusal at the door).

Targets
    ``vllm.v1.engine.input_processor.InputProcessor.process_inputs`` (all pins)
        -> hook ``kvguard_admit`` -> :mod:`vllm_kvguard.fixes.estimation.admission`: a request whose
        prompt plus ``max_tokens`` can never fit the KV cache (by the certificate its
        EngineCore published at startup, through the ``warmup`` patch's startup report)
        is refused with a ``ValueError`` naming its block need, the pool and the bounding
        group: ``LLM.generate`` raises it, ``vllm serve`` answers HTTP 400, nothing
        enters EngineCore. ``KVGUARD_ADMISSION=off`` leaves this patch out. Its setup
        registers the door (``admission.DOOR``) in the process that takes requests.
Why
    Without it such a request is admitted, grows until it can never be readmitted and
    waits forever, holding the queue (vllm#39734, vllm#53130, vllm#45414, vllm#53868;
    vllm#52530, which would have refused it, closed without the HTTP 400).
Remove when
    vLLM refuses never-fitting requests at input validation with an HTTP 400.
"""
from vllm_kvguard.hostcall import HostCall, hooked
from vllm_kvguard.manager import hook
from vllm_kvguard.registry import Patch, Target

NAME = "admission"


@hooked(NAME)
def process_inputs(call: HostCall):
    request = call()
    hook().kvguard_admit(request=request)
    return request


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
                    process_inputs)],
    vllm_versions=">=0.27.1,<0.35",
    upstream=("vllm#39734", "vllm#53130", "vllm#45414", "vllm#53868", "vllm#52530"),
    remove_when="vLLM refuses never-fitting requests at input validation (HTTP 400)",
    setup=_setup,
    teardown=_teardown,
)
