#!/usr/bin/env python3
"""Write the A/B sample the README shows from a real ``kvguard-ab`` run, so it cannot drift.

    python3 scripts/readme_figures.py                 # runs the main job (scripts/ab.py) first
    python3 scripts/readme_figures.py --json RUN.json # from the JSON of a run already made

Writes ``docs/ab-sample.md``: between the ``ab-figures`` markers, one line naming the
command, vLLM and torch versions, machine, date and duration; the run's own table
(:func:`vllm_kvguard.tools.ab.report.format_table`); and its chart ``docs/kvguard-ab.png``
when matplotlib is installed. ``--readme PATH`` also replaces the same marked block in
that file (the chart linked as ``docs/kvguard-ab.png``). Arguments after ``--`` go to
``scripts/ab.py``. Runs in the default pin's venv when started by another Python.
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
SAMPLE = "docs/ab-sample.md"
SAMPLE_HEAD = ("# kvguard-ab: the default run\n\nOne real run of the main job, written by "
               "`python3 scripts/readme_figures.py`, never edited by hand.\n\n")


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
    from vllm_kvguard.tools.ab.chart import machine
    from vllm_kvguard.tools.ab.report import format_table, pairs

    env, s = report.get("environment") or {}, report.get("settings") or {}
    head = (f"{shown_command(report.get('command', 'kvguard-ab'))} on vLLM "
            f"{env.get('vllm', '?')}, torch {env.get('torch', '?')}, {machine(env)}, "
            f"{(report.get('started_at') or '?')[:10]}, {report.get('duration_s', 0):.0f} s "
            f"in all; each row is {pairs(s.get('repeat', '?'))}, A = plugin "
            f"off, B = plugin on, rounds interleaved ABBA on the same CPU:")
    lines = [BEGIN, head, "", "```", format_table(report), "```"]
    if png:
        lines += ["", f"![kvguard-ab chart: {report.get('started_at', '')[:10]}]({png})"]
    return "\n".join(lines + [END])


def replace_block(text: str, block: str) -> str:
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise SystemExit(f"readme_figures: the file has no {BEGIN!r} ... {END!r} block")
    return text[:start] + block + text[end + len(END):]


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="readme_figures.py", description=__doc__.split("\n")[0])
    p.add_argument("--json", metavar="PATH", help="a kvguard-ab JSON report (default: run "
                                                  "the main job now)")
    p.add_argument("--readme", metavar="PATH",
                   help="also replace the marked block of this file (e.g. README.md)")
    p.add_argument("--sample", default=str(REPO / SAMPLE), metavar="PATH",
                   help=f"the sample page (default {SAMPLE})")
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
        from vllm_kvguard.tools.ab import chart as abchart, report as abreport
    except ImportError:                      # this Python has no vllm_kvguard: the venv's
        sys.path.insert(0, str(REPO / "scripts"))
        import venvs

        pin = next(pin for pin in venvs.read_pins() if pin.default)
        python = venvs.venv_dir(pin) / "bin" / "python"
        os.execv(str(python), [str(python), __file__, "--json", a.json, "--sample", a.sample]
                 + (["--readme", a.readme] if a.readme else []))
    report = abreport.load(a.json)
    sample = Path(a.sample)
    png = abchart.write_png(report, REPO / PNG)
    if png is None:
        print(f"readme_figures: {abchart.MISSING}; no chart", file=sys.stderr)
    link = png and os.path.relpath(png, sample.parent)
    sample.parent.mkdir(parents=True, exist_ok=True)
    sample.write_text(SAMPLE_HEAD + render(report, link) + "\n")
    written = [str(sample)] + ([str(png)] if png else [])
    if a.readme:
        readme = Path(a.readme)
        readme.write_text(replace_block(readme.read_text(),
                                        render(report, png and os.path.relpath(
                                            png, readme.resolve().parent))))
        written.append(str(readme))
    print(f"readme_figures: wrote {', '.join(written)} from {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
