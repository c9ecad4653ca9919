"""kvguard-ab command line: arguments fail fast, settings reach the engines, exit codes."""
import importlib.util
import json
import os
import signal

import pytest

from vllm_kvguard.testing.ab_samples import scenario, side
from vllm_kvguard.tools.ab import cli as ab, chart as abchart, micro as abmicro, run as abrun
from vllm_kvguard.tools.ab.scenarios import (MIN_AUTO_ROUNDS, SCENARIOS, scenario_envs,
                                            scenario_spec, workload_key)


@pytest.fixture
def no_engine(mocker):
    """Any attempt to start an engine or a benchmark fails the test."""
    mocker.patch.object(abmicro, "start", side_effect=AssertionError("benchmark started"))
    mocker.patch.object(abrun, "WorkloadProcess", side_effect=AssertionError("engine started"))
    mocker.patch.object(abrun, "run_in_subprocess", side_effect=AssertionError("engine started"))


@pytest.mark.parametrize("argv, words", [
    (["--scenario", "nope"], ["--scenario", "'nope'", "baseline", "alloc-faults",
                              "kv-pressure", "hybrid-spec", "coverage"]),
    (["--scenario", "baseline,bogus"], ["--scenario", "'bogus'", "valid"]),
    (["--model", "/no/such/model"], ["--model", "does not exist", "llama", "nemotron_h"]),
    (["--speculative-config", "{method: ngram}"], ["--speculative-config", "not valid JSON",
                                                   "num_speculative_tokens"]),
    (["--speculative-config", '"ngram"'], ["--speculative-config", "method"]),
    (["--faults", "often"], ["--faults", "every", "rate"]),
    (["--repeat", "0"], ["--repeat", ">= 1"]),
    (["--rounds", "many"], ["--rounds", "auto"]),
    (["--tolerance", "3"], ["--tolerance", "0.97"]),
    (["--threads", "many"], ["--threads", "auto"]),
    (["--engine-arg", "no-equals"], ["--engine-arg", "KEY=VALUE"]),
    (["--json", "/no/such/dir/x.json"], ["--json", "/no/such/dir"]),
    (["--serve", "--scenario", "kv-pressure"], ["--scenario", "'kv-pressure'", "--serve",
                                                "baseline, alloc-faults"]),
    (["--serve", "--request-rate", "0"], ["--request-rate", "'0'", "inf"]),
    (["--serve", "--request-rate", "fast"], ["--request-rate", "'fast'"]),
    (["--serve", "--request-timeout", "-1"], ["--request-timeout", "> 0"]),
])
def test_bad_argument_fails_fast_naming_it_and_the_valid_choices(argv, words, no_engine,
                                                                 capsys):
    with pytest.raises(SystemExit) as exc:
        ab.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    for word in words:
        assert word in err


def test_model_dir_without_config_json(tmp_path, no_engine, capsys):
    with pytest.raises(SystemExit):
        ab.main(["--model", str(tmp_path)])
    assert "has no config.json" in capsys.readouterr().err


def _settings(*argv):
    return ab.validate(ab.build_parser().parse_args(list(argv)))


def test_default_runs_every_scenario_but_the_self_check_in_order():
    assert _settings()["scenarios"] == [
        "baseline", "alloc-faults", "kv-pressure", "hybrid-spec", "coverage"]
    assert _settings("--scenario", "self-check")["scenarios"] == ["self-check"]
    assert _settings("--scenario", "coverage", "baseline,coverage")["scenarios"] == [
        "coverage", "baseline"]


def test_connector_faults_runs_on_request_with_its_own_fault_schedule():
    s = _settings("--scenario", "connector-faults")
    sc = SCENARIOS["connector-faults"]
    env_a, env_b, _, _ = scenario_envs(sc, s)
    assert env_a["KVGUARD_FAULTS"] == env_b["KVGUARD_FAULTS"] == "phase=lookup,every=5"
    assert env_a["KVGUARD_PATCHES"] == "none" and "KVGUARD_PATCHES" not in env_b
    assert scenario_spec(sc, s)["connector"] == "ExampleConnector"


