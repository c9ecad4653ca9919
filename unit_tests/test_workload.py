"""The workload harness's CPU conv-weight padding (a vLLM CPU kernel reads past the weight)."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
cc = pytest.importorskip("vllm.model_executor.layers.mamba.ops.cpu.causal_conv1d")

from vllm_kvguard.tools.ab import workload  # noqa: E402


def test_kernel_gets_the_weight_followed_by_zeros(monkeypatch):
    seen = []

    def kernel(x, conv_state, weight, *args, **kwargs):
        seen.append(weight)
        return "out"

    monkeypatch.setattr(cc, "causal_conv1d_update_cpu_vec", kernel)
    assert workload.pad_cpu_conv_weights() is True
    assert workload.pad_cpu_conv_weights() is False          # idempotent
    weight = torch.arange(1.0, 13.0).reshape(3, 4)
    assert cc.causal_conv1d_update_cpu_vec("x", "state", weight, "b", act=None) == "out"
    padded = seen[-1]
    assert torch.equal(padded, weight) and padded.data_ptr() != weight.data_ptr()
    storage = torch.tensor([], dtype=padded.dtype).set_(padded.untyped_storage())
    assert storage.numel() >= weight.numel() + 8
    assert torch.all(storage[weight.numel():] == 0)          # what the kernel reads past
    cc.causal_conv1d_update_cpu_vec("x", "state", weight, "b")
    assert seen[-1] is padded                                # one copy per weight version
