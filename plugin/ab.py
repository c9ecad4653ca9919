"""``kvguard-ab``: the same workload on the same installed vLLM with the plugin off (A) and
on (B), in one invocation, each engine in its own process; a side-by-side table on stdout,
a JSON file and a PNG chart. ``python -m vllm_kvguard.ab --help`` lists the options.

How it measures (see also :mod:`vllm_kvguard.abstats`):

* ``--repeat`` times per scenario, a fresh pair of processes (``python -m
  vllm_kvguard.workload --serve``), A and B: a given pair of processes carries a bias of
  its own (memory layout, hash seed; an A/A run measured several percent), which only
  fresh processes average out, as pyperf does;
* in a pair, both import vLLM and build their engine at the same time ("startup s" is
  ``LLM(...)`` alone, each under the same load from the other); then both stay alive,
  idle while the other works, pinned to the same CPU(s);
* ``--warmup`` unmeasured rounds on each, then one sample: ``--rounds`` generate rounds of
  the same deterministic greedy workload on each engine, one by one in ABBA order; a
  sample's throughput = generated tokens of a round / its fastest round inside
  ``LLM.generate`` (see :func:`abstats.throughput`);
* B/A = median of the per-pair ratios, with min-max; greedy outputs are compared request
  by request (against a fault-free, plugin-off reference run when A died); a side that
  died or failed to start is not started again for the later pairs;
* exit 1 if any check fails (B not completing every request, leaking blocks, differing
  greedy outputs, or a throughput ratio below ``--tolerance``; a median below it while
  the pairs spread more than twice the band and one pair is within it is reported as
  *inconclusive* instead: the noise may be what shows), 2 on a bad argument
  (before any engine starts), 130 on Ctrl-C or SIGTERM (after printing what was done).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_kvguard import __version__, abreport, abstats
from vllm_kvguard.workload import DEFAULTS, WorkloadProcess, run_in_subprocess

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
    Scenario("kv-pressure", "a KV pool far smaller than the load: preemption and recompute",
             engine={"block_size": 32, "max_model_len": 128,
                     "disable_log_stats": False}),     # vLLM counts the preemptions
    Scenario("hybrid-spec", "NemotronH-style hybrid (Mamba2 + attention) with ngram k=3 "
             "(prefix caching off: vLLM's CPU limit; on CPU both sides zero-pad the conv weight "
             "that vLLM's kernel reads past: workload.pad_cpu_conv_weights)", model="nemotron_h",
             engine={"enable_prefix_caching": False, "speculative_config": NGRAM_K3},
             workload={"max_tokens": 16}, min_rounds=6),     # slow rounds: more of them
    Scenario("coverage", "decode shapes (16 seqs x (1+3) tokens) outgrow the captured graph "
             "sizes; on CPU nothing is captured, the audit counters show what would be",
             engine={"block_size": 32, "max_num_seqs": 16, "speculative_config": NGRAM_K3},
             gpu_engine={"enforce_eager": False,
                         "compilation_config": {"cudagraph_capture_sizes": [1, 2, 4, 8]}},
             workload={"num_requests": 16}, env_b={"KVGUARD_CUDAGRAPH_COMPLETE": "1"},
             min_rounds=6),
    Scenario("self-check", "A/A: the plugin off on both sides; the ratio must be 1.0 within "
             "tolerance, or the harness (machine, pinning) is biased", engine=_POOL,
             plugin_b=False, default=False),
)}
DEFAULT_SCENARIOS = tuple(name for name, sc in SCENARIOS.items() if sc.default)

# CLI engine settings passed through to LLM(...): (flag, LLM keyword, type)
ENGINE_FLAGS = (
    ("--max-num-seqs", "max_num_seqs", int),
    ("--max-model-len", "max_model_len", int),
    ("--num-gpu-blocks-override", "num_gpu_blocks_override", int),
    ("--block-size", "block_size", int),
    ("--dtype", "dtype", str),
    ("--load-format", "load_format", str),
    ("--gpu-memory-utilization", "gpu_memory_utilization", float),
    ("--tensor-parallel-size", "tensor_parallel_size", int),
    ("--seed", "seed", int),
)


class UsageError(Exception):
    """A bad argument: reported as ``kvguard-ab: error: ...`` and exit status 2."""


# ---------------------------------------------------------------------------- arguments
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvguard-ab", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="A/B benchmark: the same workload with vllm-kvguard off (A) and on (B), "
                    "side by side, in one invocation.",
        epilog="Scenarios:\n" + "\n".join(f"  {s.name:13} {s.description}"
                                          for s in SCENARIOS.values())
        + "\n\nExit status: 0 every check passed, 1 a check failed (B lost requests, leaked "
          "blocks,\ndiffered from A's greedy outputs or was slower than --tolerance), 2 a bad "
          "argument\n(nothing started), 130 interrupted (what finished is still reported).")
    p.add_argument("--scenario", action="extend", nargs="+", metavar="NAME",
                   help=f"scenarios to run, several allowed; 'all' (the default) is "
                        f"{', '.join(DEFAULT_SCENARIOS)}")
    p.add_argument("--model", metavar="PATH",
                   help="a local model directory (config.json + weights) used by every "
                        "scenario; default: the embedded dummy-weight models "
                        f"({', '.join(EMBEDDED)}), no download")
    p.add_argument("--repeat", metavar="N", type=int, default=3,
                   help="fresh A/B process pairs per scenario, one paired throughput sample "
                        "each (default 3)")
    p.add_argument("--rounds", metavar="auto|N", default="auto",
                   help="generate rounds per sample, or 'auto': enough for --sample-seconds, "
                        "at least 3 (default auto)")
    p.add_argument("--sample-seconds", metavar="S", type=float, default=1.0,
                   help="target duration of one sample with --rounds auto (default 1.0)")
    p.add_argument("--warmup", metavar="N", type=int, default=2,
                   help="unmeasured rounds per engine before sampling (default 2)")
    p.add_argument("--tolerance", metavar="RATIO", type=float, default=0.97,
                   help="fail if the median throughput ratio B/A is below this (default 0.97)")
    p.add_argument("--faults", metavar="SPEC", default="every=7",
                   help="KVGUARD_FAULTS schedule of alloc-faults (default every=7)")
    p.add_argument("--threads", metavar="auto|N", default="auto",
                   help="OpenMP threads per engine, the same for A and B. auto (default): "
                        "1 with a CPU build of vLLM (its core binding off), so the two "
                        "engines and other processes on a small machine do not stall each "
                        "other's bound threads; untouched on a GPU build. 0: vLLM's own "
                        "setting. N: N threads, core binding off. With N threads, A and B "
                        "are both pinned to the same last N CPUs")
    g = p.add_argument_group("workload")
    g.add_argument("--num-requests", type=int, metavar="N", help="requests per round (scenario default)")
    g.add_argument("--prompt-len", type=int, metavar="N", help=f"prompt tokens (default {DEFAULTS['prompt_len']})")
    g.add_argument("--max-tokens", type=int, metavar="N", help=f"generated tokens per request (default "
                                                  f"{DEFAULTS['max_tokens']})")
    e = p.add_argument_group(
        "engine settings", "LLM(...) keywords, overriding every scenario's own. Defaults: "
        "dtype bfloat16, enforce_eager, max_model_len 512, max_num_seqs 8, seed 0, no "
        "tokenizer (token-id prompts), dummy weights for the embedded models")
    for flag, _, typ in ENGINE_FLAGS:
        e.add_argument(flag, type=typ, metavar={int: "N", float: "X"}.get(typ, "VALUE"))
    e.add_argument("--speculative-config", metavar="JSON",
                   help='e.g. \'{"method": "ngram", "num_speculative_tokens": 3}\'; null: none')
    e.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=None)
    e.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=None)
    e.add_argument("--engine-arg", action="append", default=[], metavar="KEY=JSON",
                   help="any other LLM(...) keyword, value as JSON (repeatable)")
    e.add_argument("--multiprocess", action="store_true",
                   help="EngineCore in its own process (vLLM's default; slower to start)")
    o = p.add_argument_group("output")
    o.add_argument("--json", default="kvguard-ab.json", metavar="PATH",
                   help="JSON report (default kvguard-ab.json)")
    o.add_argument("--png", default="kvguard-ab.png", metavar="PATH",
                   help="PNG chart (default kvguard-ab.png); --no-png: none")
    o.add_argument("--no-png", action="store_true")
    o.add_argument("--no-microbench", action="store_true",
                   help="skip the allocator/dispatch micro-benchmarks")
    o.add_argument("--timeout", metavar="S", type=float, default=900.0,
                   help="seconds an engine may take to start or to run one round (default 900)")
    o.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    return p


def _json_arg(flag: str, raw: str, example: str):
    try:
        return json.loads(raw)
    except json.JSONDecodeError as exc:
        raise UsageError(f"{flag}: {raw!r} is not valid JSON ({exc}); expected e.g. {example}")


def validate(args: argparse.Namespace) -> dict[str, Any]:
    """Check every argument (no engine, no vLLM import); return the run settings."""
    names: list[str] = []
    for raw in args.scenario or ["all"]:
        for name in filter(None, (n.strip() for n in raw.split(","))):
            if name == "all":
                names += [n for n in DEFAULT_SCENARIOS if n not in names]
            elif name not in SCENARIOS:
                raise UsageError(f"--scenario: unknown scenario {name!r}; valid: "
                                 f"{', '.join(SCENARIOS)}, all")
            elif name not in names:
                names.append(name)

    model = args.model
    if model is not None and model not in EMBEDDED:
        path = Path(model).expanduser()
        if not (path / "config.json").is_file():
            why = "does not exist" if not path.exists() else "has no config.json"
            raise UsageError(f"--model: {model!r} {why}; give a local model directory "
                             f"(config.json + weights), or one of the embedded models "
                             f"{', '.join(EMBEDDED)}, or leave --model out")
        model = str(path.resolve())

    overrides: dict[str, Any] = {}
    for flag, key, _ in ENGINE_FLAGS:
        val = getattr(args, key)
        if val is not None:
            overrides[key] = val
    for key in ("enforce_eager", "enable_prefix_caching"):
        if getattr(args, key) is not None:
            overrides[key] = getattr(args, key)
    if args.speculative_config is not None:
        spec = _json_arg("--speculative-config", args.speculative_config,
                         '\'{"method": "ngram", "num_speculative_tokens": 3}\' or null')
        if spec is not None and not (isinstance(spec, dict) and "method" in spec):
            raise UsageError(f"--speculative-config: {args.speculative_config!r} must be a "
                             f"JSON object with a \"method\" (e.g. ngram, eagle, eagle3, "
                             f"mtp, draft_model), or null for no speculative decoding")
        overrides["speculative_config"] = spec
    for item in args.engine_arg:
        key, sep, raw = item.partition("=")
        if not sep or not key.isidentifier():
            raise UsageError(f"--engine-arg: {item!r} is not KEY=VALUE with KEY an LLM(...) "
                             f"keyword, e.g. --engine-arg swap_space=0")
        try:
            overrides[key] = json.loads(raw)
        except json.JSONDecodeError:
            overrides[key] = raw                       # a bare string
    if model is not None and model not in EMBEDDED and "load_format" not in overrides:
        overrides["load_format"] = "auto"              # real weights for a real model

    if args.repeat < 1:
        raise UsageError(f"--repeat: {args.repeat} is not a whole number >= 1")
    if args.warmup < 0:
        raise UsageError(f"--warmup: {args.warmup} is not a whole number >= 0")
    if args.rounds != "auto":
        try:
            rounds = int(args.rounds)
            if rounds < 1:
                raise ValueError
        except ValueError:
            raise UsageError(f"--rounds: {args.rounds!r} is not a whole number >= 1 or 'auto'")
    else:
        rounds = "auto"
    if not 0.0 < args.tolerance <= 2.0:
        raise UsageError(f"--tolerance: {args.tolerance} is not a ratio in (0, 2], "
                         f"e.g. 0.97 (B may be up to 3% slower than A)")
    if args.sample_seconds <= 0:
        raise UsageError(f"--sample-seconds: {args.sample_seconds} is not > 0")
    if args.timeout <= 0:
        raise UsageError(f"--timeout: {args.timeout} is not > 0")
    if any(n == "alloc-faults" for n in names):
        from vllm_kvguard.flags import parse_faults

        try:
            parse_faults(args.faults)
        except ValueError as exc:
            raise UsageError(f"--faults: {exc}")
    for n, label in ((args.num_requests, "--num-requests"), (args.prompt_len, "--prompt-len"),
                     (args.max_tokens, "--max-tokens")):
        if n is not None and n < 1:
            raise UsageError(f"{label}: {n} is not a whole number >= 1")
    outputs = [args.json] + ([] if args.no_png else [args.png])
    for out in outputs:
        parent = Path(out).expanduser().resolve().parent
        if not parent.is_dir() or not os.access(parent, os.W_OK):
            raise UsageError(f"{'--json' if out == args.json else '--png'}: cannot write "
                             f"{out!r} (directory {str(parent)!r} missing or read-only)")
    workload = {k: getattr(args, k) for k in ("num_requests", "prompt_len", "max_tokens")
                if getattr(args, k) is not None}
    try:
        threads = (1 if cpu_build_of_vllm() else 0) if args.threads == "auto" else int(
            args.threads)
        if threads < 0:
            raise ValueError
    except ValueError:
        raise UsageError(f"--threads: {args.threads!r} is not auto or a whole number >= 0")
    thread_env = {} if not threads else {"OMP_NUM_THREADS": str(threads),
                                         "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    # A and B (and the reference) share the same CPUs: only one runs at a time, and what
    # else loads those CPUs hits both alike; unpinned, one process can sit for the whole
    # run beside a busy neighbour (a persistent bias ABBA order cannot cancel).
    allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    cpus = allowed[-threads:] if threads and len(allowed) >= threads else None
    return {"scenarios": names, "model": model, "overrides": overrides, "workload": workload,
            "repeat": args.repeat, "rounds": rounds, "warmup": args.warmup,
            "sample_seconds": args.sample_seconds, "tolerance": args.tolerance,
            "faults": args.faults, "multiprocess": args.multiprocess,
            "thread_env": thread_env, "cpus": cpus,
            "timeout": args.timeout}


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


def cpu_build_of_vllm() -> bool:
    """vllm-cpu, or a ``+cpu`` source build (package metadata only: no vLLM import)."""
    from importlib import metadata

    for dist in ("vllm-cpu", "vllm"):
        try:
            version = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
        return dist == "vllm-cpu" or "cpu" in version
    return False


def scenario_envs(sc: Scenario, settings: dict) -> tuple[dict, dict, str, str]:
    """The environment of A and B (the plugin's flags; thread settings identical on both)."""
    common = settings.get("thread_env", {})
    if sc.faults:
        faults = {**common, "KVGUARD": "1", "KVGUARD_FAULTS": settings["faults"]}
        return ({**faults, "KVGUARD_PATCHES": "none"}, {**faults, **sc.env_b},
                "faults only", "on + faults")
    if not sc.plugin_b:
        return dict(common), dict(common), "off", "off (A/A)"
    return dict(common), {**common, "KVGUARD": "1", **sc.env_b}, "off", "on"


def workload_key(spec: dict) -> str:
    """What decides the greedy outputs (not the number of rounds)."""
    keep = ("model", "engine", "gpu_engine", "num_requests", "prompt_len", "max_tokens",
            "seed", "repetitive", "multiprocess")
    full = {**DEFAULTS, **spec}
    return json.dumps({k: full[k] for k in keep}, sort_keys=True)


# ---------------------------------------------------------------------------- progress
class Progress:
    """One line per step on stderr (a tqdm bar instead when stderr is a terminal)."""

    def __init__(self, total: int, quiet: bool = False):
        self.t0 = time.monotonic()
        self.quiet = quiet
        self.bar = None
        if not quiet and sys.stderr.isatty():
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, file=sys.stderr, unit="step",
                                bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}]")
            except ImportError:
                pass

    def say(self, msg: str, advance: int = 0) -> None:
        if self.quiet:
            return
        if self.bar is not None:
            self.bar.set_description_str(msg[:60])
            self.bar.update(advance)
            return
        el = int(time.monotonic() - self.t0)
        print(f"[kvguard-ab {el // 60}:{el % 60:02d}] {msg}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def steps_for(settings: dict) -> int:
    warm = bool(settings["warmup"] or settings["rounds"] == "auto")
    per_pair = 2 * (1 + warm + 1 + 1)              # starts, warm-ups, sample, stops
    return (per_pair * settings["repeat"] * len(settings["scenarios"])
            + (2 if settings.get("microbench", True) else 0))


# ---------------------------------------------------------------------------- running
class Side:
    """One engine process of one A/B pair and what it reported."""

    def __init__(self, key: str, label: str, env: dict):
        self.key, self.label, self.env = key, label, env
        self.proc: WorkloadProcess | None = None
        self.ready: dict = {}
        self.warmup_s: list[float] = []
        self.sample: list[float] | None = []           # round times of the measured sample
        self.final: dict = {}
        self.died = self.hung = False
        self.error: str | None = None

    @property
    def usable(self) -> bool:
        return bool(self.ready.get("ok")) and not self.died and not self.hung

    def run_rounds(self, n: int, timeout: float) -> list[float] | None:
        if not self.usable:
            return None
        res = self.proc.rounds(n, timeout)
        self.died |= bool(res.get("engine_died"))
        self.hung |= bool(res.get("hung"))
        self.error = res.get("error") or self.error
        times = res.get("round_s") or []
        return times if res.get("ok") and len(times) == n else None

    @property
    def failed(self) -> bool:
        """Died, hung or never started: not worth starting again in a later pair."""
        return not self.ready.get("ok") or self.died or self.hung or bool(
            self.final.get("engine_died") or self.final.get("hung"))




def _best_s(times: list[float] | None) -> str:
    return f"fastest round {min(times):.3f} s" if times else "no sample"


def calibrate(settings: dict, sides: list[Side], floor: int = MIN_AUTO_ROUNDS) -> int:
    """``--rounds``, or for ``auto`` enough rounds to fill ``--sample-seconds`` (at least
    ``floor``: a scenario whose rounds are slow and noisy asks for more to choose from)."""
    if settings["rounds"] != "auto":
        return settings["rounds"]
    last = [s.warmup_s[-1] for s in sides if s.warmup_s]
    floor = max(floor, MIN_AUTO_ROUNDS)
    if not last:
        return floor
    return max(floor, min(200, math.ceil(settings["sample_seconds"] / max(min(last), 1e-3))))


def run_pair(name: str, index: int, spec: dict, sides: list[Side], settings: dict,
             rounds: int | None, prog: Progress, min_rounds: int = MIN_AUTO_ROUNDS) -> int | None:
    """One fresh A/B pair of processes: start (imports together, engines one by one), warm
    up, one sample of ``rounds`` rounds each in ABBA order, stop. ``rounds`` None: calibrate
    from the warm-up. Returns the rounds used."""
    timeout, tag = settings["timeout"], f"{name} [{index + 1}/{settings['repeat']}]"
    with contextlib.ExitStack() as stack:
        for side in sides:
            side.proc = stack.enter_context(WorkloadProcess(spec, side.env))
        prog.say(f"{tag}: importing vLLM in {' and '.join(s.key for s in sides)}")
        for side in sides:
            side.proc.imported(timeout)
        prog.say(f"{tag}: building the engines "
                 + ", ".join(f"{s.key} (plugin {s.label})" for s in sides))
        for side in sides:                  # built at once: each under the other's load
            if side.proc.imported(timeout).get("ok"):
                side.proc.start()
        for side in sides:
            side.ready = side.proc.ready(timeout)
            prog.say(f"{tag}: engine {side.key} "
                     + (f"up in {side.ready['engine_s']:.1f} s" if side.ready.get("ok")
                        else f"failed to start: {side.ready.get('error')}"), advance=1)
        if settings["warmup"] or rounds is None:
            for side in sides:
                side.warmup_s = side.run_rounds(max(1, settings["warmup"]), timeout) or []
                prog.say(f"{tag}: {side.key} warm-up " + (
                    f"{sum(side.warmup_s):.2f} s" if side.warmup_s
                    else f"FAILED ({side.error})"), advance=1)
        if rounds is None:
            rounds = calibrate(settings, sides, min_rounds)
        order = sides if index % 2 == 0 else sides[::-1]
        for j in range(rounds):                        # ABBA at round granularity
            for side in (order if j % 2 == 0 else order[::-1]):
                times = side.run_rounds(1, timeout)
                side.sample = None if times is None or side.sample is None else (
                    side.sample + times)
        prog.say(f"{tag}: sample of {rounds} rounds each: "
                 + ", ".join(f"{s.key} {_best_s(s.sample)}" for s in sides), advance=2)
        for side in sides:
            side.proc.request_finish()
        for side in sides:
            side.final = side.proc.finish(timeout)
        prog.say(f"{tag}: engines stopped", advance=2)
    return rounds


def _merge_counters(all_counters: list[dict]) -> dict:
    out: dict[str, dict[str, int]] = {}
    for counters in all_counters:
        for cat, reasons in (counters or {}).items():
            for reason, n in reasons.items():
                out.setdefault(cat, {})
                out[cat][reason] = out[cat].get(reason, 0) + n
    return out


def side_summary(runs: list[Side], repeat: int) -> dict:
    """One side over its pairs (see :func:`workload.Session.finish` for each result): sums
    of requests and counters, one throughput sample per pair (None where it had none)."""
    first = runs[0]
    finals = [r.final for r in runs]
    out_run = next((f for f in finals if f.get("outputs") is not None), {})
    kv = [f.get("kvguard") or {} for f in finals]
    totals: dict[str, int] = {}
    for f in finals:
        for k, v in (f.get("totals") or {}).items():
            totals[k] = totals.get(k, 0) + v
    held = [f["held_blocks"] for f in finals if f.get("held_blocks") is not None]
    tok_s = []
    for r in runs:
        tokens = r.final.get("tokens_per_round")
        tok_s.append(abstats.throughput(tokens, r.sample) if r.sample and tokens else None)
    tok_s += [None] * (repeat - len(tok_s))            # pairs this side was not restarted for
    died = any(r.died or f.get("engine_died") for r, f in zip(runs, finals))
    hung = any(r.hung or f.get("hung") for r, f in zip(runs, finals))
    failed = next((r for r in runs if r.failed), None)
    startups = [r.ready.get("engine_s") for r in runs if r.ready.get("engine_s") is not None]
    outputs = out_run.get("outputs")
    consistent = all(f.get("outputs_consistent", True) for f in finals) and all(
        f.get("outputs") in (None, outputs) for f in finals)
    return {
        "label": first.label, "env": first.env, "pairs": len(runs),
        "startup_s": abstats.summarize(startups)["median"],   # LLM(...) only, median
        "startup_s_all": startups,
        "import_s": abstats.summarize([r.ready.get("import_s") or 0 for r in runs])["median"],
        "startup_failed": not any(r.ready.get("ok") for r in runs),
        "engine_died": died and not hung, "hung": hung,
        "error": next((f.get("error") or r.error or r.ready.get("error") for r, f in
                       zip(runs, finals) if f.get("error") or r.error
                       or r.ready.get("error")), None),
        "totals": totals,
        "pool_blocks": out_run.get("pool_blocks"),
        "held_blocks": max(held) if held and not died and not hung else None,
        "died_held_blocks": next((f.get("died_held_blocks") for f in finals
                                  if f.get("died_held_blocks") is not None), None),
        "audit_violations": (None if any(f.get("audit_violations") is None for f in finals)
                             else [v for f in finals for v in f["audit_violations"]]),
        "warmup_round_s": [r.warmup_s for r in runs],
        "sample_round_s": [r.sample for r in runs],
        "tok_s": tok_s,
        "tokens_per_round": out_run.get("tokens_per_round"),
        "outputs": outputs, "finish_reasons": out_run.get("finish_reasons"),
        "outputs_consistent": consistent,
        "counters": _merge_counters([k.get("counters") for k in kv]),
        "patches": (kv[0] or {}).get("results"),
        "faults_injected": sum(f.get("faults_injected") or 0 for f in finals),
        "platform": next((f.get("platform") for f in finals if f.get("platform")), None),
        "preemptions": (None if any(f.get("preemptions") is None for f in finals)
                        else sum(f["preemptions"] for f in finals)),
        "coverage": next((k.get("coverage") for k in kv if k.get("coverage")), None),
        # with --multiprocess the fixes run in EngineCore: their counters are not seen here
        "engine_core_separate": bool(first.proc and first.proc.spec.get("multiprocess")),
        "stderr_tail": failed.final.get("stderr") if failed else None,
    }


def run_scenario(sc: Scenario, settings: dict, prog: Progress,
                 references: dict[str, dict], environment: dict) -> dict:
    """``--repeat`` fresh A/B pairs of one scenario; fills ``environment`` on first use."""
    spec = scenario_spec(sc, settings)
    env_a, env_b, label_a, label_b = scenario_envs(sc, settings)
    runs: dict[str, list[Side]] = {"A": [], "B": []}
    rounds = None if settings["rounds"] == "auto" else settings["rounds"]
    for i in range(settings["repeat"]):
        sides = [Side(k, label, env) for k, label, env in
                 (("A", label_a, env_a), ("B", label_b, env_b))
                 if not (runs[k] and runs[k][-1].failed)]   # a dead side is not restarted
        if not sides:
            break
        rounds = run_pair(sc.name, i, spec, sides, settings, rounds, prog, sc.min_rounds)
        for side in sides:
            runs[side.key].append(side)
            if side.ready.get("ok") and not environment.get("vllm"):
                imported = side.proc.imported(0)
                if imported.get("versions"):
                    environment.update(platform=imported.get("platform"),
                                       **imported["versions"])
    summary = {k: side_summary(v, settings["repeat"]) for k, v in runs.items()}
    a, b = summary["A"], summary["B"]

    key = workload_key(spec)
    if not sc.faults and abstats.completed_all(a) and a.get("outputs") is not None:
        references.setdefault(key, {"outputs": a["outputs"], "finish_reasons":
                                    a["finish_reasons"], "source": f"{sc.name} A"})
    reference = None
    if a.get("outputs") is None and b.get("outputs") is not None:
        reference = references.get(key)
        if reference is None:
            prog.say(f"{sc.name}: A finished nothing; reference run (plugin off, no faults)")
            ref = run_in_subprocess({**spec, "rounds": 1}, settings.get("thread_env"),
                                    settings["timeout"])
            reference = {"outputs": ref.get("outputs"),
                         "finish_reasons": ref.get("finish_reasons"),
                         "source": "reference run", "error": ref.get("error")}
            references[key] = reference
    par = abstats.parity(a, b, reference)
    thr = abstats.throughput_summary(a["tok_s"], b["tok_s"])
    checks = abstats.checks(a, b, par, thr, settings["tolerance"])
    return {"name": sc.name, "description": sc.description, "spec": spec,
            "rounds_per_sample": rounds, "sides": summary,
            "reference": None if reference is None else {
                k: reference.get(k) for k in ("source", "error")},
            "parity": par, "throughput": thr, "checks": checks,
            "ok": abstats.verdict(checks)}


BENCH_DIR = Path(__file__).resolve().parent.parent / "benchmarks"   # in a source checkout

# name: (quick arguments, what the ratio means, parser of the script's output)
_ALLOC_LINE = re.compile(r"allocator patch throughput ratio ([0-9.]+)(.*)")
_DISPATCH_ROW = re.compile(r"^\s+(\S.*?)\s+(\d+) ns\s+(\d+) ns\s+([+-][0-9.]+)%.*"
                           r"(OK|OVER TARGET)\s*$")


def _parse_allocator(out: str) -> dict:
    m = _ALLOC_LINE.search(out)
    if not m:
        return {}
    return {"ratio": float(m.group(1)), "meaning": "KVCacheManager ops/s, B/A",
            "detail": m.group(0).strip()}


def _parse_dispatch(out: str) -> dict:
    rows = [(float(m.group(4)), m.group(1)) for m in map(_DISPATCH_ROW.match, out.splitlines())
            if m]
    if not rows:
        return {}
    pct, case = max(rows)
    return {"ratio": 1.0 + pct / 100.0, "meaning": "time per dispatch call, B/A, worst "
            "graphed case", "detail": f"{case}: {pct:+.2f}% (target <= 3%)"}


MICROBENCH = {
    "allocator": (["--rounds", "3"], _parse_allocator),
    "dispatch": (["--rounds", "5", "--calls", "1000"], _parse_dispatch),
}


def microbench(name: str, timeout: float) -> dict:
    """Run ``benchmarks/bench_<name>.py`` (plugin off/on side by side, in one child) with
    quick arguments and read its summary: ``{"ratio", "meaning", "detail"}``; ``ratio`` is
    None when the script is absent (an installed wheel) or its summary is missing."""
    path = BENCH_DIR / f"bench_{name}.py"
    if not path.is_file():
        return {"ratio": None, "detail": f"benchmarks/bench_{name}.py not present"}
    args, parse = MICROBENCH[name]
    try:
        res = subprocess.run([sys.executable, str(path), *args], capture_output=True,
                             text=True, timeout=timeout, cwd=str(BENCH_DIR.parent))
    except subprocess.TimeoutExpired:
        return {"ratio": None, "detail": f"timed out after {timeout:.0f} s"}
    found = parse(res.stdout)
    if found:
        return found
    tail = (res.stderr.strip().splitlines() or ["no output"])[-1]
    return {"ratio": None, "detail": f"no summary line (exit {res.returncode}): {tail[:120]}"}


def run_all(settings: dict, prog: Progress, report: dict) -> None:
    """Fill ``report`` scenario by scenario (so Ctrl-C leaves what was done)."""
    env = report["environment"]
    env.update(python=platform.python_version(), cpus=os.cpu_count())
    references: dict[str, dict] = {}
    for name in settings["scenarios"]:
        report["scenarios"].append(
            run_scenario(SCENARIOS[name], settings, prog, references, env))
    if settings.get("microbench", True):
        for name in MICROBENCH:
            report["microbench"][name] = microbench(name, settings["timeout"])
            prog.say(f"micro-benchmark {name}: {report['microbench'][name].get('ratio')}",
                     advance=1)


def _interrupt(signum, frame):
    raise KeyboardInterrupt(signal.Signals(signum).name)


@contextlib.contextmanager
def _stop_on_signals():
    """Ctrl-C (even where the shell started us ignoring SIGINT) and SIGTERM stop the run the
    same way: children killed, the finished scenarios reported. Restores the handlers."""
    saved = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(ValueError):           # not the main thread
            saved[sig] = signal.signal(sig, _interrupt)
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        settings = validate(args)
    except UsageError as exc:
        parser.error(str(exc))                       # exit 2, before any engine
    settings["microbench"] = not args.no_microbench
    report: dict[str, Any] = {
        "tool": "kvguard-ab", "kvguard_version": __version__,
        "command": " ".join(["kvguard-ab", *(sys.argv[1:] if argv is None else argv)]),
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "environment": {},
        "settings": {k: v for k, v in settings.items()}, "scenarios": [],
        "microbench": {}, "interrupted": False}
    prog = Progress(steps_for(settings), args.quiet)
    t0 = time.monotonic()
    try:
        with _stop_on_signals():
            run_all(settings, prog, report)
    except KeyboardInterrupt:
        report["interrupted"] = True                 # children were killed on the way out
    finally:
        prog.close()
    report["duration_s"] = round(time.monotonic() - t0, 1)
    report["ok"] = (not report["interrupted"] and bool(report["scenarios"])
                    and all(sc["ok"] for sc in report["scenarios"]))
    if report["scenarios"]:
        print(abreport.format_table(report), flush=True)
    else:
        print("kvguard-ab: interrupted before any scenario finished", flush=True)
    written = [abreport.write_json(report, args.json)]
    if not args.no_png and report["scenarios"]:
        written.append(abreport.write_png(report, args.png))
    print(f"wrote {', '.join(str(p) for p in written)} in {report['duration_s']:.0f} s",
          flush=True)
    if report["interrupted"]:
        return 130
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
