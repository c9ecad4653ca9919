"""Refusal at the door on the real serving path: ``vllm serve`` (multiprocess: API server,
EngineCore, worker) driven by the ``openai`` client over loopback.

The hand-off (every pin with a CPU engine): EngineCore's admission limits reach the API
server as JSON numbers in the counters' ``collective_rpc`` reply, before the first request
is checked; no file or directory is written.

The refusal (0.27.x only): ``--num-gpu-blocks-override 16`` blocks of 32 tokens with
``max_model_len`` 512. vLLM 0.27.1's startup check counts all 16 blocks (512 tokens: one
``max_model_len`` request fits), but block 0 is the null block, so a request holds at most
15 (480 tokens). vLLM >= 0.29 subtracts the null block in that check and refuses the engine
at startup, so a full-attention pool leaves nothing for the door to catch there (a
hybrid pool does: the engine-level tests of the certificate). A request of 40 prompt
tokens + ``max_tokens`` 460 (500 <= ``max_model_len``) can never fit. With the plugin the
API server answers HTTP 400 at once, counts it on ``/metrics`` and keeps serving; without
it vLLM admits the request, which never finishes (recorded: still unanswered when the
client's timeout ends the wait).
"""
from __future__ import annotations

import pytest

from vllm_kvguard.testing.serve_fixtures import complete_once
from vllm_kvguard.tools.serve import Server, complete_all
from vllm_kvguard.tools.tiny_models import write_model
from vllm_kvguard.tools.ab.workload import make_prompts
from vllm_kvguard.versions import vllm_version

pytestmark = [pytest.mark.multiproc, pytest.mark.smoke]

ARGS = ("--load-format", "dummy", "--skip-tokenizer-init", "--enforce-eager",
        "--dtype", "bfloat16", "--max-model-len", "512", "--max-num-seqs", "4",
        "--seed", "0", "--block-size", "32", "--num-gpu-blocks-override", "16")
OVER = dict(prompt=list(range(3, 43)), max_tokens=460)
WAIT_S = 20          # how long the plugin-off side's over-capacity request is waited for


def _gap_pin() -> bool:
    """Whether vLLM's own startup check admits a pool one null block short (0.27.x)."""
    from packaging.version import Version

    version = vllm_version()
    return version is not None and version < Version("0.29")


def _over(server, timeout: float):
    """Send the over-capacity request: (what the client saw, its text, seconds)."""
    return complete_once(server, timeout, **OVER)


def _others(server):
    prompts = make_prompts({"num_requests": 8, "seed": 0, "prompt_len": 40,
                            "repetitive": True})
    return complete_all(server.base_url, server.model_id(), prompts, 16, concurrency=4,
                        request_timeout=90, deadline_s=240)


@pytest.mark.timeout(900)
def test_an_over_capacity_request_gets_http_400_at_once_and_serving_goes_on(tmp_path):
    if not _gap_pin():
        pytest.skip(f"vLLM {vllm_version()} refuses this pool at startup (its check "
                    "reserves the null block since 0.29): no never-fitting request reaches "
                    "the door")
    model = write_model("llama", tmp_path / "llama")
    with Server(model, list(ARGS), {"KVGUARD": "1"}, name="admission-on",
                log_dir=str(tmp_path)) as on:
        on.wait_ready(600)
        seen, text, secs = _over(on, timeout=30)
        print(f"\n[admission] plugin on: {seen} in {secs:.2f} s: {text[:400]}")
        assert seen == "http 400", (seen, text, on.tail())
        assert secs < 1.0, secs
        assert "can never fit the KV cache" in text, text
        assert "15 usable blocks" in text and "prompt + max_tokens <= 481 tokens" in text, text
        assert "max_tokens <= 441 would fit" in text, text
        batch = _others(on)
        assert batch.all_ok, batch.summary()
        assert on.kvguard_counters().get("admission") == {"refused": 1}, on.metrics_text()
    with Server(model, list(ARGS), {}, name="admission-off", log_dir=str(tmp_path)) as off:
        off.wait_ready(600)
        seen, text, secs = _over(off, timeout=WAIT_S)
        print(f"[admission] plugin off: {seen} after {secs:.1f} s (vLLM admits the request "
              f"and it never finishes)")
        assert seen == "timeout", (seen, text)


@pytest.mark.timeout(600)
def test_the_limits_reach_the_api_server_before_its_first_request(tmp_path):
    """A pool vLLM starts on every pin (17 blocks of 32: 16 usable, one max_model_len
    request): the first request after start is checked against EngineCore's limits,
    which the API server logs once, and nothing is written under the temp dir."""
    import os
    import re

    model = write_model("llama", tmp_path / "llama")
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    args = [*ARGS[:-1], "17"]                          # --num-gpu-blocks-override 17
    with Server(model, args, {"KVGUARD": "1", "TMPDIR": str(tmp)}, name="handoff",
                log_dir=str(tmp_path)) as on:
        on.wait_ready(600)
        batch = _others(on)
        assert batch.all_ok, batch.summary()
        said = re.findall(r"the door has (\d+) engine\(s\)' admission limits: prompt <= "
                          r"(\d+), prompt \+ max_tokens <= (\d+) tokens", on.log())
        print(f"\n[admission] hand-off: {said}")
        assert len(said) == 1 and said[0][0] == "1" and said[0][2] == "512", on.tail()
        assert "malformed" not in on.log()
    assert not [p for p in os.listdir(tmp) if p.startswith("kvguard-")], os.listdir(tmp)
