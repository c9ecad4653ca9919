"""The README is checked against the code: its length, every flag, metric category and
`kvguard` subcommand it names, and every command of its code blocks (the script exists
and knows each option used)."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def section(title: str) -> str:
    start = README.index(f"\n## {title}")
    end = README.find("\n## ", start + 4)
    return README[start:end if end > 0 else len(README)]


def first_column(table_text: str) -> set[str]:
    rows = [ln for ln in table_text.splitlines() if ln.startswith("| `")]
    return {re.match(r"\| `([^`]+)`", ln).group(1) for ln in rows}


def test_readme_is_short():
    assert len(README) < 12_000, len(README)


def test_flags_table_lists_every_flag_the_code_reads():
    code = (ROOT / "plugin" / "flags.py").read_text()
    read = set(re.findall(r'"(KVGUARD[A-Z_]*)"', code.split("def read_flags", 1)[1]))
    assert read and first_column(section("Flags")) == read


def test_metrics_table_lists_every_metric_and_event_category():
    table = section("Metrics")
    metrics_code = (ROOT / "plugin" / "metrics.py").read_text()
    names = set(re.findall(r"``(kvguard_[a-z_]+)", metrics_code)) | {
        "kvguard_remote_refreshes_total"}
    assert {n for n in first_column(table)} >= names
    categories = set()
    for path in list((ROOT / "plugin").rglob("*.py")) + list((ROOT / "patches").glob("*.py")):
        if "tools" in path.parts or "testing" in path.parts:
            continue
        categories |= set(re.findall(r'\bcount\("([a-z_]+)"\s*,', path.read_text()))
    missing = {c for c in categories if f"`{c}`" not in table}
    assert not missing, f"event categories the README's metrics table does not name: {missing}"


def test_kvguard_subcommands_match_the_cli():
    from vllm_kvguard.tools import cli

    named = set(re.findall(r"^\| `kvguard ([a-z-]+)", section("Commands"), re.M))
    assert named == set(cli.SUBCOMMANDS), (named, set(cli.SUBCOMMANDS))


def commands() -> list[tuple[str, list[str]]]:
    """(script, options) of every `python3 scripts/X.py ...` line in a bash block."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", README, re.S):
        for line in block.splitlines():
            line = line.split("#", 1)[0]
            m = re.search(r"python3? (scripts/\w+\.py)(.*)", line)
            if m:
                out.append((m.group(1), re.findall(r"(--[a-z-]+)", m.group(2))))
    return out


@pytest.mark.parametrize("script,options", commands())
def test_readme_commands_use_existing_scripts_and_options(script, options):
    path = ROOT / script
    assert path.is_file(), script
    helptext = subprocess.run([sys.executable, str(path), "--help"], capture_output=True,
                              text=True, timeout=120, cwd=ROOT).stdout
    for opt in options:
        assert opt in helptext, f"{script} --help does not know {opt}"


def test_docs_links_exist():
    for link in re.findall(r"\]\(((?:docs/)?[\w./-]+\.(?:md|png))\)", README):
        assert (ROOT / link).is_file(), link
