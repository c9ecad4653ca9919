"""``kvguard demo`` end to end on real engines, run as a user runs it: it exits 0 and says
what it showed; with the fixes turned off on its 'with' side (the internal ``--fixes-off``)
it must exit 1 and name what was not shown, so a demo that passes proves the fixes work."""
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.engine]


def _demo(tmp_path, *args):
    env = {**os.environ, "VLLM_CACHE_ROOT": str(tmp_path / "vllm-cache")}
    return subprocess.run([sys.executable, "-m", "vllm_kvguard.tools.cli", "demo", *args],
                          capture_output=True, text=True, env=env, timeout=840)


@pytest.mark.timeout(900)
def test_the_demo_shows_both_failures_prevented_and_exits_0(tmp_path):
    proc = _demo(tmp_path)
    out = " ".join(proc.stdout.split())              # the items are wrapped at 100 columns
    assert proc.returncode == 0, out + proc.stderr[-3000:]
    assert "NOT SHOWN" not in out and "demo: PASS" in out
    assert "faults, vLLM alone: the engine DIED at the first injected fault" in out
    assert "8/8 token-identical to the reference" in out
    assert "0 blocks left held" in out
    assert "refused at once: vllm-kvguard: request over can never fit the KV cache" in out


@pytest.mark.timeout(900)
def test_with_the_fixes_off_the_demo_fails(tmp_path):
    proc = _demo(tmp_path, "--fixes-off")
    out = " ".join(proc.stdout.split())
    assert proc.returncode == 1, out + proc.stderr[-3000:]
    assert "demo: FAIL" in out
    assert "[NOT SHOWN] faults, with vllm-kvguard" in out
    assert "[NOT SHOWN] never-fitting request, with vllm-kvguard: accepted" in out
