"""kvguard-ab statistics, parity and checks (vllm_kvguard.tools.ab.stats)."""
import pytest

from vllm_kvguard.testing.ab_samples import OUT, side
from vllm_kvguard.tools.ab import stats as abstats
from vllm_kvguard.tools.ab.stats import FAIL, NA, PASS


def test_summarize_median_range_and_spread():
    s = abstats.summarize([3.0, 1.0, 2.0])
    assert (s["n"], s["median"], s["min"], s["max"]) == (3, 2.0, 1.0, 3.0)
    assert s["spread_pct"] == pytest.approx(100.0)
    assert abstats.summarize([4.0, 5.0])["median"] == 4.5
    assert abstats.summarize([])["median"] is None


def test_throughput_uses_the_fastest_round_so_bursts_of_other_load_do_not_move_it():
    assert abstats.throughput(256, [0.2, 0.1, 5.0]) == pytest.approx(2560.0)
    assert abstats.throughput(256, []) is None


def test_paired_ratios_skip_pairs_missing_a_side():
    assert abstats.paired_ratios([100.0, None, 50.0], [110.0, 90.0, None]) == [1.1]


def test_throughput_summary_median_of_pairwise_ratios_not_ratio_of_medians():
    thr = abstats.throughput_summary([100.0, 200.0, 100.0], [100.0, 100.0, 90.0])
    assert thr["ratios"] == pytest.approx([1.0, 0.5, 0.9])
    assert thr["ratio_median"] == pytest.approx(0.9)
    assert (thr["ratio_min"], thr["ratio_max"]) == (0.5, 1.0)
    assert thr["a"]["median"] == 100.0


def test_noisy_when_pairs_disagree_beyond_twice_the_band():
    quiet = abstats.throughput_summary([100.0] * 3, [99.0, 100.0, 101.0])
    loud = abstats.throughput_summary([100.0] * 3, [80.0, 100.0, 120.0])
    assert not abstats.noisy(quiet, 0.97)
    assert abstats.noisy(loud, 0.97)


def test_compare_outputs_only_where_both_finished():
    res = abstats.compare_outputs([[1, 2], [3, 4], [5]], ["length", "length", "abort"],
                                  [[1, 2], [3, 9], [6]], ["length", "stop", "length"])
    assert res == {"compared": 2, "identical": 1, "mismatched": [1]}


def test_parity_against_a_when_a_finished():
    par = abstats.parity(side(), side("on"))
    assert (par["status"], par["against"], par["identical"]) == (PASS, "A", 2)


def test_parity_detects_a_single_differing_token():
    par = abstats.parity(side(), side("on", outputs=[[5, 6, 7], [8, 9, 11]]))
    assert par["status"] == FAIL and par["mismatched"] == [1]


def test_parity_uses_the_reference_when_a_died():
    ref = {"outputs": OUT, "finish_reasons": ["length", "length"]}
    par = abstats.parity(side(died=True), side("on"), ref)
    assert (par["status"], par["against"]) == (PASS, "reference")
    assert abstats.parity(side(died=True), side("on"))["status"] == NA


def test_counters_by_category_word():
    c = {"rollback": {"ValueError": 2, "InjectedFault": 3}, "cudagraph_fallback": {"x": 1},
         "audit": {"ok": 9}}
    assert abstats.counter_total(c, "rollback") == 5
    assert abstats.counter_total(c, "fallback") == 1
    assert abstats.counters_matching(c, "cudagraph") == {"cudagraph_fallback.x": 1}
    assert abstats.counter_total(None, "rollback") == 0


def test_leaked_counts_held_blocks_and_audit_violations_of_a_live_engine_only():
    assert abstats.leaked(side(held=0)) == 0
    assert abstats.leaked({**side(held=2), "audit_violations": ["x"]}) == 3
    assert abstats.leaked(side(died=True)) is None


def _status(checks, name):
    return next(c["status"] for c in checks if c["name"] == name)


def _checks(a, b, tolerance=0.97, reference=None):
    par = abstats.parity(a, b, reference)
    thr = abstats.throughput_summary(a["tok_s"], b["tok_s"])
    return abstats.checks(a, b, par, thr, tolerance)


def test_all_checks_pass_for_a_healthy_b():
    checks = _checks(side(), side("on"))
    assert abstats.verdict(checks)
    assert {c["status"] for c in checks} == {PASS}


def test_b_dying_fails_even_when_a_died_too():
    checks = _checks(side(died=True), side("on", died=True))
    assert _status(checks, "B completes every request") == FAIL
    assert not abstats.verdict(checks)


def test_a_dying_alone_is_reported_not_failed():
    ref = {"outputs": OUT, "finish_reasons": ["length", "length"]}
    checks = _checks(side(died=True), side("on"), reference=ref)
    assert abstats.verdict(checks)
    assert _status(checks, "throughput ratio") == NA


