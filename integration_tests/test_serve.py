"""The plugin on the real serving path: ``vllm serve`` in its default multiprocess mode
(API server, EngineCore, worker processes; spawn, as vLLM forces on CPU), tiny
dummy-weight models, driven by the ``openai`` client 16 requests at a time (token-id
prompts, greedy). Loopback only; every request has a timeout and every set a deadline.

Each configuration runs once per session (:mod:`vllm_kvguard.testing.serve_fixtures`):
start, 32 requests, ``/metrics``, stop. The pool starts the configurations the selected
tests need in the order they need them, ``KVGUARD_SERVE_PARALLEL`` (2) at a time.
``-m "not slow"`` leaves out the hybrid + ngram and tensor-parallel servers.
"""
from __future__ import annotations

import json
import os
import tempfile

import pytest

from vllm_kvguard.testing.serve_fixtures import ServeConfig, ServePool

pytestmark = [pytest.mark.multiproc]

TINY = ("--load-format", "dummy", "--skip-tokenizer-init", "--enforce-eager",
        "--dtype", "bfloat16", "--max-model-len", "512", "--max-num-seqs", "16",
        "--seed", "0")
# 32-token blocks and a 256-block pool: ~3 block allocations per request, no preemption
LLAMA = TINY + ("--block-size", "32", "--num-gpu-blocks-override", "256")
NGRAM_K3 = json.dumps({"method": "ngram", "num_speculative_tokens": 3,
                       "prompt_lookup_max": 3, "prompt_lookup_min": 2})
# hybrid + spec decoding on CPU needs prefix caching off (vLLM's CPU limit)
NEMOTRON_NGRAM = TINY + ("--no-enable-prefix-caching", "--speculative-config", NGRAM_K3)

ON = (("KVGUARD", "1"),)
EVERY7 = ("KVGUARD_FAULTS", "every=7")
RATE = ("KVGUARD_FAULTS", "rate=0.2,seed=3")
AUDIT = ("KVGUARD_AUDIT", "1")
TP2 = ("--tensor-parallel-size", "2")
TP2_BIND = ("VLLM_CPU_OMP_THREADS_BIND", "0|1")     # one core per worker (one NUMA node here)
LOOKUP5 = ("KVGUARD_FAULTS", "phase=lookup,every=5")


def connector(name: str) -> tuple[str, ...]:
    """vLLM's ExampleConnector, KV files in a directory of this server run's own."""
    storage = os.path.join(tempfile.gettempdir(), f"kvguard-serve-kv-{os.getpid()}-{name}")
    return ("--kv-transfer-config", json.dumps({
        "kv_connector": "ExampleConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": storage}}))

CONFIGS = [
    ServeConfig("llama-off", "llama", LLAMA),
    ServeConfig("llama-on", "llama", LLAMA, ON + (AUDIT,)),
    ServeConfig("llama-faults-fixes-off", "llama", LLAMA,
                ON + (("KVGUARD_PATCHES", "none"), EVERY7), expect_death=True),
    ServeConfig("llama-faults-every7", "llama", LLAMA, ON + (EVERY7, AUDIT)),
    ServeConfig("llama-faults-rate", "llama", LLAMA, ON + (RATE, AUDIT)),
    ServeConfig("nemotron-off", "nemotron_h", TINY, num_requests=16, prompt_len=40),
    ServeConfig("nemotron-faults", "nemotron_h", TINY, ON + (EVERY7, AUDIT),
                num_requests=16, prompt_len=40),
    # both sides pad the conv weight vLLM's CPU kernel reads past (see serve_fixtures)
    ServeConfig("nemotron-ngram-off", "nemotron_h", NEMOTRON_NGRAM, num_requests=16,
                prompt_len=40, cpu_conv_padding=True),
    ServeConfig("nemotron-ngram-faults", "nemotron_h", NEMOTRON_NGRAM,
                ON + (EVERY7, AUDIT), num_requests=16, prompt_len=40, cpu_conv_padding=True),
    ServeConfig("llama-connector-faults-fixes-off", "llama",
                LLAMA + connector("fixes-off"), ON + (("KVGUARD_PATCHES", "none"), LOOKUP5),
                expect_death=True),
    ServeConfig("llama-connector-faults", "llama", LLAMA + connector("on"),
                ON + (LOOKUP5, AUDIT)),
    ServeConfig("llama-tp2-off", "llama", LLAMA + TP2, (TP2_BIND,)),
    ServeConfig("llama-tp2-faults", "llama", LLAMA + TP2, ON + (EVERY7, AUDIT, TP2_BIND)),
]


