"""The benchmarks' writer of docs/performance.md blocks (benchmarks/_docs.py): a run's
headline lands in its own marked block, replaces it on the next run, leaves the page's
other text and blocks alone; no callgrind run."""
from __future__ import annotations

import os
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                     "benchmarks")
sys.path.insert(0, BENCH)
import _docs  # noqa: E402

PAGE = "# What the plugin costs\n\nIntro.\n\n## History of it\n\nOld figures.\n"


def rec(bench="allocator", vllm="0.32.0", ratios=None, date="2026-12-04", target=1.03):
    ratios = ratios or {"lookahead 2": 1.0353, "lookahead 4": 1.0296}
    return _docs.record(bench, vllm, [0], ratios, target,
                        per_layout={k: [v] for k, v in ratios.items()}, date=date)


def test_first_block_goes_before_history_and_is_replaced_in_place():
    text = _docs.write_block(PAGE, rec())
    assert text.index("<!-- bench:allocator:0.32.0 -->") < text.index("## History")
    assert "1.0353x (lookahead 2) / 1.0296x (lookahead 4)" in text
    assert "**MISS**" in text                       # the worst ratio decides
    assert text.endswith("Old figures.\n") and text.startswith("# What the plugin costs")
    again = _docs.write_block(text, rec(ratios={"lookahead 2": 1.02, "lookahead 4": 1.01},
                                        date="2026-12-05"))
    assert again.count("<!-- bench:allocator:0.32.0 -->") == 1
    assert "1.0353" not in again and "2026-12-05" in again and "**PASS**" in again
    assert len(again.splitlines()) == len(text.splitlines())


def test_other_blocks_kept_and_new_ones_follow_them():
    text = _docs.write_block(PAGE, rec(bench="scheduler", ratios={"step": 1.019}))
    text = _docs.write_block(text, rec(vllm="0.34.0"))
    text = _docs.write_block(text, rec(bench="scheduler", ratios={"step": 1.025}, target=1.02))
    assert text.index("bench:scheduler:0.32.0") < text.index("bench:allocator:0.34.0") \
        < text.index("## History")
    assert "1.0250x" in text and "1.0190x" not in text
    assert "**MISS**" in text.split("bench:scheduler:0.32.0")[1]


def test_unclosed_block_is_refused():
    broken = _docs.write_block(PAGE, rec()).replace("<!-- /bench:allocator:0.32.0 -->", "")
    with pytest.raises(ValueError):
        _docs.write_block(broken, rec())


def test_scheduler_writes_a_saved_run(tmp_path):
    pytest.importorskip("vllm")
    import bench_scheduler

    run, page = tmp_path / "run.json", tmp_path / "performance.md"
    _docs.save_json(str(run), rec(bench="scheduler", ratios={"step": 1.0187}, target=1.02))
    page.write_text(PAGE)
    assert bench_scheduler.main(["--write-docs", str(page), "--from-json", str(run)]) == 0
    assert "**Scheduler step, vLLM 0.32.0**" in page.read_text()
    assert "1.0187x; target <= 1.02: **PASS**" in page.read_text()


# ------------------------------------------------------------------ bench_engine's pure parts
def test_engine_record_renders_loads_facts_and_table():
    text = _docs.write_block(PAGE, _docs.record(
        "engine", "0.32.0", [0], {"plain": 1.0012, "pressure": 1.0041}, 1.003,
        date="2026-12-06", command="bench_engine.py --layouts 1",
        facts={"plain": dict(steps=40, preemptions=0, per_step=310.4),
               "pressure": dict(steps=77, preemptions=3, per_step=1204.0)},
        extra="| function | self/step |\n|---|---:|\n| `x` | 5 |"))
    block = text.split("<!-- bench:engine:0.32.0 -->")[1].split("<!-- /bench:engine:0.32.0 -->")[0]
    assert "**Whole engine (in-process LLM.generate), vLLM 0.32.0**" in block
    assert "1.0012x (plain) / 1.0041x (pressure); target <= 1.003: **MISS**" in block
    assert "pressure: 77 engine steps, 3 preemptions, +1,204 instructions per step" in block
    assert block.rstrip().endswith("| `x` | 5 |")
    assert _docs.write_block(text, _docs.record("engine", "0.32.0", [0], {"plain": 1.001},
                                                1.003)).count("| `x` | 5 |") == 0


