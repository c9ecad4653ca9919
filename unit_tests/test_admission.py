"""The door (fixes/estimation/admission.py, patches/admission.py) and the hand-off of the
admission limits on REAL vLLM objects: a scheduler publishes its limits at construction,
they reach a front end in another process as JSON numbers in the counters'
``collective_rpc`` reply (validated on receipt; the tightest of several engines), and
vLLM's own ``InputProcessor`` refuses a request that can never fit before EngineCore.

Pool: 16 usable blocks of 16 tokens. A prompt of at most 256 tokens is admitted;
200 prompt tokens + 57 output tokens complete (the last sampled token is never
computed), + 58 never do.
"""
from __future__ import annotations

import asyncio
import json
import logging

import pytest

pytest.importorskip("vllm")

import vllm.v1.core.kv_cache_manager  # noqa: E402,F401  (loaded: patches apply at once)

from vllm_kvguard import activation, remote, report  # noqa: E402
from vllm_kvguard.fixes.estimation import admission  # noqa: E402
from vllm_kvguard.testing.kv_fixtures import make_scheduler, make_vllm_config  # noqa: E402

LIMITS = {"prompt_limit": 256, "total_limit": 257, "start_limit": 256, "max_model_len": 512,
          "usable": 16, "prompt_group": "group 0 (full attention)",
          "total_group": "group 0 (full attention)", "start_group": "nothing",
          "statement": "largest admissible request: prompt + max_tokens <= 257 tokens"}


def processor(config):
    from vllm.v1.engine.input_processor import InputProcessor

    return InputProcessor(config)


def submit(proc, rid: str, prompt_len: int, max_tokens: int | None):
    from vllm import SamplingParams

    return proc.process_inputs(rid, {"prompt_token_ids": list(range(3, 3 + prompt_len))},
                               SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                               supported_tasks=("generate",))


def entry(pid: int, limits) -> dict:
    """An EngineCore entry as it arrives through ``collective_rpc`` (JSON round trip)."""
    return json.loads(json.dumps({"pid": pid, "role": "EngineCore", "counts": {},
                                  "gauges": {}, "offers": {admission.KEY: limits}}))


class SyncEngine:
    """Stands in for ``LLMEngine``: answers ``collective_rpc("kvguard_snapshot")``."""

    def __init__(self, reply):
        self.reply, self.asked = reply, 0

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        assert method == remote.METHOD
        self.asked += 1
        return self.reply


def front_end(*engines) -> None:
    """This process as an API server: only the door patch, nothing published here."""
    activation.activate({"KVGUARD": "1", "KVGUARD_PATCHES": "admission"})
    admission.clear_published()
    for engine in engines:
        remote.attach(engine, is_async=False)


def test_the_scheduler_publishes_and_the_door_refuses_with_numbers():
    activation.activate({"KVGUARD": "1"})
    make_scheduler(num_gpu_blocks=17)                     # EngineCore's startup
    limits = admission.published()
    assert limits is not None and json.loads(json.dumps(limits)) == limits
    assert (limits["prompt_limit"], limits["total_limit"], limits["usable"]) == (256, 257, 16)
    proc = processor(make_vllm_config(num_gpu_blocks=17))
    assert submit(proc, "fits", 200, 57).request_id == "fits"
    assert submit(proc, "longest", 256, 1).request_id == "longest"
    with pytest.raises(ValueError) as err:
        submit(proc, "over", 200, 58)
    msg = str(err.value)
    assert "request over can never fit the KV cache" in msg
    assert "prompt 200 + max_tokens 58 = 258 tokens, and at most 257 can ever complete" in msg
    assert "max_tokens <= 57 would fit" in msg and "what binds it: " in msg
    assert "16 usable blocks" in msg and "gpu_memory_utilization" in msg
    assert getattr(err.value, "parameter", "max_tokens") == "max_tokens"
    with pytest.raises(ValueError) as err:
        submit(proc, "long", 300, 4)
    assert "the prompt alone cannot be admitted: at most 256 tokens here" in str(err.value)
    assert "this prompt has 300" in str(err.value)
    assert report.snapshot()["admission"] == {"refused": 2}