def test_engine_settings_override_every_scenario(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    s = _settings("--model", str(tmp_path), "--max-num-seqs", "4", "--no-enforce-eager",
                  "--speculative-config", "null", "--engine-arg", "swap_space=0",
                  "--engine-arg", "kv_cache_dtype=fp8", "--max-tokens", "16")
    assert s["overrides"] == {"max_num_seqs": 4, "enforce_eager": False,
                              "speculative_config": None, "swap_space": 0,
                              "kv_cache_dtype": "fp8", "load_format": "auto"}
    spec = scenario_spec(SCENARIOS["coverage"], s)
    assert spec["model"] == str(tmp_path.resolve())
    assert spec["engine"]["max_num_seqs"] == 4 and spec["engine"]["speculative_config"] is None
    assert "enforce_eager" not in spec["gpu_engine"]       # the user's choice wins on GPU
    assert spec["max_tokens"] == 16 and spec["num_requests"] == 16


def test_embedded_models_by_default():
    s = _settings()
    assert scenario_spec(SCENARIOS["hybrid-spec"], s)["model"] == "nemotron_h"
    assert scenario_spec(SCENARIOS["baseline"], s)["model"] == "llama"
    assert "load_format" not in s["overrides"]


def test_kv_pressure_pool_holds_one_max_len_request_but_not_the_load():
    spec = scenario_spec(SCENARIOS["kv-pressure"], _settings())
    eng = spec["engine"]
    per_request = -(-eng["max_model_len"] // eng["block_size"])
    assert per_request < eng["num_gpu_blocks_override"] < 8 * per_request
    user = scenario_spec(SCENARIOS["kv-pressure"],
                         _settings("--num-gpu-blocks-override", "99"))
    assert user["engine"]["num_gpu_blocks_override"] == 99


def test_alloc_faults_a_is_the_injector_alone_b_adds_the_fixes():
    env_a, env_b, _, _ = scenario_envs(SCENARIOS["alloc-faults"],
                                       _settings("--faults", "every=5", "--threads", "0"))
    assert env_a == {"KVGUARD": "1", "KVGUARD_FAULTS": "every=5", "KVGUARD_PATCHES": "none"}
    assert env_b == {"KVGUARD": "1", "KVGUARD_FAULTS": "every=5"}
    env_a, env_b, _, _ = scenario_envs(SCENARIOS["baseline"], _settings("--threads", "0"))
    assert env_a == {} and env_b == {"KVGUARD": "1"}


def test_self_check_runs_the_plugin_off_on_both_sides():
    env_a, env_b, _, label_b = scenario_envs(SCENARIOS["self-check"], _settings())
    assert env_a == env_b and "KVGUARD" not in env_b and label_b == "off (A/A)"


def test_threads_are_the_same_on_both_sides(mocker):
    mocker.patch.object(ab, "cpu_build_of_vllm", return_value=True)
    env_a, env_b, _, _ = scenario_envs(SCENARIOS["baseline"], _settings())
    one = {"OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    assert env_a == one and env_b == {**one, "KVGUARD": "1"}
    assert _settings("--threads", "2")["thread_env"]["OMP_NUM_THREADS"] == "2"
    # both sides run the same spec, pinned to the same CPU(s)
    spec = scenario_spec(SCENARIOS["baseline"], _settings())
    assert spec["cpus"] == sorted(os.sched_getaffinity(0))[-1:]
    assert _settings("--threads", "0")["cpus"] is None
    mocker.patch.object(ab, "cpu_build_of_vllm", return_value=False)
    assert _settings()["thread_env"] == {}           # a GPU build keeps vLLM's choice


def test_baseline_and_alloc_faults_share_a_workload_so_a_clean_run_is_the_reference():
    s = _settings()
    key = workload_key(scenario_spec(SCENARIOS["baseline"], s))
    assert key == workload_key(scenario_spec(SCENARIOS["alloc-faults"], s))
    assert key == workload_key({**scenario_spec(SCENARIOS["baseline"], s), "rounds": 9})
    assert key != workload_key(scenario_spec(SCENARIOS["kv-pressure"], s))


def test_calibrate_rounds_to_the_sample_duration():
    a, b = abrun.Side("A", "off", {}), abrun.Side("B", "on", {})
    a.warmup_s, b.warmup_s = [0.5, 0.1], [0.4, 0.2]
    assert abrun.calibrate({"rounds": "auto", "sample_seconds": 1.0}, [a, b]) == 10
    assert abrun.calibrate({"rounds": 3, "sample_seconds": 1.0}, [a, b]) == 3
    a.warmup_s = [2.0]                           # slow rounds: still a few per sample
    assert abrun.calibrate({"rounds": "auto", "sample_seconds": 1.0}, [a]) == MIN_AUTO_ROUNDS
    b.warmup_s, a.warmup_s = [], []
    assert abrun.calibrate({"rounds": "auto", "sample_seconds": 1.0}, [a, b]) == MIN_AUTO_ROUNDS


def test_slow_scenarios_ask_for_more_rounds():
    a = abrun.Side("A", "off", {})
    a.warmup_s = [2.0]
    auto = {"rounds": "auto", "sample_seconds": 1.0}
    assert abrun.calibrate(auto, [a], floor=6) == 6
    assert abrun.calibrate(auto, [a], floor=1) == MIN_AUTO_ROUNDS     # never below the minimum
    assert abrun.calibrate({"rounds": 2, "sample_seconds": 1.0}, [a], floor=6) == 2  # explicit wins
    # the default run fits in 10 minutes: the slow hybrid scenario runs a short workload
    hybrid = SCENARIOS["hybrid-spec"].workload
    assert hybrid["max_tokens"] * hybrid["num_requests"] <= 32


@pytest.fixture
def fake_run(mocker, tmp_path, monkeypatch):
    """main() with scenarios replaced by canned results (no engine)."""
    monkeypatch.chdir(tmp_path)
    return mocker.patch.object(ab, "run_scenario")


def test_exit_zero_when_every_check_passes(fake_run, tmp_path, capsys):
    fake_run.return_value = scenario()
    assert ab.main(["--scenario", "baseline", "--no-microbench", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "verdict: PASS" in out
    data = json.loads((tmp_path / "kvguard-ab.json").read_text())
    assert data["ok"] and data["scenarios"][0]["name"] == "baseline"
    if importlib.util.find_spec("matplotlib"):
        assert (tmp_path / "kvguard-ab.png").read_bytes()[:4] == b"\x89PNG"
    else:                                    # the chart extra is not installed
        assert f"kvguard-ab: {abchart.MISSING}" in out.splitlines()
        assert not (tmp_path / "kvguard-ab.png").exists()


def test_exit_one_when_b_is_slower_than_the_tolerance(fake_run, capsys):
    fake_run.return_value = scenario(b=side("on", tok_s=(90.0, 90.0, 90.0)))
    assert ab.main(["--scenario", "baseline", "--no-microbench", "--quiet", "--no-png"]) == 1
    assert "[FAIL] throughput ratio" in capsys.readouterr().out


def test_ctrl_c_prints_what_was_done_and_exits_130(fake_run, tmp_path, capsys):
    fake_run.side_effect = [scenario(), KeyboardInterrupt()]
    assert ab.main(["--scenario", "baseline", "kv-pressure", "--no-microbench",
                    "--quiet"]) == 130
    out = capsys.readouterr().out
    assert "baseline" in out and "INTERRUPTED" in out
    data = json.loads((tmp_path / "kvguard-ab.json").read_text())
    assert data["interrupted"] and not data["ok"] and len(data["scenarios"]) == 1


def test_sigterm_stops_like_ctrl_c_and_restores_the_handlers(fake_run, tmp_path):
    before = signal.getsignal(signal.SIGTERM)

    results = iter([scenario()])

    def run_scenario(*args):
        for done in results:
            return done
        os.kill(os.getpid(), signal.SIGTERM)          # the second scenario is terminated
        raise AssertionError("SIGTERM did not stop the run")

    fake_run.side_effect = run_scenario
    assert ab.main(["--scenario", "baseline", "coverage", "--no-microbench", "--quiet",
                    "--no-png"]) == 130
    assert json.loads((tmp_path / "kvguard-ab.json").read_text())["interrupted"]
    assert signal.getsignal(signal.SIGTERM) is before


def test_microbench_scripts_are_found_in_the_source_checkout():
    for script, _, _ in abmicro.MICROBENCH.values():
        assert (abmicro.BENCH_DIR / f"bench_{script}.py").is_file()


def test_microbench_absent_is_na(tmp_path, monkeypatch):
    monkeypatch.setattr(abmicro, "BENCH_DIR", tmp_path)
    res = abmicro.microbench("allocator", 10)
    assert res["ratio"] is None and "bench_allocator.py not present" in res["detail"]


def _fake_bench(tmp_path, name, text):
    (tmp_path / f"bench_{name}.py").write_text(
        "import sys\nprint(sys.argv[1:])\nprint(" + repr(text) + ")\n")


def test_microbench_reads_the_allocator_summary_line(tmp_path, monkeypatch):
    _fake_bench(tmp_path, "allocator", "lookahead 2: ...\nallocator patch throughput ratio "
                "0.962 (target >= 0.95, stretch 0.98): meets the target")
    monkeypatch.setattr(abmicro, "BENCH_DIR", tmp_path)
    res = abmicro.microbench("allocator", 60)
    assert res["ratio"] == 0.962 and "meets the target" in res["detail"]


def test_microbench_dispatch_reports_the_worst_case_with_a_target(tmp_path, monkeypatch):
    _fake_bench(tmp_path, "dispatch", "\n".join([
        "  V1 uniform decode, graphed (FULL, 100x4)    4310 ns     4383 ns    +2.30%  "
        "( +1.69% fastest)  OK",
        "  V1 fallback, counted (NONE, 130x4)          1738 ns    23755 ns   +1187.39%  "
        "(+826.34% fastest)",
        "  V2 uniform decode, graphed (FULL, 100x4)     361 ns      369 ns    +0.90%  "
        "( +1.04% fastest)  OK"]))
    monkeypatch.setattr(abmicro, "BENCH_DIR", tmp_path)
    res = abmicro.microbench("dispatch", 60)
    assert res["ratio"] == pytest.approx(1.023)
    assert res["detail"].startswith("V1 uniform decode, graphed")


def test_the_instruction_count_is_read_as_a_deterministic_ratio(tmp_path, monkeypatch):
    _fake_bench(tmp_path, "allocator", "per call: ...\nvLLM 97,370 Ir/call; through a "
                "pass-through +669 (0.69%); through the transaction +2,788 Ir/call (2.86%), "
                "of which its record, journal reset and try +2,119; per layout: +669/+2,788")
    monkeypatch.setattr(abmicro, "BENCH_DIR", tmp_path)
    proc = abmicro.start("instructions")              # in the background, as ab does
    res = abmicro.finish("instructions", proc, 60)
    assert res["ratio"] == pytest.approx(1 + 2788 / 97370) and res["deterministic"]
    assert "+2,788 Ir (2.86%" in res["detail"]


def test_microbench_without_its_summary_is_na(tmp_path, monkeypatch):
    _fake_bench(tmp_path, "allocator", "something else")
    monkeypatch.setattr(abmicro, "BENCH_DIR", tmp_path)
    res = abmicro.microbench("allocator", 60)
    assert res["ratio"] is None and "no summary line" in res["detail"]


def _run(key="B", *, outputs=((5, 6),), sample=(0.1, 0.2), died=False, counters=None,
         engine_s=2.0, held=0):
    side = abrun.Side(key, "on", {"KVGUARD": "1"})
    side.ready = {"ok": True, "engine_s": engine_s, "import_s": 6.0}
    side.sample = None if died else list(sample)
    side.died = died
    side.final = {
        "ok": not died, "engine_died": died, "tokens_per_round": 64,
        "totals": {"submitted": 8, "completed": 0 if died else 8, "failed": 8 if died else 0,
                   "aborted": 0},
        "outputs": None if died else [list(o) for o in outputs],
        "finish_reasons": None if died else ["length"] * len(outputs),
        "outputs_consistent": True, "held_blocks": None if died else held,
        "audit_violations": None if died else [], "faults_injected": 3,
        "kvguard": {"results": {"allocator": "applied"}, "counters": counters or {}}}
    return side


def test_side_summary_sums_requests_and_counters_over_pairs():
    runs = [_run(counters={"rollback": {"x": 2}}, engine_s=2.0),
            _run(counters={"rollback": {"x": 3}}, engine_s=4.0, sample=(0.5, 0.25))]
    s = abrun.side_summary(runs, repeat=2)
    assert s["totals"]["completed"] == 16 and s["faults_injected"] == 6
    assert s["counters"] == {"rollback": {"x": 5}}
    assert s["tok_s"] == [640.0, 256.0]                 # 64 tokens / fastest round
    assert s["startup_s"] == 3.0 and s["held_blocks"] == 0 and s["outputs_consistent"]


def test_side_summary_flags_outputs_that_differ_between_process_pairs():
    s = abrun.side_summary([_run(), _run(outputs=((5, 7),))], repeat=2)
    assert s["outputs"] == [[5, 6]] and not s["outputs_consistent"]


def test_side_summary_of_a_side_that_died_and_was_not_restarted():
    dead = _run("A", died=True)
    assert dead.failed
    s = abrun.side_summary([dead], repeat=3)
    assert s["engine_died"] and s["tok_s"] == [None, None, None]
    assert s["held_blocks"] is None and s["outputs"] is None


def test_steps_for_counts_every_progress_advance():
    settings = _settings("--scenario", "baseline", "kv-pressure", "--repeat", "2")
    settings["microbench"] = True
    assert abrun.steps_for(settings) == 2 * 2 * 8 + 2
