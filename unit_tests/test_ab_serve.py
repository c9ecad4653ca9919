"""kvguard-ab --serve without a server: the arrival schedule, the latency statistics, what
a side reports from its streams, the table's columns and the command line."""
import math

import pytest

from vllm_kvguard.testing.ab_samples import report, scenario
from vllm_kvguard.tools.ab import cli as ab, report as abreport, run as abrun
from vllm_kvguard.tools.ab import serve as abserve, stats as abstats
from vllm_kvguard.tools.ab.scenarios import SCENARIOS, SERVED, scenario_spec
from vllm_kvguard.tools.serve import Batch


# ---------------------------------------------------------------------------- schedule
def test_poisson_schedule_is_seeded_increasing_and_has_the_asked_rate():
    a = abserve.poisson_offsets(2000, 16.0, seed=0)
    assert a == abserve.poisson_offsets(2000, 16.0, seed=0)          # same seed, same stream
    assert a != abserve.poisson_offsets(2000, 16.0, seed=1)
    assert a[0] == 0.0 and all(x < y for x, y in zip(a, a[1:]))
    mean_gap = a[-1] / (len(a) - 1)
    assert mean_gap == pytest.approx(1 / 16.0, rel=0.1)
    gaps = sorted(y - x for x, y in zip(a, a[1:]))                  # exponential: median ln2/rate
    assert gaps[len(gaps) // 2] == pytest.approx(math.log(2) / 16.0, rel=0.15)


def test_infinite_rate_sends_everything_at_once():
    assert abserve.poisson_offsets(5, math.inf, seed=3) == [0.0] * 5


# ---------------------------------------------------------------------------- statistics
def test_percentile_interpolates_between_ranks_like_numpy():
    vals = [4.0, 1.0, 3.0, 2.0]
    assert abstats.percentile(vals, 50) == 2.5
    assert abstats.percentile(vals, 99) == pytest.approx(3.97)
    assert abstats.percentile(vals, 0) == 1.0 and abstats.percentile(vals, 100) == 4.0
    assert abstats.percentile([7.0], 99) == 7.0
    assert abstats.percentile([], 50) is None


def test_latency_ratios_are_b_over_a_and_none_without_samples():
    a = abstats.latency_summary({"ttft": [0.1, 0.2], "itl": [0.01], "e2e": []})
    b = abstats.latency_summary({"ttft": [0.2, 0.4], "itl": [0.02], "e2e": [1.0]})
    r = abstats.latency_ratios(a, b)
    assert r["ttft_p50"] == pytest.approx(2.0) and r["ttft_p99"] == pytest.approx(2.0)
    assert r["itl_p50"] == pytest.approx(2.0)
    assert r["e2e_p50"] is None and r["e2e_p99"] is None
    assert a["e2e"] == {"p50": None, "p99": None, "n": 0}


# ---------------------------------------------------------------------------- a side
def ok(i, ids, ttft=0.05, itl=(0.01, 0.02), e2e=0.5):
    return abserve.Timed(i, "ok", list(ids), "length", e2e, ttft=ttft, itl=list(itl))


def failed(i, kind):
    return abserve.Timed(i, kind, detail=f"{kind}: boom")


class _Started:
    """What summary() reads of a server that started and was stopped."""
    startup_s, log_path = 30.0, "/logs/x.log"

    def log(self):
        return ""

    def kvguard_reports(self):
        return {}


def served_side(label, batches, counters=None):
    s = abserve.ServedSide("A", label, {})
    s.batches, s.counters, s.server = batches, counters or {}, _Started()
    return s


def test_a_side_reports_its_requests_errors_latencies_and_throughput():
    b1 = Batch([ok(0, [5, 6]), ok(1, [7, 8], ttft=0.15)], seconds=2.0)
    b2 = Batch([ok(0, [5, 6]), ok(1, [7, 8])], seconds=1.0)
    s = served_side("on", [b1, b2], {"rollback": {"InjectedFault": 4}}).summary(repeat=3)
    assert s["totals"] == {"submitted": 4, "completed": 4, "failed": 0, "aborted": 0}
    assert s["errors"] == {}
    assert s["tok_s"] == [2.0, 4.0, None]                   # 4 tokens per stream / seconds
    assert s["outputs"] == [[5, 6], [7, 8]] and s["outputs_consistent"]
    assert s["latency"]["ttft"]["p50"] == pytest.approx(0.05)
    assert s["latency"]["itl"]["n"] == 8 and s["latency"]["e2e"]["p99"] == pytest.approx(0.5)
    assert s["served"] and s["held_blocks"] is None         # a server's pool is not visible


def test_a_failing_side_counts_errors_by_kind_and_gives_no_outputs():
    batch = Batch([ok(0, [1]), failed(1, "http 500"), failed(2, "connection refused"),
                   failed(3, "connection refused")], seconds=1.0)
    s = served_side("faults only", [batch]).summary(repeat=1)
    assert s["totals"]["completed"] == 1 and s["totals"]["failed"] == 3
    assert s["errors"] == {"connection refused": 2, "http 500": 1}
    assert s["outputs"] is None and s["tok_s"] == [None]    # a broken stream: no throughput
    assert s["error"] == "http 500: boom"
    assert s["latency"]["ttft"]["n"] == 1                   # only completed requests count


def test_outputs_that_change_between_streams_are_not_consistent():
    s = served_side("on", [Batch([ok(0, [1, 2])], 1.0), Batch([ok(0, [1, 3])], 1.0)])
    assert not s.summary(repeat=2)["outputs_consistent"]


# ---------------------------------------------------------------------------- table
def served_scenario(name, a, b, reference=None):
    sc = scenario(name, a, b, reference=reference, tolerance=0.97)
    sc.update(served=True, requests_per_stream=2,
              latency_ratios=abstats.latency_ratios(a["latency"], b["latency"]))
    return sc


def test_serve_table_shows_the_client_columns_errors_ratios_and_rollbacks():
    good = [Batch([ok(0, [5, 6]), ok(1, [7, 8])], 1.0)] * 3
    a = served_side("faults only", [Batch([failed(0, "http 500"),
                                           failed(1, "connection refused")], 1.0)]).summary(3)
    a["engine_died"], a["faults_injected"] = True, 1
    b = served_side("on + faults", good, {"rollback": {"InjectedFault": 9}}).summary(3)
    b["processes"] = ["EngineCore", "MainProcess", "VllmWorker-0"]
    base_a, base_b = served_side("off", good).summary(3), served_side("on", good).summary(3)
    base_b["processes"] = b["processes"]
    ref = {"outputs": base_a["outputs"], "finish_reasons": base_a["finish_reasons"]}
    rep = report(served_scenario("baseline", base_a, base_b),
                 served_scenario("alloc-faults", a, b, reference=ref))
    rep["settings"].update(serve=True, request_rate=16.0)
    text = abreport.format_table(rep)
    header = text.splitlines()[1]
    for col in abreport.SERVE_COLUMNS:
        assert col in header
    assert "--serve" in text.splitlines()[0] and "Poisson 16.0 req/s" in text
    row_a = next(line for line in text.splitlines() if line.startswith("alloc-faults"))
    assert "0/2 of 2" in row_a and "connection refused x1, http 500 x1" in row_a
    assert " YES " in row_a
    row_b = text.splitlines()[text.splitlines().index(row_a) + 1]
    assert "6/0 of 6" in row_b and "2/2 =ref" in row_b and row_b.rstrip().endswith("9")
    assert "50/50" in row_b and "15.0/20.0" in row_b          # TTFT, ITL p50/p99 ms
    base = next(line for line in text.splitlines() if line.startswith("baseline"))
    base_b_row = text.splitlines()[text.splitlines().index(base) + 1]
    assert "1.000 [1.00-1.00]" in base_b_row and "1.00/1.00/1.00" in base_b_row
    assert text.splitlines()[-1].startswith("verdict: PASS")


# ---------------------------------------------------------------------------- command line
def _settings(*argv):
    return ab.validate(ab.build_parser().parse_args(list(argv)))


def test_serve_runs_the_served_scenarios_with_its_rate_and_timeouts(tmp_path):
    s = _settings("--serve", "--json", str(tmp_path / "r.json"))
    assert s["serve"] and s["scenarios"] == list(SERVED) == ["baseline", "alloc-faults"]
    assert s["request_rate"] == 16.0 and s["request_timeout"] == 120.0
    assert s["log_dir"] == str(tmp_path / "r-logs")
    assert _settings("--serve", "--request-rate", "inf")["request_rate"] == math.inf
    assert not _settings()["serve"] and _settings()["log_dir"] is None


def test_serve_dispatches_every_scenario_to_the_server_runner(mocker, tmp_path, capsys):
    mocker.patch.object(abrun, "WorkloadProcess", side_effect=AssertionError("in-process"))
    mocker.patch.object(ab, "run_scenario", side_effect=AssertionError("in-process"))
    seen = []

    def fake(sc, settings, prog, references, env):
        seen.append(sc.name)
        good = [Batch([ok(0, [5, 6])], 1.0)]
        a, b = served_side("off", good).summary(1), served_side("on", good).summary(1)
        return served_scenario(sc.name, a, b)

    mocker.patch.object(abserve, "run_scenario", side_effect=fake)
    code = ab.main(["--serve", "--scenario", "baseline,alloc-faults", "--no-microbench",
                    "--no-png", "--json", str(tmp_path / "r.json"), "--quiet"])
    assert seen == ["baseline", "alloc-faults"]
    out = capsys.readouterr().out
    assert "TTFT p50/p99 ms" in out and code == 0


def test_serve_args_are_the_engine_settings_as_vllm_serve_flags(tmp_path):
    settings = _settings("--serve", "--no-enable-prefix-caching")
    args = abserve.serve_args(scenario_spec(SCENARIOS["baseline"], settings), str(tmp_path))
    text = " ".join(args)
    for want in ("--num-gpu-blocks-override 64", "--block-size 32", "--load-format dummy",
                 "--max-model-len 512", "--max-num-seqs 8", "--seed 0", "--dtype bfloat16"):
        assert want in text
    assert "--skip-tokenizer-init" in args and "--enforce-eager" in args
    assert "--no-enable-prefix-caching" in args
    assert "--model" not in args and str(tmp_path) not in args        # the model is positional
