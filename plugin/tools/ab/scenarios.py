"""The A/B scenarios of ``kvguard-ab`` and the workload spec and environment of each side.

A scenario names one load (engine settings, workload size, fault injection, the flags B
adds) that shows one thing the plugin does or costs. Both sides of a scenario run the same
spec; only their environment differs, so whatever differs in the result is the plugin's
doing. Kept apart from the command line and the runner so the scenario table reads as one
list.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from vllm_kvguard.tools.ab.workload import DEFAULTS

NGRAM_K3 = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
            "prompt_lookup_min": 2}
EMBEDDED = ("llama", "nemotron_h")


MIN_AUTO_ROUNDS = 3     # a sample's fastest round needs a few rounds to choose from


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    model: str = "llama"                       # embedded model used without --model
    engine: dict = field(default_factory=dict)
    gpu_engine: dict = field(default_factory=dict)
    workload: dict = field(default_factory=dict)
    faults: bool = False                       # inject allocator faults on both sides
    fault_spec: str = ""                       # this KVGUARD_FAULTS instead of --faults
    faulted_fail: bool = False                 # B fails the faulted requests, serves the rest
    env_b: dict = field(default_factory=dict)  # flags B adds to KVGUARD=1
    plugin_b: bool = True                      # False: an A/A run (the harness's own bias)
    default: bool = True                       # part of a bare ``kvguard-ab``
    min_rounds: int = MIN_AUTO_ROUNDS          # --rounds auto never goes below this


_POOL = {"num_gpu_blocks_override": 64, "block_size": 32}   # CPU attention: block % 32 == 0

SCENARIOS = {sc.name: sc for sc in (
    Scenario("baseline", "plain load, nothing goes wrong: what the plugin costs",
             engine=_POOL),
    Scenario("alloc-faults", "allocator faults injected in EngineCore at a fixed rate "
             "(A: injector only, B: injector + fixes)", engine=_POOL, faults=True),
    Scenario("connector-faults", "KV connector lookups fail in EngineCore (vLLM's "
             "ExampleConnector, KV files; A: injector only, B: injector + fixes): B fails only "
             "the faulted requests", engine={"block_size": 32, "enable_prefix_caching": False},
             workload={"connector": "ExampleConnector"}, faults=True,
             fault_spec="phase=lookup,every=5", faulted_fail=True, default=False),
    Scenario("kv-pressure", "a KV pool far smaller than the load: preemption and recompute",
             engine={"block_size": 32, "max_model_len": 128,
                     "disable_log_stats": False}),     # vLLM counts the preemptions
    Scenario("hybrid-spec", "NemotronH-style hybrid (Mamba2 + attention) with ngram k=3 "
             "(prefix caching off: vLLM's CPU limit; on CPU both sides zero-pad the conv weight "
             "that vLLM's kernel reads past: workload.pad_cpu_conv_weights)", model="nemotron_h",
             engine={"enable_prefix_caching": False, "speculative_config": NGRAM_K3},
             workload={"max_tokens": 8, "num_requests": 4}),   # slow steps on CPU: short
    Scenario("coverage", "decode shapes (16 seqs x (1+3) tokens) outgrow the captured graph "
             "sizes; on CPU nothing is captured, the audit counters show what would be",
             engine={"block_size": 32, "max_num_seqs": 16, "speculative_config": NGRAM_K3},
             gpu_engine={"enforce_eager": False,
                         "compilation_config": {"cudagraph_capture_sizes": [1, 2, 4, 8]}},
             workload={"num_requests": 16}, env_b={"KVGUARD_CUDAGRAPH_COMPLETE": "1"}),
    Scenario("self-check", "A/A: the plugin off on both sides; the ratio must be 1.0 within "
             "tolerance, or the harness (machine, pinning) is biased", engine=_POOL,
             plugin_b=False, default=False),
)}
DEFAULT_SCENARIOS = tuple(name for name, sc in SCENARIOS.items() if sc.default)
# the scenarios ``--serve`` runs (their engine settings are plain ``vllm serve`` flags)
SERVED = ("baseline", "alloc-faults")


def scenario_spec(sc: Scenario, settings: dict) -> dict:
    """The workload spec both sides run: scenario defaults, then the user's settings."""
    ov = settings["overrides"]
    engine = {**sc.engine, **ov}
    if sc.name == "kv-pressure" and "num_gpu_blocks_override" not in ov:
        # room for one max_model_len request plus a little: the load must preempt
        engine["num_gpu_blocks_override"] = (
            math.ceil(engine.get("max_model_len", 512) / engine.get("block_size", 32)) + 8)
    return {"model": settings["model"] or sc.model, "engine": engine,
            "gpu_engine": {k: v for k, v in sc.gpu_engine.items() if k not in ov},
            **sc.workload, **settings["workload"], "multiprocess": settings["multiprocess"],
            "cpus": settings.get("cpus")}


def scenario_envs(sc: Scenario, settings: dict) -> tuple[dict, dict, str, str]:
    """The environment of A and B (the plugin's flags; thread settings identical on both)."""
    common = settings.get("thread_env", {})
    if sc.faults:
        faults = {**common, "KVGUARD": "1",
                  "KVGUARD_FAULTS": sc.fault_spec or settings["faults"]}
        return ({**faults, "KVGUARD_PATCHES": "none"}, {**faults, **sc.env_b},
                "faults only", "on + faults")
    if not sc.plugin_b:
        return dict(common), dict(common), "off", "off (A/A)"
    return dict(common), {**common, "KVGUARD": "1", **sc.env_b}, "off", "on"


def workload_key(spec: dict) -> str:
    """What decides the greedy outputs (not the number of rounds)."""
    keep = ("model", "engine", "gpu_engine", "connector", "num_requests", "prompt_len",
            "prompt_lens", "max_tokens", "seed", "repetitive", "multiprocess")
    full = {**DEFAULTS, **spec}
    return json.dumps({k: full[k] for k in keep}, sort_keys=True)