def test_unset_max_tokens_is_what_vllm_makes_it():
    """vLLM sets ``max_tokens`` to ``max_model_len - prompt`` (512 - 200 = 312)."""
    activation.activate({"KVGUARD": "1"})
    make_scheduler(num_gpu_blocks=17)
    with pytest.raises(ValueError, match="max_tokens 312 = 512 tokens.*max_tokens <= 57"):
        submit(processor(make_vllm_config(num_gpu_blocks=17)), "unset", 200, None)
    with pytest.raises(ValueError, match="max_tokens 312 = 512"):
        admission.check(LIMITS, "direct", 200, None)


def test_check_at_the_edges():
    admission.check(LIMITS, "r", 256, 1)                  # both limits exactly
    tight = {**LIMITS, "prompt_limit": 300}               # a prompt no token can follow
    with pytest.raises(admission.Refused, match="prompt alone cannot be admitted: at most "
                                                "256 tokens here, this prompt has 257"):
        admission.check(tight, "r", 257, 1)
    assert report.snapshot()["admission"] == {"refused": 1}


def test_a_prompt_over_the_start_limit_completes_only_one_token_past_the_prompt_limit():
    """Async scheduling: a prompt over the start limit is preempted as it starts decoding
    and re-admitted one token longer each time; the door lets through only the totals
    that complete that way (prompt limit + 1), and says which prompt would do better."""
    band = {**LIMITS, "prompt_limit": 48, "total_limit": 97, "start_limit": 40,
            "start_group": "first decode step after prefill chunk 0-41: group 1 (sliding "
                           "window 32) 3"}
    admission.check(band, "r", 40, 57)                    # under the start limit: T
    admission.check(band, "r", 41, 8)                     # total 49 = prompt limit + 1
    with pytest.raises(admission.Refused, match="a prompt over 40 tokens is preempted as it "
                                                "starts decoding.*41 \+ 9 = 50.*max_tokens "
                                                "<= 8 would fit"):
        admission.check(band, "r", 41, 9)
    assert admission.validated({**band, "start_limit": -1}) is None
    assert admission.validated({k: v for k, v in band.items() if k != "start_limit"}) is None


def test_without_the_patch_or_limits_vllm_decides():
    activation.activate({"KVGUARD": "1", "KVGUARD_ADMISSION": "off"})
    make_scheduler(num_gpu_blocks=17)
    proc = processor(make_vllm_config(num_gpu_blocks=17))
    assert submit(proc, "over", 200, 58).request_id == "over"     # vLLM accepts it
    activation.deactivate()
    front_end()                                                   # no engine answers
    assert admission.published() is None
    assert submit(processor(make_vllm_config(num_gpu_blocks=17)), "over", 200, 58)


def test_the_limits_cross_processes_as_json_through_collective_rpc():
    """EngineCore's reply to ``kvguard_snapshot`` carries its limits; the front end (here:
    this process with nothing published, ``LLMEngine`` asked once) refuses with them."""

    class Core:
        class model_executor:                              # noqa: N801  (no workers)
            @staticmethod
            def collective_rpc(method, timeout=None):
                return []

    activation.activate({"KVGUARD": "1"})
    make_scheduler(num_gpu_blocks=17)                      # EngineCore
    reply = json.loads(json.dumps(remote.engine_reply(Core())))   # msgpack-able, no code
    sent = reply[0]["offers"][admission.KEY]
    assert admission.validated(sent) == sent and sent["total_limit"] == 257
    activation.deactivate()
    reply[0]["pid"] = 999_999                              # another process
    engine = SyncEngine(reply)
    front_end(engine)
    proc = processor(make_vllm_config(num_gpu_blocks=17))
    with pytest.raises(ValueError, match="request over can never fit the KV cache"):
        submit(proc, "over", 200, 58)
    assert submit(proc, "fits", 200, 57).request_id == "fits"
    assert engine.asked == 1                               # asked once, then kept


@pytest.mark.parametrize("bad", [
    "not a dict", {**LIMITS, "prompt_limit": "256"}, {**LIMITS, "total_limit": True},
    {**LIMITS, "usable": -1}, {**LIMITS, "total_limit": 513}, {**LIMITS, "max_model_len": 0},
    {k: v for k, v in LIMITS.items() if k != "statement"}, {**LIMITS, "statement": None},
    {**LIMITS, "prompt_limit": 1.5}, {"__reduce__": "os.system"}])
