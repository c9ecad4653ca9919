"""Property: the liveness guard never fails a request vLLM alone would complete.

Random traffic on the REAL ``Scheduler`` (vLLM's own ``schedule`` + ``update_from_output``
with synthetic outputs): a small pool (5-24 usable 16-token blocks), 1-6 requests with
prompts of 1-400 tokens and ``max_tokens`` 1-200, some too long for the pool from the
start and some that outgrow it. vLLM alone and with the plugin run the same traffic for a
bounded number of steps. Every request vLLM alone finished finishes the same way with the
plugin; the plugin fails only requests vLLM alone never finished, each with a proof (the
certificate); and with the plugin every request is resolved (no request is left waiting
forever behind one that can never fit).
"""
from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import vllm.v1.core.kv_cache_manager  # noqa: E402,F401  (loaded: patches apply at once)

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from vllm_kvguard import activation, log, report  # noqa: E402
from vllm_kvguard.testing.kv_fixtures import make_request, make_scheduler, scheduler_step  # noqa: E402

STEPS = 1500        # enough for 6 requests of up to 200 output tokens one after another, with recomputes

TRAFFIC = st.tuples(
    st.integers(6, 25),                                             # num_gpu_blocks
    st.lists(st.tuples(st.integers(1, 400), st.integers(1, 200)), min_size=1, max_size=6))


def _run(on: bool, blocks: int, reqs) -> dict[str, str]:
    activation.deactivate()
    log.reset_once()
    report.reset_counters()
    activation.activate({"KVGUARD": "1", "KVGUARD_PATCHES": "allocator" if on else "none"})
    sched = make_scheduler(num_gpu_blocks=blocks)
    for i, (plen, max_tokens) in enumerate(reqs):
        sched.add_request(make_request(f"r{i}", [(i * 31 + j) % 900 + 3 for j in range(plen)],
                                       max_tokens=max_tokens))
    finished: dict[str, str] = {}
    idle = 0
    for _ in range(STEPS):
        out, outputs = scheduler_step(sched, sample_token=5)
        # nothing scheduled, nothing running: no outside event can change that here
        idle = idle + 1 if not out.total_num_scheduled_tokens and not sched.running else 0
        if idle >= 20:
            break
        for eco in outputs.values():
            for o in eco.outputs:
                if o.finish_reason is not None:
                    finished[o.request_id] = str(o.finish_reason)
        if len(finished) == len(reqs):
            break
    return finished


@settings(max_examples=25, deadline=None, database=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
@given(TRAFFIC)
def test_no_request_vllm_completes_is_failed(traffic):
    blocks, reqs = traffic
    plain = _run(False, blocks, reqs)
    guarded = _run(True, blocks, reqs)
    for rid, reason in plain.items():
        assert guarded.get(rid) == reason, (rid, plain, guarded)
    for rid, reason in guarded.items():
        if reason == "error":
            assert rid not in plain, (rid, plain, guarded)
            plen, max_tokens = reqs[int(rid[1:])]
            # the proof: the sequence it must compute exceeds the usable blocks' tokens
            assert min(plen + max_tokens - 1, 512) > (blocks - 1) * 16, (rid, reqs, blocks)
    assert len(guarded) == len(reqs), (reqs, blocks, plain, guarded)   # all resolved
