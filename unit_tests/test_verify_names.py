"""The drift guard outside the proven range checks the names of modules a process has
loaded at activation, and each other module's names when vLLM imports it: activation
imports nothing a process would not load itself, and a name missing at import turns its
patch off there, with the name, before anything of that module is used."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

vllm = pytest.importorskip("vllm")

from packaging.version import Version  # noqa: E402

from vllm_kvguard import verify  # noqa: E402
from vllm_kvguard.patches import BY_NAME  # noqa: E402
from vllm_kvguard.registry import Patch, Private  # noqa: E402
from vllm_kvguard.versions import vllm_version  # noqa: E402

def test_a_name_missing_in_a_module_imported_later_turns_its_patch_off_then(
        tmp_path, monkeypatch):
    module = "kvguard_later_mod"
    (tmp_path / f"{module}.py").write_text("class C:\n    present = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, module, raising=False)
    patch = Patch("lazy", "test", [], ">=0", (), "never",
                  uses=(Private(module, "C", ("present", "gone")),))
    version = vllm_version()
    assert verify._names(patch, version) == ""          # not loaded: nothing checked yet
    assert module not in sys.modules
    patch.apply()
    heard = []
    monkeypatch.setattr(verify, "_listeners", [lambda *a: heard.append(a)])
    __import__(module)
    assert not patch.applied
    reason = f"not in this vLLM: {module}.C.gone"
    assert heard == [("lazy", reason)]
    assert verify.failed("lazy") == reason              # shared with later processes


def test_a_loaded_module_is_checked_at_once_and_a_full_pass_is_shared(monkeypatch):
    import vllm.v1.core.kv_cache_manager  # noqa: F401

    patch = Patch("eager", "test", [], ">=0", (), "never",
                  uses=(Private("vllm.v1.core.kv_cache_manager", "KVCacheManager",
                                ("coordinator",)),))
    monkeypatch.setattr(verify, "_check_at_import",
                        lambda *a: pytest.fail("every module is loaded"))
    assert verify._names(patch, vllm_version()) == ""
    assert verify._cached(vllm_version())["eager" + verify.NAMES] == "ok"


def _outside(*names: str) -> str | None:
    for version in ("0.35.0", "0.27.0"):
        if not any(verify.preflight(BY_NAME[n], Version(version)) for n in names):
            return version
    return None


@pytest.mark.timeout(300)
def test_activation_outside_the_range_imports_no_model_runner_and_checks_it_at_import():
    """On the real vLLM, in a fresh process as the front end is: the warmup patch's
    model-runner names (a few hundred modules, about 2 s) are checked when the worker
    imports them, and the patch stays on."""
    version = _outside("warmup")
    if version is None:
        pytest.skip(f"vLLM {vllm_version()} passes for no release outside the range")
    script = textwrap.dedent(f"""
        import importlib, importlib.util, json, sys
        import vllm
        vllm.__version__ = {version!r}
        from vllm_kvguard import activation
        from vllm_kvguard.patches import BY_NAME
        workers = sorted(m for m in BY_NAME["warmup"].modules()
                         if ".worker." in m and importlib.util.find_spec(m))
        res = activation.activate({{"KVGUARD": "1", "KVGUARD_PATCHES": "warmup"}})
        loaded = [m for m in workers if m in sys.modules]
        for m in workers:
            importlib.import_module(m)
        print(json.dumps({{"result": res["warmup"], "workers": workers, "loaded": loaded,
                          "applied": BY_NAME["warmup"].applied}}))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=280, env={**__import__("os").environ,
                                           "VLLM_HOST_IP": "127.0.0.1"})
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["result"].startswith("applied (verified)"), got
    assert got["workers"] and got["loaded"] == [], got
    assert got["applied"] is True, got
