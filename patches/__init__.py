"""The patch registry: one module per host surface, each a thin wrapt wrapper calling hooks.

======================  =====================================================================
patch                   module
======================  =====================================================================
``allocator``           :mod:`vllm_kvguard.patches.allocator` (transactional allocate_slots,
                        audit, liveness guard)
``faults``              :mod:`vllm_kvguard.patches.faults` (test-only fault injection,
                        enabled by ``KVGUARD_FAULTS``)
``warmup``              :mod:`vllm_kvguard.patches.warmup`
``cudagraph``           :mod:`vllm_kvguard.patches.cudagraph`
``admission``           :mod:`vllm_kvguard.patches.admission` (refusal at the door; the
                        certificate comes from ``warmup``'s startup report)
``distributed``         :mod:`vllm_kvguard.patches.distributed` (``KVGUARD*`` variables
                        travel to Ray workers; the workers' counters come to the front
                        end through ``collective_rpc``; applied whenever the plugin is on)
``containment``         :mod:`vllm_kvguard.patches.containment` (a KV connector's failure
                        ends only its request)
``health``              :mod:`vllm_kvguard.patches.health` (``/health`` 503 for a stalled
                        or wedged EngineCore; its heartbeat)
======================  =====================================================================

Each module defines ``PATCH`` (a :class:`vllm_kvguard.registry.Patch`) declaring its targets,
supported vLLM range, the upstream issue it mitigates and when it can be removed.
"""
from __future__ import annotations

import importlib

from vllm_kvguard.flags import Flags

_MODULES = ("allocator", "faults", "warmup", "cudagraph", "admission", "distributed",
            "containment", "health")


def _load():
    patches = []
    for name in _MODULES:
        patches.append(importlib.import_module(f"vllm_kvguard.patches.{name}").PATCH)
    return patches


ALL_PATCHES = _load()
BY_NAME = {p.name: p for p in ALL_PATCHES}


def select_patches(flags: Flags):
    """The patches the flags ask for, in registry order."""
    chosen = []
    for patch in ALL_PATCHES:
        if patch.name == "faults":
            if flags.faults is not None:
                chosen.append(patch)
        elif patch.name == "distributed":      # carries the flags: on with the plugin
            chosen.append(patch)
        elif patch.name in flags.patches:
            chosen.append(patch)
    return chosen
