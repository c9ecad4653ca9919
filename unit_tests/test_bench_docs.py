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
