#!/usr/bin/env python3
"""The main job: the A/B benchmark on the default pinned vLLM, on a fresh machine.

    python3 scripts/ab.py [kvguard-ab arguments]     # about 10 minutes on 2 idle cores
    python3 scripts/ab.py --scenario alloc-faults --no-microbench    # the short form

Builds (or reuses) the default pin's cached venv (``scripts/venvs.py``), adds the
``chart`` extra (matplotlib, for the PNG) when it is missing, then runs
``python -m vllm_kvguard.tools.ab`` there with the given arguments. Standard library only.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import venvs  # noqa: E402


#: pyproject.toml's ``chart`` extra (a unit test keeps the two equal).
CHART = "matplotlib>=3.6"


def ensure_chart(python: Path) -> None:
    """Install the chart extra into the venv once; without it kvguard-ab says so and
    writes no PNG, so a failed install only costs the chart."""
    if subprocess.run([str(python), "-c", "import matplotlib"],
                      capture_output=True).returncode == 0:
        return
    print(f"[kvguard] installing {CHART} for the chart", file=sys.stderr, flush=True)
    done = subprocess.run([str(python), "-m", "pip", "install", "--quiet", CHART])
    if done.returncode:
        print("[kvguard] matplotlib could not be installed: no PNG chart this run",
              file=sys.stderr, flush=True)


def serves_this_checkout(pin) -> bool:
    """Whether the pin's venv is built and its editable install is this checkout."""
    marker = venvs.venv_dir(pin) / venvs.REPO_MARKER
    try:
        return venvs.is_ready(pin) and json.loads(marker.read_text())["repo"] == str(venvs.REPO)
    except (OSError, ValueError, KeyError):
        return False


def main(argv: list[str]) -> int:
    pin = next(p for p in venvs.read_pins() if p.default)
    if {"-h", "--help"} & set(argv) and not serves_this_checkout(pin):
        # help never builds a venv, nor points a shared one at this checkout
        print(__doc__)
        print("kvguard-ab's own options: run `python3 scripts/ab.py --help` once the "
              f"vLLM {pin.name} venv serves this checkout (any run without --help builds it).")
        return 0
    print(f"[kvguard] preparing the vLLM {pin.name} environment (first run: a few minutes)",
          file=sys.stderr, flush=True)
    venvs.ensure(pin)
    python = venvs.venv_dir(pin) / "bin" / "python"
    ensure_chart(python)
    os.execv(str(python), [str(python), "-m", "vllm_kvguard.tools.ab", *argv])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
