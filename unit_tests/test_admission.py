"""Admission certificate and the door (fixes/admission.py, patches/admission.py) on REAL
vLLM objects: a scheduler publishes its certificate at construction, and vLLM's own
``InputProcessor`` refuses a request that can never fit before it reaches EngineCore.

Pool: 16 usable blocks of 16 tokens. 200 prompt tokens + 57 output tokens compute 256
tokens (the last sampled token is never computed) and fit; + 58 never fit.
"""
from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import vllm.v1.core.kv_cache_manager  # noqa: E402,F401  (loaded: patches apply at once)

from vllm_kvguard import activation, report  # noqa: E402
from vllm_kvguard.fixes.estimation import admission  # noqa: E402
from vllm_kvguard.testing.kv_fixtures import make_scheduler, make_vllm_config  # noqa: E402


def processor(config):
    from vllm.v1.engine.input_processor import InputProcessor

    return InputProcessor(config)


def submit(proc, rid: str, prompt_len: int, max_tokens: int):
    from vllm import SamplingParams

    return proc.process_inputs(rid, {"prompt_token_ids": list(range(3, 3 + prompt_len))},
                               SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                               supported_tasks=("generate",))


def test_the_scheduler_publishes_and_the_door_refuses_with_numbers():
    activation.activate({"KVGUARD": "1"})
    make_scheduler(num_gpu_blocks=17)                     # EngineCore's startup
    cert = admission.published()
    assert cert is not None and cert.largest == 256 and cert.usable == 16
    proc = processor(make_vllm_config(num_gpu_blocks=17))
    assert submit(proc, "fits", 200, 57).request_id == "fits"
    with pytest.raises(ValueError) as err:
        submit(proc, "over", 200, 58)
    msg = str(err.value)
    assert "request over can never fit the KV cache" in msg
    assert "at 257 tokens it holds at least 17 blocks (group 0: 17" in msg
    assert "16 usable blocks" in msg and "prompt + max_tokens <= 257 tokens" in msg
    assert "max_tokens <= 57 would fit" in msg
    with pytest.raises(ValueError, match="its prompt alone cannot fit"):
        submit(proc, "long", 300, 4)
    assert report.snapshot()["admission"] == {"refused": 2}


def test_without_the_patch_or_a_certificate_vllm_decides():
    activation.activate({"KVGUARD": "1", "KVGUARD_ADMISSION": "off"})
    make_scheduler(num_gpu_blocks=17)
    proc = processor(make_vllm_config(num_gpu_blocks=17))
    assert submit(proc, "over", 200, 58).request_id == "over"     # vLLM accepts it
    activation.deactivate()
    admission.clear_published()
    activation.activate({"KVGUARD": "1", "KVGUARD_PATCHES": "admission"})   # no startup
    assert admission.published() is None                          # report: nothing known
    assert submit(processor(make_vllm_config(num_gpu_blocks=17)), "over", 200, 58)


def test_the_certificate_crosses_processes_through_the_metrics_directory(tmp_path,
                                                                         monkeypatch):
    """The front end is another process: it reads the pickled certificate EngineCore
    wrote beside its metrics snapshot; a foreign or broken file is ignored."""
    from vllm_kvguard import metrics

    monkeypatch.setattr(metrics, "directory", lambda: str(tmp_path))
    activation.activate({"KVGUARD": "1"})
    make_scheduler(num_gpu_blocks=17)
    files = sorted(p.name for p in tmp_path.iterdir())
    assert len(files) == 1 and files[0].endswith(admission.SUFFIX)
    (tmp_path / f"999{admission.SUFFIX}").write_bytes(b"not a pickle")
    admission.clear_published()                           # as in the front-end process
    cert = admission.published()
    assert cert is not None and cert.largest == 256
    with pytest.raises(ValueError, match="can never fit"):
        admission.door_check("r", 200, 58)
    admission.door_check("r", 200, 57)


def test_a_front_end_that_builds_no_scheduler_refuses_at_its_door(tmp_path, monkeypatch):
    """``vllm serve``'s API server: only the ``admission`` patch wraps there (no scheduler,
    no startup report); the certificate comes from EngineCore's file, and vLLM's own
    ``InputProcessor`` refuses the request."""
    from vllm_kvguard import metrics

    monkeypatch.setattr(metrics, "directory", lambda: str(tmp_path))
    activation.activate({"KVGUARD": "1", "KVGUARD_PATCHES": "none"})
    admission.publish(admission.of_scheduler(make_scheduler(num_gpu_blocks=17)))  # EngineCore
    activation.deactivate()
    admission.clear_published()
    activation.activate({"KVGUARD": "1", "KVGUARD_PATCHES": "admission"})
    proc = processor(make_vllm_config(num_gpu_blocks=17))
    with pytest.raises(ValueError, match="request over can never fit the KV cache"):
        submit(proc, "over", 200, 58)
    assert submit(proc, "fits", 200, 57).request_id == "fits"


@pytest.mark.parametrize("blocks, block_size", [(9, 16), (17, 16), (30, 16), (5, 32),
                                               (12, 32)])
def test_the_certificate_equals_the_allocator_on_an_empty_pool(blocks, block_size):
    """At and one over the certificate, a request's whole computed sequence on an empty
    pool: the real KVCacheManager allocates the first and refuses the second."""
    from vllm_kvguard.testing.kv_fixtures import make_request

    activation.activate({"KVGUARD": "1", "KVGUARD_PATCHES": "none"})
    largest = None
    for n in (None, 1):
        sched = make_scheduler(num_gpu_blocks=blocks, block_size=block_size)
        cert = admission.of_scheduler(sched)
        largest = cert.largest if largest is None else largest
        tokens = largest + (n or 0)
        req = make_request(f"r{tokens}", list(range(3, 3 + tokens)), max_tokens=1)
        got = sched.kv_cache_manager.allocate_slots(req, tokens)
        assert (got is not None) == (n is None), (blocks, block_size, tokens)
    assert largest == (blocks - 1) * block_size


def test_a_pool_that_holds_max_model_len_certifies_it():
    activation.activate({"KVGUARD": "1", "KVGUARD_PATCHES": "none"})
    cert = admission.of_scheduler(make_scheduler(num_gpu_blocks=64))
    assert cert.largest == cert.max_model_len == 512
    assert "prompt + max_tokens <= 512 tokens" in cert.statement()
