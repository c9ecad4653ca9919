"""``/health`` that tells the truth, on the real serving path: ``vllm serve`` (API server,
EngineCore, worker) with a tiny dummy-weight model on CPU, probed over loopback.

Frozen: ``KVGUARD_FAULTS=phase=freeze,every=N`` blocks EngineCore's Nth step forever (in
``Scheduler.update_from_output``) while requests are in flight. With the plugin,
``/health`` answers 503 within ``KVGUARD_HEALTH_STALL_S`` plus one poll (plus the
counters' refresh period: the front end learns of progress from EngineCore's replies),
logs the cause and shows it on ``/metrics``; without the fixes (``KVGUARD_PATCHES=none``,
the same fault) vLLM keeps answering 200. Both servers run at once.

Busy: more concurrent long-prompt requests than ``--max-num-seqs``, with the same short
threshold: 200 on every poll, before (idle), during and after the load.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from vllm_kvguard import remote
from vllm_kvguard.fixes.health import verdict
from vllm_kvguard.tools.serve import Server, _get, complete_all
from vllm_kvguard.tools.tiny_models import write_model
from vllm_kvguard.tools.ab.workload import make_prompts

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

ARGS = ("--load-format", "dummy", "--skip-tokenizer-init", "--enforce-eager",
        "--dtype", "bfloat16", "--max-model-len", "512", "--max-num-seqs", "4",
        "--seed", "0", "--block-size", "32", "--num-gpu-blocks-override", "128")
STALL_S = 15            # KVGUARD_HEALTH_STALL_S for these servers
POLL_S = 2.0            # the probe's period
#: how late the front end can learn of EngineCore's last reply: one counters refresh,
#: one watch period, and a second for the log line to be read
SLACK_S = remote.REFRESH_S + verdict.WATCH_S + 1.0
FREEZE = "phase=freeze,every=40"
FROZEN_LINE = "is frozen (KVGUARD_FAULTS phase=freeze)"


def _health(server) -> int:
    try:
        return _get(server.base_url + "/health", timeout=POLL_S)[0]
    except OSError:
        return -1       # no answer within a poll


def _wait_log(server, text: str, deadline: float) -> float | None:
    """Poll the server's log for ``text`` until ``deadline``; when it was seen."""
    while time.monotonic() < deadline:
        if text in server.log():
            return time.monotonic()
        if not server.alive:
            return None
        time.sleep(0.2)
    return None


def _load(server, n: int, prompt_len: int, max_tokens: int, timeout: float,
          concurrency: int = 0):
    prompts = make_prompts({"num_requests": n, "seed": 1, "prompt_len": prompt_len,
                            "repetitive": False})
    return complete_all(server.base_url, server.model_id(), prompts, max_tokens,
                        concurrency=concurrency or n, request_timeout=timeout,
                        deadline_s=timeout)


def _frozen_run(server, plugin: bool) -> dict:
    """Start requests, wait for the freeze, poll /health until 503 or the deadline."""
    server.wait_ready(900)
    assert _health(server) == 200
    load = threading.Thread(target=_load, args=(server, 4, 40, 200, STALL_S * 4 + 120),
                            daemon=True)
    load.start()
    frozen_at = _wait_log(server, FROZEN_LINE, time.monotonic() + 300)
    assert frozen_at is not None, server.tail()
    polls, deadline = [], frozen_at + STALL_S + 3 * POLL_S + SLACK_S
    while time.monotonic() < deadline:
        t = time.monotonic()
        polls.append((t - frozen_at, _health(server)))
        if plugin and polls[-1][1] == 503:
            break
        time.sleep(max(0.0, POLL_S - (time.monotonic() - t)))
    return {"polls": polls, "metrics": server.metrics_text() if plugin else "",
            "log": server.log()}


