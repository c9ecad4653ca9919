"""vllm-kvguard: harden vLLM's KV-cache allocation, warmup/estimation and CUDA-graph
runner without forking vLLM.

vLLM calls :func:`register` (entry point ``vllm.general_plugins: kvguard``) in every
process it starts. With ``KVGUARD`` unset or off, it reads a few environment
variables and returns: nothing is imported from vLLM and nothing is wrapped.
"""

__version__ = "0.1.0"


def register() -> None:
    """vLLM entry point. Idempotent, cheap when off, never raises into vLLM."""
    try:
        from vllm_kvguard import activation

        activation.activate()
    except Exception as exc:  # fail open: vLLM must keep running unpatched
        import logging

        logging.getLogger("vllm.kvguard").error(
            "vllm-kvguard: internal error while activating (%s: %s); vLLM runs unpatched",
            type(exc).__name__, exc)
