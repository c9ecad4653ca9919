"""kvguard-ab writers: the text table and the JSON file."""
import json

from vllm_kvguard.testing.ab_samples import report, scenario, side
from vllm_kvguard.tools.ab import report as abreport


def _rows(text):
    return [line.split() for line in text.splitlines()]


def test_table_has_one_row_per_side_and_the_scenario_columns_on_b():
    text = abreport.format_table(report(scenario()))
    header = next(line for line in text.splitlines() if line.startswith("scenario"))
    for col in abreport.COLUMNS:
        assert col in header
    a_row = next(r for r in _rows(text) if r[:2] == ["baseline", "A"])
    b_row = next(r for r in _rows(text) if r[:1] == ["B"])
    assert "32/0/0" in a_row and "32/0/0" in b_row
    assert "1.000" in b_row                      # median of 1.0, 1.0, 1.0
    assert "2/2" in b_row                        # parity
    assert text.splitlines()[-1] == "verdict: PASS"


def test_table_shows_a_dead_and_b_alive_with_parity_against_the_reference():
    ref = {"outputs": [[5, 6, 7], [8, 9, 10]], "finish_reasons": ["length", "length"]}
    sc = scenario("alloc-faults", a=side("faults only", died=True, faults=1),
                  b=side("on + faults", faults=9, patches={"allocator": "applied"},
                         counters={"rollback": {"InjectedFault": 9}}), reference=ref)
    text = abreport.format_table(report(sc))
    a_row = next(r for r in _rows(text) if r[:2] == ["alloc-faults", "A"])
    b_row = next(r for r in _rows(text) if r[:1] == ["B"])
    assert "YES" in a_row and "0/8/0" in a_row
    assert "no" in b_row and "9" in b_row        # faults injected and rolled back
    assert "2/2" in b_row and "=ref" in b_row
    assert "n/a" in b_row                        # no throughput ratio without A
    assert text.splitlines()[-1] == "verdict: PASS"


def test_table_lists_failed_checks_and_a_failing_verdict():
    sc = scenario(b=side("on", tok_s=(80.0, 80.0, 80.0), patches={"allocator": "applied"}))
    text = abreport.format_table(report(sc))
    assert "[FAIL] throughput ratio" in text
    assert text.splitlines()[-1].startswith("verdict: FAIL (baseline: throughput ratio")


def test_table_of_an_interrupted_run_is_incomplete_not_pass():
    text = abreport.format_table(report(scenario(), interrupted=True))
    assert "INTERRUPTED" in text and text.splitlines()[-1] == "verdict: INCOMPLETE"


def test_coverage_cell():
    assert abreport.coverage_cell(side(platform="cpu")) == "n/a on CPU"
    assert abreport.coverage_cell(side(platform="cuda")) == "no counters"
    gpu = side(platform="cuda", counters={"cudagraph": {"graph": 90, "eager": 10}})
    assert abreport.coverage_cell(gpu) == "eager=10, graph=90"
    audited = {**gpu, "coverage": {"ok": False, "covered": 37, "total": 64}}
    assert abreport.coverage_cell(audited) == "37/64 shapes GAPS"


def test_cpu_audit_without_graphs_and_multiprocess_counters_are_shown_from_engine_core():
    cpu = side(counters={}, platform="cpu")
    cpu["coverage"] = {"ok": True, "mode": "NONE", "covered": 0, "total": 0}
    assert abreport.coverage_cell(cpu) == "n/a on CPU (mode NONE)"
    # --multiprocess: the counters come from EngineCore's snapshot files; only the
    # CUDA-graph audit object stays in the worker
    mp = {**side("on + faults", counters={"rollback": {"InjectedFault": 12},
                                          "cudagraph_fallback": {"lora": 0}}),
          "engine_core_separate": True, "faults_injected": 12,
          "env": {"KVGUARD": "1", "KVGUARD_FAULTS": "every=7"}}
    assert abreport.coverage_cell(mp) == abreport.MP_NA
    assert abreport.rollbacks_cell(mp) == "12"
    sc = scenario("alloc-faults", b=mp)
    b_row = abreport.side_row(sc, "B")
    assert b_row[abreport.COLUMNS.index("faults")] == "12"
    assert b_row[abreport.COLUMNS.index("fallbacks")] == "0"


def test_rollbacks_cell_counts_rollbacks_and_failed_ones_apart():
    assert abreport.rollbacks_cell(side(counters={"rollback": {"a": 2, "b": 1}})) == "3"
    failed = side(counters={"rollback": {"a": 2}, "rollback_failed": {"ValueError": 1},
                            "warmup": {"rolled_back": 5}})
    assert abreport.rollbacks_cell(failed) == "2 (1 failed)"


def test_scenario_line_shows_preemptions():
    sc = scenario("kv-pressure", a={**side(), "preemptions": 6},
                  b={**side("on"), "preemptions": 7})
    assert "preemptions A 6 / B 7" in abreport.format_table(report(sc))


def test_json_round_trip(tmp_path):
    rep = report(scenario())
    path = abreport.write_json(rep, tmp_path / "sub" / "ab.json")
    assert json.loads(path.read_text()) == rep