def test_leak_in_b_fails():
    assert _status(_checks(side(), side("on", held=3)), "B leaks no blocks") == FAIL


def test_throughput_below_tolerance_fails_and_at_tolerance_passes():
    slow = _checks(side(tok_s=(100.0,) * 3), side("on", tok_s=(96.0,) * 3))
    assert _status(slow, "throughput ratio") == FAIL
    ok = _checks(side(tok_s=(100.0,) * 3), side("on", tok_s=(97.0,) * 3))
    assert _status(ok, "throughput ratio") == PASS


def test_throughput_note_when_not_resolved():
    loud = _checks(side(tok_s=(100.0,) * 3), side("on", tok_s=(80.0, 100.0, 120.0)))
    check = next(c for c in loud if c["name"] == "throughput ratio")
    assert check["warn"] and "not resolved" in check["detail"] and "spread" in check["detail"]
    straddle = _checks(side(tok_s=(100.0,) * 3), side("on", tok_s=(96.0, 98.0, 99.0)))
    check = next(c for c in straddle if c["name"] == "throughput ratio")
    assert check["status"] == abstats.INCONCLUSIVE and "both sides" in check["detail"]
    quiet = _checks(side(tok_s=(100.0,) * 3), side("on", tok_s=(100.0, 101.0, 99.0)))
    assert not next(c for c in quiet if c["name"] == "throughput ratio")["warn"]


def test_a_cost_verdict_only_where_the_range_resolves_the_tolerance():
    """PASS: every ratio at or above; FAIL: every ratio below and within twice the band;
    anything else inconclusive, which never fails the run (so a second run repeats it)."""
    a = side(tok_s=(100.0,) * 3)
    unsure = _checks(a, side("on", tok_s=(80.0, 90.0, 105.0)))     # median 0.90, max 1.05
    assert _status(unsure, "throughput ratio") == abstats.INCONCLUSIVE
    assert abstats.verdict(unsure)
    every_pair_slow = _checks(a, side("on", tok_s=(70.0, 90.0, 96.0)))   # noisy, max 0.96
    assert _status(every_pair_slow, "throughput ratio") == abstats.INCONCLUSIVE
    assert abstats.verdict(every_pair_slow)
    steady = _checks(a, side("on", tok_s=(95.0, 95.5, 96.0)))        # quiet and below
    assert _status(steady, "throughput ratio") == FAIL
    assert not abstats.verdict(steady)
    above_noisy = _checks(a, side("on", tok_s=(98.0, 110.0, 130.0)))  # all above, noisy
    assert _status(above_noisy, "throughput ratio") == PASS


def test_round_ratios_pair_adjacent_rounds_across_pairs():
    """Round j of A and round j of B ran next to each other: B/A = A's time / B's."""
    assert abstats.round_ratios([[1.0, 2.0], None], [[0.5, 2.0, 9.0], [1.0]]) == [2.0, 1.0]
    thr = abstats.throughput_summary([100.0], [100.0], [[1.0, 1.0, 1.0]], [[1.0, 1.25, 0.8]])
    assert thr["ratios"] == pytest.approx([1.0, 0.8, 1.25])
    assert (thr["ratio_min"], thr["ratio_median"]) == (pytest.approx(0.8), 1.0)
    # no round times (a side died): the paired samples, as before
    assert abstats.throughput_summary([100.0], [90.0], [None], [None])["ratios"] == [0.9]


def test_b_less_deterministic_than_a_fails():
    checks = _checks(side(), side("on", consistent=False))
    assert _status(checks, "B as deterministic as A across rounds") == FAIL
    both = _checks(side(consistent=False), side("on", consistent=False))
    assert _status(both, "B as deterministic as A across rounds") == PASS


def test_connector_faults_b_passes_when_only_the_faulted_requests_fail():
    ref = {"outputs": OUT, "finish_reasons": ["length", "length"]}
    b = {**side("on", faults=2), "finish_reasons": ["length", "error"]}
    b["totals"] = {**b["totals"], "completed": b["totals"]["submitted"] - 2, "failed": 2}
    par = abstats.parity(side(died=True), b, ref)
    thr = abstats.throughput_summary([], b["tok_s"])
    name = "B completes every request but the faulted ones"
    checks = abstats.checks(side(died=True), b, par, thr, 0.97, faulted_fail=True)
    assert _status(checks, name) == PASS and abstats.verdict(checks)
    assert par["compared"] == 1 and par["identical"] == 1       # the error is not compared
    more = {**b, "totals": {**b["totals"], "failed": 3, "completed": b["totals"]["completed"] - 1}}
    assert _status(abstats.checks(side(died=True), more, par, thr, 0.97, faulted_fail=True),
                   name) == FAIL                                # one unfaulted request failed
