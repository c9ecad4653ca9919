"""Shared fixtures: a clean plugin state per test and a capture of our log lines."""
from __future__ import annotations

import logging
import os

import pytest

from vllm_kvguard import activation, hostcall, log, report


class _Capture(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)

    def lines(self, level: int = logging.DEBUG) -> list[str]:
        return [r.getMessage() for r in self.records if r.levelno >= level]


@pytest.fixture(autouse=True)
def clean_plugin_state():
    activation.deactivate()
    log.reset_once()
    hostcall.reset_tripped()
    report.reset_counters()
    yield
    activation.deactivate()
    log.reset_once()
    hostcall.reset_tripped()
    report.reset_counters()


@pytest.fixture
def kvguard_log():
    """Every record our ``vllm.kvguard`` logger emits during the test."""
    handler = _Capture()
    logger = logging.getLogger("vllm.kvguard")
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(old_level)


#: Test modules that exercise one patch's fixes; they are skipped, with the reason, where
#: that patch does not support the installed vLLM (its declared range), unless
#: :data:`ENV_PROBE` is ``1`` (set by ``scripts/probe.py`` only: its point is to see what
#: breaks on a release outside the range, so there they run, with ``KVGUARD_FORCE=1``).
PATCH_OF_MODULE = {"test_rollback": "allocator", "test_rollback_property": "allocator",
                   "test_rollback_trigger": "allocator", "test_audit": "allocator",
                   "test_liveness": "allocator",
                   # simulates the allocator's target vanishing from an in-range vLLM
                   "test_drift::test_removed_target_patch_is_skipped_with_a_log_line":
                       "allocator"}
ENV_PROBE = "KVGUARD_PROBE"


def pytest_configure(config):
    config.addinivalue_line("markers", "requires_patch(name): skip where that patch does not "
                                       "support the installed vLLM")


def pytest_collection_modifyitems(config, items):
    if os.environ.get(ENV_PROBE) == "1":
        return
    from vllm_kvguard.patches import BY_NAME
    from vllm_kvguard.versions import vllm_version

    version = vllm_version()
    for item in items:
        marker = item.get_closest_marker("requires_patch")
        module = getattr(item.module, "__name__", "").rsplit(".", 1)[-1]
        name = (marker.args[0] if marker else
                PATCH_OF_MODULE.get(f"{module}::{item.originalname}", PATCH_OF_MODULE.get(module)))
        if name and not BY_NAME[name].supports(version):
            item.add_marker(pytest.mark.skip(
                reason=f"patch {name!r} does not support vLLM {version} "
                       f"(declared range {BY_NAME[name].vllm_versions})"))