def test_engine_arguments_and_child_names():
    pytest.importorskip("vllm")
    import bench_engine

    assert bench_engine.parse_loads("pressure, plain,pressure") == ["pressure", "plain"]
    with pytest.raises(ValueError):
        bench_engine.parse_loads("plain,heavy")
    assert bench_engine.split_side(bench_engine.side_name("attr", "plain")) == ("attr", "plain")
    with pytest.raises(ValueError):
        bench_engine.split_side("both.plain")
    with pytest.raises(SystemExit):
        bench_engine.main(["--from-json", "x.json"])          # needs --write-docs


def test_engine_writes_a_saved_run(tmp_path):
    pytest.importorskip("vllm")
    import bench_engine

    run, page = tmp_path / "run.json", tmp_path / "performance.md"
    _docs.save_json(str(run), _docs.record("engine", "0.32.0", [0],
                                           {"plain": 1.0011, "pressure": 1.0024}, 1.003))
    page.write_text(PAGE)
    assert bench_engine.main(["--write-docs", str(page), "--from-json", str(run)]) == 0
    assert "1.0011x (plain) / 1.0024x (pressure); target <= 1.003: **PASS**" in page.read_text()


PROFILE = """fl=x.c
fn=kvgmark_0'cfunction_vectorcall'_PyEval_EvalFrameDefault'2'kvgmark_1'main
0 10
cfn=PyObject_Vectorcall
calls=3 0
0 90
fn=kvgmark_1'main
0 5
cfn=kvgmark_0'cfunction_vectorcall'_PyEval_EvalFrameDefault'2'kvgmark_1'main
calls=3 0
0 100
fn=WraptBoundFunctionWrapper_call
0 7
cfn=kvgmark_1'main
calls=1 0
0 105
"""


def test_marked_costs_split_inclusive_into_self(tmp_path):
    import _cgcount

    prof = tmp_path / "cg.out.1"
    prof.write_text(PROFILE)
    costs = _cgcount.marked_costs(str(prof), {"kvgmark_0": "inner", "kvgmark_1": "outer"},
                                  {"wrapt (C)": r"^Wrapt"})
    assert costs["inner"] == {"calls": 3, "incl": 100, "self": 100, "out": 0}
    assert costs["outer"] == {"calls": 1, "incl": 105, "self": 5, "out": 3}
    assert costs["wrapt (C)"]["self"] == 7
    fixed = _cgcount.corrected(costs, inside=10, outside=1)
    assert fixed["inner"]["self"] == 70 and fixed["outer"]["self"] == 5 - 10 - 3


def test_marked_function_keeps_identity_and_behaviour(tmp_path):
    import shutil

    import _cgcount
    if shutil.which("cc") is None:
        pytest.skip("no C compiler")
    marks = _cgcount.build_marks(str(tmp_path))

    def make(tag):
        def inner(n, *, k=2):
            return f"{tag}{n * k}"
        return inner
    fn = make("t")
    bound = fn
    names = _cgcount.mark_functions(marks, {_cgcount.label_of(fn): fn})
    assert list(names.values()) == ["test_bench_docs.py:test_marked_function_keeps_identity_"
                                    "and_behaviour.<locals>.make.<locals>.inner[t]"]
    assert bound is fn and fn(3) == "t6" and fn(3, k=3) == "t9"
    mark = getattr(marks, "m" + next(iter(names)).split("_")[1])
    assert fn.__code__.co_consts.count(mark) == 1             # the call goes through it


# ------------------------------------------------------------------ bench_startup's block
def test_startup_writes_seconds_not_a_count(tmp_path):
    import bench_startup

    saved = _docs.record("startup", "0.32.0", [], {"multiprocess, LLM() to ready": -0.26,
                                                   "multiprocess, whole process": 2.4},
                         bench_startup.TARGET_S, date="2026-12-06",
                         extra="| mode | time | side | median (min..max) |\n|---|---|---|---|")
    saved.update(unit="s", how="3 runs a side, alternating")
    run, page = tmp_path / "run.json", tmp_path / "performance.md"
    _docs.save_json(str(run), saved)
    page.write_text(PAGE)
    assert bench_startup.main(["--write-docs", str(page), "--from-json", str(run)]) == 0
    block = page.read_text().split("<!-- bench:startup:0.32.0 -->")[1]
    assert "-0.26 s (multiprocess, LLM() to ready) / +2.40 s (multiprocess, whole process)" \
        in block
    assert "target < 2.0 s: **MISS**" in block and "instructions" not in block
