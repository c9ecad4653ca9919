"""Which of the driver's variables vLLM must copy to its Ray workers: every ``KVGUARD*``.

vLLM hands Ray workers only variables with its own prefixes (``VLLM_``, ``HF_``,
``NCCL_``, ...), so a worker on a cluster started without ``KVGUARD`` would load the
plugin switched off. Naming our variables here keeps vLLM's own exclusions
(``ray_non_carry_over_env_vars.json``) and its log line of what it copied.
"""
from __future__ import annotations

from typing import Mapping

from vllm_kvguard.hookspecs import hookimpl

PREFIX = "KVGUARD"


@hookimpl
def kvguard_worker_env_vars(environ: Mapping[str, str]):
    return sorted(name for name in environ if name.startswith(PREFIX))