def test_a_malformed_entry_is_ignored_with_one_info_line(bad, kvguard_log):
    good = {**LIMITS, "total_limit": 300}
    engine = SyncEngine([entry(101, bad), entry(102, good), entry(103, bad)])
    front_end(engine)                                      # (remote holds it weakly)
    assert admission.published() == good
    assert admission.published() == good
    said = [m for m in kvguard_log.lines(logging.INFO) if "malformed" in m]
    assert len(said) == 1 and "ignored" in said[0], said
    admission.clear_published()
    remote.reset()
    engine = SyncEngine([entry(104, bad)])
    front_end(engine)
    assert admission.published() is None                  # nothing valid: vLLM decides
    admission.door_check("r", 10_000, 10_000)


def test_with_data_parallelism_the_door_uses_the_tightest_engine():
    """Two engines (an ``AsyncLLM`` client's ``call_utility_all_async``: one reply each):
    the smaller prompt limit of one and the smaller total of the other, each with its
    binding group."""
    one = {**LIMITS, "prompt_limit": 200, "total_limit": 400, "usable": 30,
           "prompt_group": "group 1 (sliding window 32)", "total_group": "group 0 (full)"}
    two = {**LIMITS, "prompt_limit": 256, "total_limit": 257, "usable": 16,
           "prompt_group": "group 0 (full)", "total_group": "group 2 (mamba)"}

    class Client:
        def __init__(self):
            self.calls = []

        async def call_utility_all_async(self, method, *args):
            self.calls.append((method, args[0]))
            await asyncio.sleep(0.05)                      # the engines take a while
            return [[entry(201, one)], [entry(202, two), {"pid": 203, "role": "worker"}]]

    class AsyncEngine:
        errored = False

        def __init__(self):
            self.engine_core = Client()

    async def main():
        engine = AsyncEngine()
        front_end()
        remote.attach(engine, is_async=True)               # inside the loop, like AsyncLLM
        assert admission.published() is None               # no reply yet
        await remote.first_reply(engine)                   # what add_request awaits
        limits = admission.published()
        engine.errored = True
        return engine, limits

    engine, limits = asyncio.run(asyncio.wait_for(main(), 30))
    assert engine.engine_core.calls[0] == ("collective_rpc", remote.METHOD)
    assert (limits["prompt_limit"], limits["prompt_group"]) == (200, one["prompt_group"])
    assert (limits["total_limit"], limits["total_group"]) == (257, two["total_group"])
    assert limits["usable"] == 16
    with pytest.raises(admission.Refused, match="at most 200 tokens here.*what binds it: "
                                                "group 1 \\(sliding window 32\\)"):
        admission.check(limits, "r", 201, 1)
    with pytest.raises(admission.Refused, match="what binds it: group 2 \\(mamba\\)\\); "
                                                "max_tokens <= 57 would fit"):
        admission.check(limits, "r", 200, 58)


def test_the_first_request_after_start_waits_for_the_first_reply():
    """``AsyncLLM.add_request`` (the door patch's wrapper) before the engine's first reply
    has arrived: it waits for it, so even the first request is checked."""
    from vllm_kvguard.patches.admission import add_request

    class AsyncEngine:
        errored = False

        async def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
            await asyncio.sleep(0.05)
            return [entry(301, LIMITS)]

    async def original_add_request(request_id, prompt_len, max_tokens):
        admission.door_check(request_id, prompt_len, max_tokens)     # process_inputs
        return request_id

    async def main():
        engine = AsyncEngine()
        front_end()
        remote.attach(engine, is_async=True)
        first = add_request(original_add_request, engine, ("first", 200, 58), {})
        with pytest.raises(admission.Refused, match="max_tokens <= 57 would fit"):
            await first
        assert remote.first_reply_ended(engine)
        ok = await add_request(original_add_request, engine, ("second", 200, 57), {})
        engine.errored = True
        return ok

    assert asyncio.run(asyncio.wait_for(main(), 30)) == "second"
