"""A benchmark's headline figures, saved as JSON and written into docs/performance.md.

House rule: the figures in docs/ are written by the scripts that measured them. Each
benchmark and vLLM version owns one marked block of the page,
``<!-- bench:<name>:<vllm> -->`` ... ``<!-- /bench:<name>:<vllm> -->``, which
:func:`write_block` replaces (or, the first time, inserts after the last such block, else
before the ``## History`` section, else at the end). A run's record is a small dict
(:func:`record`); ``--json`` saves it and ``--write-docs ... --from-json`` writes a saved
run's block without measuring again.
"""
from __future__ import annotations

import datetime
import json
import re


def record(bench: str, vllm: str, layouts, ratios: dict, target: float,
           per_layout: dict | None = None, command: str = "",
           date: str | None = None, facts: dict | None = None, extra: str = "") -> dict:
    """The headline of one run: ``ratios`` {label: on/off}, the worst decides the verdict.
    Optional: ``facts`` {label: {"steps", "preemptions", "per_step"}} (what each label's
    region did, rendered after the ratios) and ``extra``, Markdown rendered below the
    paragraph (a table)."""
    worst = max(ratios.values())
    rec = dict(bench=bench, vllm=vllm, date=date or datetime.date.today().isoformat(),
               layouts=list(layouts), ratios=dict(ratios), per_layout=per_layout or {},
               target=target, verdict="PASS" if worst <= target else "MISS",
               command=command)
    if facts:
        rec["facts"] = facts
    if extra:
        rec["extra"] = extra
    return rec


def save_json(path: str, rec: dict) -> None:
    with open(path, "w") as fh:
        json.dump(rec, fh, indent=1, sort_keys=True)
        fh.write("\n")


def load_json(path: str) -> dict:
    with open(path) as fh:
        return json.load(fh)


TITLES = {"scheduler": "Scheduler step", "allocator": "Allocator replay",
          "engine": "Whole engine (in-process LLM.generate)",
          "startup": "Engine startup, in range vs reporting a release outside it"}


def render(rec: dict) -> str:
    """The block's body: one paragraph, Markdown."""
    if rec.get("unit") == "s":          # wall-clock seconds (bench_startup), not a count
        diffs = " / ".join(f"{v:+.2f} s ({k})" for k, v in rec["ratios"].items())
        line = (f"**{TITLES.get(rec['bench'], rec['bench'])}, vLLM {rec['vllm']}** "
                f"({rec['date']}, {rec.get('how', '')}): difference of the medians "
                f"(outside - in range) {diffs}; target < {rec['target']} s: "
                f"**{rec['verdict']}**.")
        if rec.get("command"):
            line += f" `{rec['command']}`"
        if rec.get("extra"):
            line += "\n\n" + rec["extra"].strip("\n")
        return line
    n = len(rec["layouts"])
    ratios = " / ".join(f"{v:.4f}x ({k})" if len(rec["ratios"]) > 1 else f"{v:.4f}x"
                        for k, v in rec["ratios"].items())
    per = "; ".join(f"{k}: " + " ".join(f"{r:.4f}" for r in v)
                    for k, v in rec.get("per_layout", {}).items())
    line = (f"**{TITLES.get(rec['bench'], rec['bench'])}, vLLM {rec['vllm']}** "
            f"({rec['date']}, callgrind, {n} heap layout{'s' if n != 1 else ''} (shift "
            f"{', '.join(map(str, rec['layouts']))})): instructions on/off {ratios}; target <= {rec['target']}: "
            f"**{rec['verdict']}**.")
    if per and n > 1:
        line += f" Per layout: {per}."
    facts = rec.get("facts") or {}
    if facts:
        line += " Region: " + "; ".join(
            f"{k}: {f['steps']} engine steps, {f['preemptions']} preemptions, "
            f"{f['per_step']:+,.0f} instructions per step on-off" for k, f in facts.items()) + "."
    if rec.get("command"):
        line += f" `{rec['command']}`"
    if rec.get("extra"):
        line += "\n\n" + rec["extra"].strip("\n")
    return line


def _marks(rec: dict) -> tuple[str, str]:
    key = f"{rec['bench']}:{rec['vllm']}"
    return f"<!-- bench:{key} -->", f"<!-- /bench:{key} -->"


_ANY_END = re.compile(r"^<!-- /bench:[^ ]+ -->$", re.M)


def write_block(text: str, rec: dict) -> str:
    """``text`` with the block of ``rec`` written (replaced, or inserted the first time)."""
    start, end = _marks(rec)
    block = f"{start}\n{render(rec)}\n{end}"
    i = text.find(start)
    if i >= 0:
        j = text.find(end, i)
        if j < 0:
            raise ValueError(f"{start} has no {end}")
        return text[:i] + block + text[j + len(end):]
    ends = list(_ANY_END.finditer(text))
    if ends:
        k = ends[-1].end()
        return text[:k] + "\n\n" + block + text[k:]
    m = re.search(r"^## History", text, re.M)
    if m:
        return text[:m.start()] + block + "\n\n" + text[m.start():]
    return text.rstrip("\n") + "\n\n" + block + "\n"


def write_docs(path: str, rec: dict) -> None:
    with open(path) as fh:
        text = fh.read()
    with open(path, "w") as fh:
        fh.write(write_block(text, rec))
    print(f"wrote {rec['bench']}:{rec['vllm']} into {path}")


def add_arguments(ap, bench: str, when: str = "") -> None:
    """A benchmark's ``--json``, ``--write-docs`` and ``--from-json`` options (``when``:
    the mode they apply to, e.g. "with --instructions: ")."""
    ap.add_argument("--json", help=f"{when}save the headline to this file")
    ap.add_argument("--write-docs", metavar="PAGE",
                    help=f"{when}write the headline into PAGE's bench:{bench}:<vLLM> block")
    ap.add_argument("--from-json", metavar="RUN",
                    help="with --write-docs: take the figures from a saved --json run")


def write_saved(ap, args) -> bool:
    """``--write-docs PAGE --from-json RUN``: write the saved run's block; True if done
    (nothing is measured then)."""
    if not args.from_json:
        return False
    if not args.write_docs:
        ap.error("--from-json needs --write-docs")
    write_docs(args.write_docs, load_json(args.from_json))
    return True


def save(args, rec: dict) -> None:
    """Save and write ``rec`` as ``--json`` and ``--write-docs`` ask."""
    if args.json:
        save_json(args.json, rec)
    if args.write_docs:
        write_docs(args.write_docs, rec)
