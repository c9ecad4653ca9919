"""The kvguard-ab chart: what it says (title, legend, marks, leaked and parity), computed
from the report; drawn with matplotlib when present, one line and no PNG without it."""
import sys
from pathlib import Path

import pytest

from vllm_kvguard.testing import scripts
from vllm_kvguard.testing.ab_samples import report, scenario, side
from vllm_kvguard.tools.ab import chart as abchart, report as abreport, stats as abstats

REF = {"outputs": [[5, 6, 7], [8, 9, 10]], "finish_reasons": ["length", "length"]}


def _report():
    rep = report(
        scenario(),
        scenario("alloc-faults", a=side("faults only", died=True, faults=1),
                 b=side("on + faults", faults=9, patches={"allocator": "applied"}),
                 reference=REF),
        scenario("kv-pressure", b=side("on", tok_s=(90.0, 101.0, 93.0))),   # noisy, a pair in
        scenario("hybrid-spec", b=side("on", tok_s=(80.0, 80.0, 80.0))))    # slower: FAIL
    rep["started_at"] = "2026-12-02T03:00:00+0000"
    rep["environment"]["machine"] = "x86_64"
    return rep


def test_title_states_the_verdict_vllm_date_and_machine():
    spec = abchart.chart_spec(_report())
    assert spec["title"] == ("kvguard-ab FAIL, 1 inconclusive | vLLM 0.32.0 | 2026-12-02 | "
                             "x86_64, cpu, 2 CPUs")
    passing = abchart.chart_spec(report(scenario()))
    assert passing["title"].startswith("kvguard-ab PASS | vLLM 0.32.0 |")
    assert abchart.chart_spec(report(scenario(), interrupted=True))["title"].startswith(
        "kvguard-ab INCOMPLETE")


def test_rows_mark_noisy_inconclusive_and_failed_and_show_leaked_and_parity():
    rows = {r["name"]: r for r in abchart.chart_spec(_report())["rows"]}
    assert rows["baseline"]["marks"] == [] and rows["baseline"]["status"] == abstats.PASS
    assert rows["kv-pressure"]["marks"] == ["NOISY", "inconclusive"]
    assert rows["hybrid-spec"]["marks"] == ["FAIL"]
    faults = rows["alloc-faults"]
    assert faults["ratio"] is None and faults["completed"] == {"A": None, "B": 100.0}
    assert faults["completed_labels"]["A"] == "died"
    assert faults["xlabel"] == "alloc-faults\nleaked A - / B 0\nparity 2/2 =ref"
    leaky = scenario(b=side("on", held=3, patches={"allocator": "applied"}))
    (row,) = abchart.chart_spec(report(leaky))["rows"]
    assert row["leaked"] == "leaked A 0 / B 3" and row["marks"] == ["FAIL"]


def test_legend_names_every_line_drawn():
    spec = abchart.chart_spec(_report())
    assert spec["legend"] == {
        "completed": ["A: plugin off", "B: plugin on"],
        "throughput": ["B/A median, min-max (pass)", "B/A median, min-max (FAIL)",
                       "B/A median, min-max (inconclusive)", "B = A (ratio 1.0)",
                       "tolerance 0.97 (below it: FAIL)"]}
    only_pass = abchart.chart_spec(report(scenario()))["legend"]["throughput"]
    assert only_pass == ["B/A median, min-max (pass)", "B = A (ratio 1.0)",
                         "tolerance 0.97 (below it: FAIL)"]


def test_figure_draws_the_spec_legends_and_labels():
    pytest.importorskip("matplotlib")
    spec = abchart.chart_spec(_report())
    fig = abchart.figure(spec)
    top, bottom = fig.axes
    assert [t.get_text() for t in top.get_legend().get_texts()] == spec["legend"]["completed"]
    assert [t.get_text() for t in bottom.get_legend().get_texts()] == \
        spec["legend"]["throughput"]
    assert fig._suptitle.get_text().splitlines()[0] == spec["title"]
    assert [t.get_text() for t in bottom.get_xticklabels()] == [r["xlabel"]
                                                                 for r in spec["rows"]]
    notes = {t.get_text() for t in bottom.texts}
    assert {"NOISY inconclusive", "FAIL", "n/a"} <= notes


def test_write_png_without_matplotlib_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)     # import raises ImportError
    assert abchart.write_png(_report(), tmp_path / "ab.png") is None
    assert not (tmp_path / "ab.png").exists()
    assert "matplotlib" in abchart.MISSING and "\n" not in abchart.MISSING


def test_write_png_with_matplotlib(tmp_path):
    pytest.importorskip("matplotlib")
    path = abchart.write_png(_report(), tmp_path / "sub" / "ab.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_chart_extra_is_declared():
    tomllib = pytest.importorskip("tomllib")
    pyproject = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text())
    chart = pyproject["project"]["optional-dependencies"]["chart"]
    assert chart == [scripts.load("ab").CHART]                  # what the main job installs
    assert abreport.verdict(report(scenario())) == "PASS"
