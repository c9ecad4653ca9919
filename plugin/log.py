"""One logger for the whole plugin, and once-per-key logging.

The logger is ``vllm.kvguard``: a child of vLLM's own ``vllm`` logger, so inside a
vLLM process our lines get vLLM's handler and format without importing vLLM.
"""
from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading


class _UntilVllmConfigures(logging.Handler):
    """Print our lines while vLLM's own ``vllm`` logger has no handler yet.

    vLLM loads plugins (EngineArgs.__post_init__) before it configures logging, so the
    startup report would otherwise be dropped in the front-end process.
    """

    def emit(self, record: logging.LogRecord) -> None:
        if logging.getLogger("vllm").handlers:
            return
        try:
            sys.stderr.write(self.format(record) + "\n")
        except Exception:
            pass


logger = logging.getLogger("vllm.kvguard")
if not any(isinstance(h, _UntilVllmConfigures) for h in logger.handlers):
    _handler = _UntilVllmConfigures()
    _handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [kvguard] %(message)s",
                                            "%m-%d %H:%M:%S"))
    logger.addHandler(_handler)
    try:
        logger.setLevel(os.environ.get("VLLM_LOGGING_LEVEL", "INFO").upper())
    except ValueError:
        logger.setLevel(logging.INFO)

_seen: set[tuple] = set()
_lock = threading.Lock()


def once(level: int, key: tuple, msg: str, *args) -> bool:
    """Log ``msg`` the first time ``key`` is seen in this process; return whether it logged."""
    with _lock:
        if key in _seen:
            return False
        _seen.add(key)
    logger.log(level, msg, *args)
    return True


def reset_once() -> None:
    """Forget the keys seen so far (tests)."""
    with _lock:
        _seen.clear()


def _drop(_record) -> bool:
    return False


@contextlib.contextmanager
def quiet():
    """Silence our lines and vLLM's (and keep :func:`once` keys unspent) while a
    self-test runs on private objects: nothing it logs is about the user's engine."""
    vllm = logging.getLogger("vllm")
    with _lock:
        seen = set(_seen)
    level = vllm.level
    logger.addFilter(_drop)
    vllm.setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        vllm.setLevel(level)
        logger.removeFilter(_drop)
        with _lock:
            _seen.intersection_update(seen)