# A test may wait for servers queued behind others: startup alone took 5-6 min per server
# with load average 7 on this 2-core machine (1-2 min when it is quiet).
TIMEOUT_S = 1800


def uses(*names):
    """The server runs a test reads (the pool starts them ahead, in test order)."""
    return pytest.mark.serve_runs(*names)


@pytest.fixture(scope="module")
def pool(request):
    wanted = []
    for item in request.session.items:
        marker = item.get_closest_marker("serve_runs")
        if marker is not None and item.module is request.module:
            wanted += [n for n in marker.args if n not in wanted]
    p = ServePool(CONFIGS, parallel=int(os.environ.get("KVGUARD_SERVE_PARALLEL", "2")))
    p.prefetch(wanted)
    try:
        yield p
    finally:
        p.close()


def served(pool, name) -> "ServeRun":  # noqa: F821
    run = pool.get(name)
    assert run.error is None, f"{name}: {run.error}\n{run.log[-3000:]}"
    return run


def record(name, **facts):
    """What a run showed, in the test output (-s) and the JUnit properties."""
    print(f"\n[serve] {name}: " + "; ".join(f"{k}={v}" for k, v in facts.items()))


def assert_all_ok(run):
    assert run.batch.all_ok, f"{run.config.name}: {run.batch.summary()}: " + "; ".join(
        o.detail for o in run.batch.outcomes if not o.ok)[:2000]


def rollbacks(run) -> int:
    return sum(run.counters.get("rollback", {}).values())


def assert_audit_clean(run):
    assert run.counters.get("audit", {}).get("steps", 0) > 0, run.counters   # it ran
    assert "audit_violation" not in run.counters, run.counters


@pytest.mark.slow          # every7 below is plugin on (with faults) vs off, token-identical
@pytest.mark.timeout(TIMEOUT_S)
@uses("llama-off", "llama-on")
def test_no_faults_every_request_succeeds_identically_to_plugin_off(pool):
    off, on = served(pool, "llama-off"), served(pool, "llama-on")
    for run in (off, on):
        assert_all_ok(run)
    assert on.batch.tokens() == off.batch.tokens()              # greedy, token-identical
    assert len(on.batch.outcomes) == 32
    assert off.reports == {}                                    # plugin off: nothing active
    assert {"MainProcess", "EngineCore", "VllmWorker-0"} <= set(on.reports), on.reports
    assert rollbacks(on) == 0
    assert_audit_clean(on)
    record("no-faults", off_startup_s=round(off.startup_s), on_startup_s=round(on.startup_s),
           off=off.batch.summary(), on=on.batch.summary(), counters=on.counters)


@pytest.mark.timeout(TIMEOUT_S)
@uses("llama-faults-fixes-off")
def test_faults_with_fixes_off_kill_engine_core_and_the_client_sees_it(pool):
    run = served(pool, "llama-faults-fixes-off")
    counts = run.batch.counts()
    record("fixes-off+every=7", client=counts, server_alive_after=run.alive_after,
           exit_code=run.exit_code)
    # the injected fault reached EngineCore and killed it ...
    assert run.log_has("injected: Cannot get"), run.log[-3000:]
    assert "EngineCore" in run.reports, run.reports
    assert run.log_has("TEST-ONLY allocator fault injection is ON")
    # ... and the clients saw it: no request completed, the server is gone
    assert counts.get("ok", 0) < len(run.batch.outcomes), counts
    assert set(counts) - {"ok"} <= {"http 500", "connection refused", "connection error"}, counts
    assert not run.alive_after


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("name", [
    pytest.param("llama-faults-every7", marks=uses("llama-off", "llama-faults-every7")),
    pytest.param("llama-faults-rate", marks=[pytest.mark.slow,
                                             uses("llama-off", "llama-faults-rate")])])