@pytest.mark.timeout(1800)
def test_a_frozen_engine_core_answers_503_with_the_plugin_and_200_without(tmp_path):
    model = write_model("llama", tmp_path / "llama")
    common = {"KVGUARD": "1", "KVGUARD_FAULTS": FREEZE, "KVGUARD_HEALTH_STALL_S": str(STALL_S)}
    with Server(model, list(ARGS), common, name="freeze-on", log_dir=str(tmp_path)) as on, \
            Server(model, list(ARGS), {**common, "KVGUARD_PATCHES": "none"},
                   name="freeze-off", log_dir=str(tmp_path)) as off:
        with ThreadPoolExecutor(2) as pool:
            runs = pool.map(lambda a: _frozen_run(*a), [(on, True), (off, False)])
            got_on, got_off = list(runs)
    first_503 = next((t for t, code in got_on["polls"] if code == 503), None)
    print(f"\n[health] plugin on: polls {[(round(t, 1), c) for t, c in got_on['polls']]}")
    print(f"[health] plugin off: polls {[(round(t, 1), c) for t, c in got_off['polls']]}")
    assert first_503 is not None, got_on["log"][-4000:]
    assert first_503 <= STALL_S + POLL_S + SLACK_S, first_503
    assert all(code == 200 for t, code in got_on["polls"] if t < STALL_S - SLACK_S), got_on
    assert "/health answers 503: stalled: EngineCore holds work" in got_on["log"]
    assert 'kvguard_health_unhealthy{reason="stalled"} 1.0' in got_on["metrics"]
    since = [line for line in got_on["metrics"].splitlines()
             if line.startswith("kvguard_seconds_since_step{")]
    assert since and float(since[0].split()[-1]) >= STALL_S, since
    # vLLM alone: the same frozen EngineCore, 200 on every poll past the threshold
    assert got_off["polls"] and got_off["polls"][-1][0] >= STALL_S + 2 * POLL_S
    assert {code for _, code in got_off["polls"]} == {200}, got_off["polls"]


@pytest.mark.timeout(1500)
def test_an_idle_and_a_saturated_server_answer_200_on_every_poll(tmp_path):
    model = write_model("llama", tmp_path / "llama")
    env = {"KVGUARD": "1", "KVGUARD_HEALTH_STALL_S": str(STALL_S)}
    with Server(model, list(ARGS), env, name="busy-on", log_dir=str(tmp_path)) as server:
        server.wait_ready(900)
        polls: list[tuple[float, int]] = []
        done = threading.Event()

        def poll():
            t0 = time.monotonic()
            while not done.is_set():
                t = time.monotonic()
                polls.append((t - t0, _health(server)))
                done.wait(max(0.0, 1.0 - (time.monotonic() - t)))

        poller = threading.Thread(target=poll, daemon=True)
        poller.start()
        idle_until = time.monotonic() + STALL_S + 2 * POLL_S      # idle past the threshold
        while time.monotonic() < idle_until and poller.is_alive():
            done.wait(0.5)
        idle = len(polls)
        # 32 in flight on 4 sequence slots, prompts near max_model_len: a deep queue,
        # every slot full, for longer than the threshold (~25 s here)
        t0 = time.monotonic()
        batch = _load(server, 192, 400, 100, timeout=900, concurrency=32)
        busy_s = time.monotonic() - t0
        metrics = server.metrics_text()
        done.set()
        poller.join(timeout=10)
    print(f"\n[health] busy {busy_s:.1f} s: {batch.summary()}; {len(polls)} polls "
          f"({idle} idle), codes {sorted({c for _, c in polls})}")
    # every request served; the client's keep-alive race with the server (a reused
    # connection closed under it: "connection error", never sent) is not the engine's
    counts = batch.counts()
    assert set(counts) <= {"ok", "connection error"}, batch.summary()
    assert counts.get("ok", 0) >= 0.95 * len(batch.outcomes), batch.summary()
    assert busy_s > STALL_S, busy_s             # saturated for longer than the threshold
    assert idle >= STALL_S, polls
    assert [p for p in polls if p[1] != 200] == [], polls
    assert 'kvguard_health_unhealthy{reason="stalled"} 0.0' in metrics
    longest = [line for line in metrics.splitlines()
               if line.startswith("kvguard_longest_step_seconds{")]
    print(f"[health] {longest}")
    assert longest and 0.0 < float(longest[0].split()[-1]) < STALL_S
