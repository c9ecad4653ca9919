"""The conformance runner (scripts/conformance.py, conformance_runner.py): its comparison,
its proofs, and that it fails when a patch changes a vLLM outcome (a deliberately broken
patch, on a few of vLLM's own tests from the cached sdist)."""
from __future__ import annotations

import importlib.util
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


conformance = _load(REPO / "scripts" / "conformance.py", "kvguard_scripts_conformance")
runner = conformance.runner                       # scripts/conformance_runner.py


# ------------------------------------------------------------------------ comparison
def test_newly_failing_is_passed_plain_and_not_patched():
    plain = {"a": "passed", "b": "passed", "c": "failed", "d": "passed", "e": "skipped"}
    patched = {"a": "passed", "b": "failed", "c": "passed", "e": "failed"}
    assert runner.newly_failing(plain, patched) == ["b", "d"]      # d went missing


def test_proof_names_what_is_missing():
    good = {"activation": {"allocator": "applied"}, "wrapped": [runner.ALLOCATE_SLOTS],
            "txn_calls": 12, "tripped": [], "counters": {"audit": {"steps": 3}}}
    assert runner.proof("patched", good) == []
    assert runner.proof("audit", good) == []
    bad = {**good, "wrapped": [], "txn_calls": 0, "tripped": ["allocator"],
           "counters": {"internal_error": {"rollback": 1}}}
    missing = runner.proof("audit", bad)
    assert any("no vllm-kvguard wrapper" in m for m in missing)
    assert any("through the transaction" in m for m in missing)
    assert any("tripped: allocator" in m for m in missing)
    assert any("internal_error" in m for m in missing)
    assert any("audit never ran" in m for m in missing)
    assert runner.proof("plain", {"wrapped": ["x"]}) == ["plain pass has vllm-kvguard "
                                                         "wrappers: ['x']"]
    assert "no session statistics" in runner.proof("patched", None)[0]


def test_summary_line_and_truth_table_cell():
    from vllm_kvguard.tools.truth_table import conformance_cell

    rec = {"ok": False, "problems": ["patched: 1 newly failing"], "passes": {
        "plain": {"passed": 5},
        "patched": {"passed": 4, "newly_failing": ["t::x"], "txn_calls": 9,
                    "tests_with_txn": 3},
    }}
    lines = runner.summary(rec)
    assert lines[0].startswith("5 passed plain; patched: 4 passed, 1 newly failing (t::x)")
    assert conformance_cell(rec) == "FAILED (1 newly failing; 5 plain; 4 patched)"
    assert conformance_cell(None) == "not run"
    ok = {"ok": True, "problems": [], "passes": {"plain": {"passed": 5},
                                                 "patched": {"passed": 5}}}
    assert conformance_cell(ok) == "passed (5 plain; 5 patched)"


def test_every_pass_loads_the_platform_choice_first():
    """The test-only CPU platform is loaded in every pass alike, before the runner's own
    plugin and any patched-only one; both are scripts, never part of the plugin."""
    argv = runner.build_pytest_argv("py", Path("j.xml"), [], [], ["extra_plugin"])
    plugins = [argv[i + 1] for i, a in enumerate(argv) if a == "-p"]
    assert plugins[:3] == [runner.PLATFORM_PLUGIN, runner.PLUGIN_NAME, "extra_plugin"]
    for name in (runner.PLATFORM_PLUGIN, runner.PLUGIN_NAME):
        assert (REPO / "scripts" / f"{name}.py").is_file()
        assert not list((REPO / "plugin").rglob(f"{name}.py"))


# --------------------------------------------------------- a broken patch is caught
#: A few of vLLM's own tests: three allocate through KVCacheManager.allocate_slots, two
#: do not (they must stay passing with the broken patch). The last builds a Scheduler
#: from a VllmConfig: on a CUDA wheel's pure-Python pin it passes only with the test-only
#: CPU platform choice (conformance_platform.py).
SELECTED = [
    "tests/v1/core/test_prefix_caching.py::test_prefill[sha256]",
    "tests/v1/core/test_prefix_caching.py::test_decode",
    "tests/v1/core/test_prefix_caching.py::test_evict",
    "tests/v1/core/test_kv_cache_utils.py::test_free_kv_cache_block_queue_initialization",
    "tests/v1/core/test_scheduler.py::test_add_requests",
]
BROKEN = '''
"""A deliberately broken patch: every allocate_slots through the transaction says None."""
from vllm_kvguard.fixes.transaction import rollback


def _transaction(self, manager, fn):
    return lambda request, *args, **kwargs: None


rollback.Rollback.transaction = _transaction
'''


def _cached():
    """(python, sdist, deps, pycache) of this venv, as the runner lays them out beside it."""
    pytest.importorskip("vllm")
    from vllm_kvguard.versions import vllm_version

    version = str(vllm_version())
    root = Path(sys.prefix).parent                    # the venv root holding this venv
    sdist = root / "sdists" / f"vllm-{version}.tar.gz"
    if not sdist.is_file():
        pytest.skip(f"vLLM {version}'s sdist is not cached at {sdist} (python3 "
                    f"scripts/conformance.py --pin {version} --fetch-only caches it)")
    deps = root / "conformance-deps" / Path(sys.prefix).name
    if not (deps / ".kvguard-ready").is_file():
        pytest.skip(f"the conformance test dependencies are not installed at {deps}")
    return sys.executable, sdist, deps, root / "conformance-pycache" / Path(sys.prefix).name


@pytest.mark.timeout(1200)
def test_a_broken_patch_makes_vllm_tests_newly_failing(tmp_path):
    python, sdist, deps, pycache = _cached()
    broken = tmp_path / "kvguard_broken_patch.py"
    broken.write_text(textwrap.dedent(BROKEN))
    rec = runner.conformance(python, sdist, deps, tmp_path / "results",
                             selection=SELECTED, passes=("plain", "patched"),
                             patched_plugins=[str(broken)], pycache=pycache)
    plain, patched = rec["passes"]["plain"], rec["passes"]["patched"]
    assert plain["passed"] == len(SELECTED), rec
    newly = patched["newly_failing"]
    assert set(newly) == set(SELECTED[:3]), rec        # confirmed on the re-run
    assert not set(SELECTED[3:]) & set(newly)
    assert plain["platform"]["platform"] == patched["platform"]["platform"] == "CpuPlatform"
    assert not rec["ok"]
    assert "patched: 3 newly failing" in rec["problems"]
    assert patched["txn_calls"] > 0 and patched["proof_missing"] == []
    line = runner.summary(rec)[0]
    assert line.startswith(f"{len(SELECTED)} passed plain; patched: 2 passed, 3 newly failing (")
