"""``kvguard doctor`` and ``kvguard table`` on the installed vLLM, outside this repository."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from vllm_kvguard.tools import truth_table


def _run(*args, cwd, env_extra=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVGUARD")}
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-m", "vllm_kvguard.tools.cli", *args], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module")
def doctor(tmp_path_factory):
    pytest.importorskip("vllm")
    out = _run("doctor", "--json", cwd=tmp_path_factory.mktemp("elsewhere"))
    return out, json.loads(out.stdout)


def test_doctor_passes_on_this_pin(doctor):
    out, data = doctor
    assert out.returncode == 0 and data["ok"], out.stdout + out.stderr[-2000:]
    rows = {r["patch"]: r for r in data["rows"]}
    assert {"allocator", "warmup", "admission", "containment", "distributed"} <= set(rows)
    for r in rows.values():
        assert r["verdict"].startswith(("applies", "skipped: no target")), r
        if r["patch"] in ("allocator", "admission", "warmup", "containment"):
            assert r["self_test"] == "passed", r


def test_doctor_table_and_summary(tmp_path):
    pytest.importorskip("vllm")
    out = _run("doctor", cwd=tmp_path, env_extra={"KVGUARD_PATCHES": "allocator"})
    assert out.returncode == 0, out.stdout + out.stderr[-2000:]
    assert "declared range" in out.stdout and "verdict" in out.stdout
    assert "off (KVGUARD_PATCHES)" in out.stdout
    assert "[ok] 2 of 2 chosen patches would apply" in out.stdout


def test_doctor_exits_1_when_a_chosen_patch_would_not_apply(monkeypatch, capsys):
    pytest.importorskip("vllm")
    from vllm_kvguard import verify
    from vllm_kvguard.tools import doctor as doc

    def fails():
        raise verify.SelfTestFailed("state not restored")

    monkeypatch.setitem(verify.CHECKS, "allocator", fails)
    monkeypatch.setenv("KVGUARD_PATCHES", "allocator")
    assert doc.main([]) == 1
    text = capsys.readouterr().out
    assert "FAILED: state not restored" in text and "[x] allocator" in text


def test_table_help_calls_itself_kvguard_table(tmp_path):
    out = _run("table", "--help", cwd=tmp_path)
    assert out.returncode == 0 and out.stdout.startswith("usage: kvguard table")


def test_table_prints_the_shipped_table_anywhere(tmp_path):
    out = _run("table", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "Proven releases (shipped" in out.stdout and "| allocator" in out.stdout


def test_write_proven_round_trips_a_results_folder(tmp_path):
    pin = tmp_path / "results" / "0.32.0"
    pin.mkdir(parents=True)
    (pin / "probe.json").write_text(json.dumps(
        {"pin": "0.32.0", "vllm": "0.32.0", "results": {"allocator": "applied"},
         "missing": {}}))
    (pin / "facts.jsonl").write_text(json.dumps(
        {"pin": "0.32.0", "patch": "warmup", "key": "defect:vllm#51438", "value": False,
         "detail": "x", "test": "unit_tests/test_a.py::test_b"}) + "\n")
    out = tmp_path / "proven.json"
    truth_table.write_proven(tmp_path / "results", out)
    data = truth_table.load_proven(out)
    assert data["pins"] == ["0.32.0"] and data["written"]
    text = truth_table.render(data)
    assert "| allocator" in text and "applied" in text and "fixed" in text
