#!/usr/bin/env python3
"""The main job: the A/B demo on the default pinned vLLM, on a fresh machine.

    python3 scripts/ab.py [kvguard-ab arguments]

Builds (or reuses) the default pin's cached venv (``scripts/venvs.py``), then runs
``python -m vllm_kvguard.tools.ab`` there with the given arguments. Standard library only.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import venvs  # noqa: E402


def main(argv: list[str]) -> int:
    pin = next(p for p in venvs.read_pins() if p.default)
    print(f"[kvguard] preparing the vLLM {pin.name} environment (first run: a few minutes)",
          file=sys.stderr, flush=True)
    venvs.ensure(pin)
    python = venvs.venv_dir(pin) / "bin" / "python"
    os.execv(str(python), [str(python), "-m", "vllm_kvguard.tools.ab", *argv])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