def test_faults_with_plugin_on_every_request_succeeds_identically(pool, name):
    off, run = served(pool, "llama-off"), served(pool, name)
    assert_all_ok(run)
    assert run.batch.tokens() == off.batch.tokens()
    assert rollbacks(run) > 0, run.counters                     # faults fired, rolled back
    assert "rollback_failed" not in run.counters
    assert_audit_clean(run)
    assert run.alive_after
    record(name, client=run.batch.summary(), rollbacks=run.counters.get("rollback"),
           audit_steps=run.counters["audit"]["steps"], startup_s=round(run.startup_s))


def _hybrid(pool, off_name, faults_name):
    off, run = served(pool, off_name), served(pool, faults_name)
    assert_all_ok(off)
    assert_all_ok(run)
    assert run.batch.tokens() == off.batch.tokens()
    assert rollbacks(run) > 0, run.counters
    assert_audit_clean(run)
    record(faults_name, client=run.batch.summary(), rollbacks=run.counters.get("rollback"),
           audit_steps=run.counters["audit"]["steps"], startup_s=round(run.startup_s))


@pytest.mark.slow          # hybrid under faults runs in-process (NemotronH + ngram) by default
@pytest.mark.timeout(TIMEOUT_S)
@uses("nemotron-off", "nemotron-faults")
def test_hybrid_under_faults(pool):
    _hybrid(pool, "nemotron-off", "nemotron-faults")


@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT_S)
@uses("nemotron-ngram-off", "nemotron-ngram-faults")
def test_hybrid_with_ngram_spec_decoding_under_faults(pool):
    _hybrid(pool, "nemotron-ngram-off", "nemotron-ngram-faults")


@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT_S)
@uses("llama-tp2-off", "llama-tp2-faults")
def test_tensor_parallel_2_active_in_both_workers_and_survives_faults(pool):
    off, run = served(pool, "llama-tp2-off"), served(pool, "llama-tp2-faults")
    workers = sorted(p for p in run.reports if "Worker" in p)
    assert len(workers) == 2, run.reports
    assert all(f"(worker rank {p[-1]}, node " in run.reports[p] for p in workers), run.reports
    assert_all_ok(off)
    assert_all_ok(run)
    assert run.batch.tokens() == off.batch.tokens()              # greedy, token-identical
    assert rollbacks(run) > 0, run.counters
    assert_audit_clean(run)
    assert run.log_has("TEST-ONLY allocator fault injection is ON")
    # every process's snapshot is summed on the API server's /metrics: both workers too
    active = run.gauges.get("active_processes", {})
    assert active.get("worker") == 2 and active.get("EngineCore") == 1, run.gauges
    assert active.get("API server") == 1 and sum(active.values()) == 4, active
    record("tp2+every=7", client=run.batch.summary(), workers=workers, active=active,
           rollbacks=run.counters.get("rollback"), startup_s=round(run.startup_s))


@pytest.mark.slow          # the in-process connector-fault test covers it in the default run
@pytest.mark.timeout(TIMEOUT_S)
@uses("llama-off", "llama-connector-faults-fixes-off", "llama-connector-faults")
def test_connector_faults_fail_only_their_requests_with_http_500(pool):
    off, dead = served(pool, "llama-off"), served(pool, "llama-connector-faults-fixes-off")
    assert dead.log_has("injected: KV connector") and not dead.alive_after
    assert dead.batch.counts().get("ok", 0) < len(dead.batch.outcomes)
    run = served(pool, "llama-connector-faults")
    counts = run.batch.counts()
    assert set(counts) == {"ok", "http 500"} and run.alive_after, counts
    for got, want in zip(run.batch.outcomes, off.batch.outcomes):
        assert got.kind == "http 500" or got.token_ids == want.token_ids
    assert run.counters["contained"] == {"get_num_new_matched_tokens": counts["http 500"]}
    assert_audit_clean(run)
    record("llama-connector-faults", client=run.batch.summary(), dead=dead.batch.summary(),
           contained=run.counters.get("contained"), startup_s=round(run.startup_s))
