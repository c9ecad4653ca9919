"""Shared fixtures: a clean plugin state per test and a capture of our log lines."""
from __future__ import annotations

import logging

import pytest

from vllm_kvguard import activation, log, registry, report


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
    registry.reset_tripped()
    report.reset_counters()
    yield
    activation.deactivate()
    log.reset_once()
    registry.reset_tripped()
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
