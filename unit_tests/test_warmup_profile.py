"""MRV1 profiling with k drafts (vllm#37521): ``GPUModelRunner._dummy_sampler_run`` profiles
the rejection sampler with one draft per request whatever k is. The REAL method runs on a
runner stand-in (CPUModelRunner subclasses this class; instantiating it needs a model), with
stub sampler / rejection sampler recording the shapes they are called with."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")
gmr = pytest.importorskip("vllm.v1.worker.gpu_model_runner")

from vllm_kvguard import activation, report  # noqa: E402
from vllm_kvguard.tools.truth_table import record_defect  # noqa: E402

VOCAB = 64


class RecordingRejectionSampler:
    def __init__(self):
        self.calls = []

    def __call__(self, metadata, draft_probs, logits, sampling_metadata, *a, **kw):
        self.calls.append(dict(drafts=list(metadata.num_draft_tokens),
                               probs_rows=None if draft_probs is None else draft_probs.shape[0],
                               logits_rows=logits.shape[0]))


class StubSampler:
    logprobs_mode = "raw_logprobs"

    def __call__(self, logits, sampling_metadata):
        return SimpleNamespace(sampled_token_ids=torch.zeros(logits.shape[0], 1))


def make_runner(k: int):
    """A real GPUModelRunner instance (no __init__: that needs a model and a device) with
    only what ``_dummy_sampler_run`` reads."""
    spec = SimpleNamespace(num_speculative_tokens=k, rejection_sample_method="standard",
                           draft_sample_method="probabilistic", method="ngram")
    runner = object.__new__(gmr.GPUModelRunner)
    vars(runner).update(
        vllm_config=SimpleNamespace(model_config=SimpleNamespace(multimodal_config=None)),
        model=SimpleNamespace(compute_logits=lambda h: torch.zeros(h.shape[0], VOCAB)),
        device=torch.device("cpu"), sampler=StubSampler(), speculative_config=spec,
        rejection_sampler=RecordingRejectionSampler())
    return runner


def run(runner, num_reqs: int = 5):
    runner._dummy_sampler_run(torch.zeros(num_reqs, 8))


@pytest.fixture(autouse=True)
def no_device_sync(mocker):
    mocker.patch("torch.accelerator.synchronize")


def test_vllm_profiles_one_draft_whatever_k():
    runner = make_runner(k=3)
    run(runner)
    calls = runner.rejection_sampler.calls
    record_defect("warmup", "vllm#37521", present=all(c["drafts"] == [1] * 5 for c in calls),
                  detail=f"k=3: rejection sampler profiled with {calls[0]['drafts'][0]} draft(s)")
    assert calls
    assert all(c["drafts"] == [1] * 5 for c in calls)


def test_patched_profiles_k_drafts():
    assert activation.activate({"KVGUARD": "1", "KVGUARD_PATCHES": "warmup"})["warmup"] \
        .startswith("applied")
    runner = make_runner(k=3)
    recorder = runner.rejection_sampler
    run(runner)
    assert recorder.calls
    for c in recorder.calls:
        assert c["drafts"] == [3] * 5
        assert c["logits_rows"] == 5 * (3 + 1)
        assert c["probs_rows"] in (None, 5 * 3)
    assert runner.rejection_sampler is recorder          # restored after the call
    assert report.snapshot()["profile"] == {"k_drafts": 1}


def test_k_of_one_is_left_alone():
    activation.activate({"KVGUARD": "1", "KVGUARD_PATCHES": "warmup"})
    runner = make_runner(k=1)
    run(runner)
    assert all(c["drafts"] == [1] * 5 for c in runner.rejection_sampler.calls)
    assert "profile" not in report.snapshot()
