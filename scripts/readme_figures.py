#!/usr/bin/env python3
"""Rewrite the README's A/B figures from a real ``kvguard-ab`` run, so they cannot drift.

    python3 scripts/readme_figures.py                 # runs the main job (scripts/ab.py) first
    python3 scripts/readme_figures.py --json RUN.json # from the JSON of a run already made

The block between the ``ab-figures`` markers of README.md becomes: one line naming the
command, vLLM and torch versions, machine, date and duration; the run's own table
(:func:`vllm_kvguard.tools.abreport.format_table`); and its chart, written beside the
README (``docs/kvguard-ab.png``) when matplotlib is installed. Arguments after ``--`` go
to ``scripts/ab.py``. Runs in the default pin's venv when started by another Python.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BEGIN = "<!-- ab-figures: scripts/readme_figures.py writes this block from a real run -->"
END = "<!-- /ab-figures -->"
PNG = "docs/kvguard-ab.png"


def shown_command(command: str) -> str:
    """The run's command without its output options: what a reader would type."""
    words, out, skip = command.split(), [], False
    for w in words:
        if skip:
            skip = False
        elif w in ("--json", "--png"):
            skip = True
        elif w != "--no-png" and not w.startswith(("--json=", "--png=")):
            out.append(w)
    args = " ".join(out[1:])
    return f"`python3 scripts/ab.py{' ' + args if args else ''}`" + (
        "" if args else " (`kvguard-ab` with its defaults)")


def render(report: dict, png: str | None) -> str:
    """The README block for ``report`` (a kvguard-ab JSON report)."""
    from vllm_kvguard.tools.abchart import machine
    from vllm_kvguard.tools.abreport import format_table

    env, s = report.get("environment") or {}, report.get("settings") or {}
    head = (f"{shown_command(report.get('command', 'kvguard-ab'))} on vLLM "
            f"{env.get('vllm', '?')}, torch {env.get('torch', '?')}, {machine(env)}, "
            f"{(report.get('started_at') or '?')[:10]}, {report.get('duration_s', 0):.0f} s "
            f"in all; each row is {s.get('repeat', '?')} fresh A/B process pairs, A = plugin "
            f"off, B = plugin on, rounds interleaved ABBA on the same CPU:")
    lines = [BEGIN, head, "", "```", format_table(report), "```"]
    if png:
        lines += ["", f"![kvguard-ab chart: {report.get('started_at', '')[:10]}]({png})"]
    return "\n".join(lines + [END])


def replace_block(text: str, block: str) -> str:
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise SystemExit(f"readme_figures: README.md has no {BEGIN!r} ... {END!r} block")
    return text[:start] + block + text[end + len(END):]


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="readme_figures.py", description=__doc__.split("\n")[0])
    p.add_argument("--json", metavar="PATH", help="a kvguard-ab JSON report (default: run "
                                                  "the main job now)")
    p.add_argument("--readme", default=str(REPO / "README.md"), metavar="PATH")
    p.add_argument("ab_args", nargs="*", help="after --: arguments for scripts/ab.py")
    a = p.parse_args(argv)
    if a.json is None:
        a.json = str(Path(tempfile.mkdtemp(prefix="kvguard-readme-")) / "kvguard-ab.json")
        run = subprocess.run([sys.executable, str(REPO / "scripts" / "ab.py"), "--json",
                              a.json, "--no-png", *a.ab_args])
        if not Path(a.json).is_file():
            print(f"readme_figures: the run wrote no report (exit {run.returncode})",
                  file=sys.stderr)
            return 1
    try:
        from vllm_kvguard.tools import abchart, abreport
    except ImportError:                      # this Python has no vllm_kvguard: the venv's
        sys.path.insert(0, str(REPO / "scripts"))
        import venvs

        pin = next(pin for pin in venvs.read_pins() if pin.default)
        python = venvs.venv_dir(pin) / "bin" / "python"
        os.execv(str(python), [str(python), __file__, "--json", a.json, "--readme", a.readme])
    report = abreport.load(a.json)
    readme = Path(a.readme)
    png = abchart.write_png(report, readme.parent / PNG)
    if png is None:
        print(f"readme_figures: {abchart.MISSING}; the README keeps no chart", file=sys.stderr)
    readme.write_text(replace_block(readme.read_text(), render(report, png and PNG)))
    print(f"readme_figures: {readme} rewritten from {a.json}" + (f", {png}" if png else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
