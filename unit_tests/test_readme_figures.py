"""The A/B sample page (docs/ab-sample.md, which the README shows) is what
scripts/readme_figures.py renders: same markers, same head line and table layout (the
numbers are the run's)."""
import re
from pathlib import Path

from vllm_kvguard.testing import scripts
from vllm_kvguard.testing.ab_samples import report, scenario
from vllm_kvguard.tools.ab import report as abreport

figures = scripts.load("readme_figures")
REPO = Path(__file__).resolve().parent.parent
SAMPLE = REPO / figures.SAMPLE


def skeleton(line: str) -> str:
    """A line with every number as N, every date as D, the machine (``x86_64, cpu, 2
    CPUs``: its parts vary) as M and runs of spaces as one."""
    line = re.sub(r"\d{4}-\d\d-\d\d", "D", line).replace("process pairs", "process pair")
    line = re.sub(r"(torch [^,]+), [^;]*? CPUs,", r"\1, M,", line)
    return re.sub(r" +", " ", re.sub(r"\d+(?:\.\d+)?", "N", line)).strip()


def readme_block() -> list[str]:
    text = SAMPLE.read_text()
    start, end = text.index(figures.BEGIN), text.index(figures.END)
    return text[start:end + len(figures.END)].splitlines()


def sample() -> dict:
    rep = report(scenario())
    rep.update(command="kvguard-ab --json /tmp/x/kvguard-ab.json --no-png",
               started_at="2026-12-02T03:00:00+0000", duration_s=412.3)
    rep["environment"].update(torch="2.13.0+cpu", machine="x86_64")
    rep["settings"]["thread_env"] = {"OMP_NUM_THREADS": "1"}     # a CPU build's default
    return rep


def test_the_readme_block_has_the_renderers_layout():
    ours, rendered = readme_block(), figures.render(sample(), None).splitlines()
    assert ours[0] == rendered[0] == figures.BEGIN and ours[-1] == rendered[-1] == figures.END
    assert skeleton(ours[1]) == skeleton(rendered[1])            # the head line
    fence = [i for i, ln in enumerate(ours) if ln == "```"]
    assert len(fence) == 2 and fence[0] == 3 and ours[2] == rendered[2] == ""
    table = ours[fence[0] + 1:fence[1]]
    ref = rendered[4:rendered.index("```", 4)]
    assert skeleton(table[0]) == skeleton(ref[0])                # kvguard-ab title line
    assert table[1].split() == ref[1].split()                    # the column header
    assert table[-1].startswith("verdict: ") and ref[-1].startswith("verdict: ")
    after = ours[fence[1] + 1:-1]                                # the chart, if drawn
    if after:
        assert len(after) == 2 and after[0] == ""
        assert skeleton(after[1]) == "![kvguard-ab chart: D](kvguard-ab.png)"
        assert (REPO / figures.PNG).is_file()


def test_render_and_replace():
    rep = sample()
    block = figures.render(rep, figures.PNG)
    assert block.splitlines()[1].startswith(
        "`python3 scripts/ab.py` (`kvguard-ab` with its defaults) on vLLM 0.32.0, torch "
        "2.13.0+cpu, x86_64, cpu, 2 CPUs, 2026-12-02, 412 s in all; each row is 3 fresh")
    assert abreport.format_table(rep) in block
    assert block.splitlines()[-2] == f"![kvguard-ab chart: 2026-12-02]({figures.PNG})"
    text = f"intro\n{figures.BEGIN}\nold\n{figures.END}\nafter\n"
    assert figures.replace_block(text, block) == f"intro\n{block}\nafter\n"
    assert figures.shown_command("kvguard-ab --repeat 5 --png=a.png --json b.json") == \
        "`python3 scripts/ab.py --repeat 5`"
