"""Start workload children (:mod:`vllm_kvguard.tools.ab.workload`) from the parent and collect
their results, with a timeout on every wait.

Each child is a fresh interpreter in its own process group, with every ``KVGUARD*``
variable of this environment removed and the caller's added: only the caller decides
whether the plugin is on there. :func:`run_in_subprocess` runs one workload to its end,
:func:`run_together` several children at once;
:class:`WorkloadProcess` drives a ``--serve`` child command by command (the A/B tool's
interleaved rounds). A child that does not answer in time is killed with its group and
reported ``hung``; one that exits without a result is reported ``engine_died``.
"""
from __future__ import annotations

import collections
import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from vllm_kvguard.tools.ab.workload import IMPORTED_TAG, READY_TAG, RESULT_TAG, ROUND_TAG

EXIT_GRACE_S = 2.0      # a --serve child that sent its result and has not exited is killed


def child_env(spec: dict, env: dict[str, str] | None = None) -> dict[str, str]:
    """This environment minus every KVGUARD* variable, plus ``env``: only the caller decides
    whether the plugin is on in the child."""
    full_env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    for key in [k for k in full_env if k.startswith("KVGUARD")]:
        del full_env[key]
    full_env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if spec.get("multiprocess") else "0"
    full_env.update(env or {})
    return full_env


def start_child(spec: dict, env: dict[str, str] | None = None,
                module: str = "vllm_kvguard.tools.ab.workload") -> subprocess.Popen:
    """Start ``python -m module SPEC-JSON`` in its own process group (:func:`child_env`);
    ``module`` may carry arguments before the spec (``"pkg.mod --flag"``)."""
    return subprocess.Popen([sys.executable, "-m", *module.split(), json.dumps(spec)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=child_env(spec, env), start_new_session=True)


def collect(proc: subprocess.Popen, spec: dict, timeout: float) -> dict:
    """The result line of a child from :func:`start_child` (killed with its group after
    ``timeout`` s: ``hung``; ended without a result: ``engine_died``)."""
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except BaseException as exc:
        kill_group(proc)                        # timeout, or Ctrl-C in the caller
        if not isinstance(exc, subprocess.TimeoutExpired):
            raise
        stdout, stderr = proc.communicate()
        return {"spec": spec, "ok": False, "hung": True, "engine_died": False,
                "error": f"no result within {timeout:.0f} s", "stderr": stderr[-4000:]}
    for line in reversed(stdout.splitlines()):
        if line.startswith(RESULT_TAG):
            result = json.loads(line[len(RESULT_TAG):])
            result["stderr"] = stderr[-4000:]
            result["kvguard_log"] = [ln for ln in (stdout + "\n" + stderr).splitlines()
                                     if "vllm-kvguard" in ln]   # whole, not a tail
            return note_fatal_fault(result, stdout + stderr)
    return {"spec": spec, "ok": False, "engine_died": True, "returncode": proc.returncode,
            "error": f"process exited {proc.returncode} without a result",
            "stderr": stderr[-4000:]}


def kill_group(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


def run_in_subprocess(spec: dict, env: dict[str, str] | None = None,
                      timeout: float = 300.0) -> dict:
    """Run :func:`vllm_kvguard.tools.ab.workload.run` in a fresh interpreter with ``env`` added
    to this environment."""
    return collect(start_child(spec, env), spec, timeout)


def run_together(jobs: list[tuple[dict, dict[str, str] | None, str]],
                 timeout: float = 300.0) -> list[dict]:
    """Several children at once, ``(spec, env, module)`` each: one result per job, in
    order. Started together (their imports overlap), read by one thread each (a full pipe
    never stalls a child); Ctrl-C kills every one of them."""
    procs = [start_child(spec, env, module) for spec, env, module in jobs]
    pool = ThreadPoolExecutor(max_workers=len(procs))
    try:
        futures = [pool.submit(collect, proc, spec, timeout)
                   for proc, (spec, _, _) in zip(procs, jobs)]
        return [f.result() for f in futures]
    finally:
        for proc in procs:                      # first: the readers then see EOF
            kill_group(proc)
        pool.shutdown(wait=True)


def fault_runs(spec: dict, faults: str, timeout: float = 240.0) -> tuple[dict, dict]:
    """The workload under ``KVGUARD_FAULTS=faults`` with vLLM alone (the injector, no
    fixes) and with the plugin (audit on): ``(vllm_alone, fixed)``."""
    env = {"KVGUARD": "1", "KVGUARD_FAULTS": faults}
    vllm_alone = run_in_subprocess(spec, {**env, "KVGUARD_PATCHES": "none"}, timeout)
    fixed = run_in_subprocess(spec, {**env, "KVGUARD_AUDIT": "1"}, timeout)
    return vllm_alone, fixed


def note_fatal_fault(result: dict, log: str) -> dict:
    """A multiprocess engine that an injected fault killed: the fault is in EngineCore's
    log (this child's stderr), not in the front end's error; count it."""
    if (result.get("spec", {}).get("multiprocess") and result.get("engine_died")
            and not result.get("faults_injected") and "injected: Cannot get" in log):
        result["faults_injected"] = 1
    return result


class WorkloadProcess:
    """A ``--serve`` child driven from this process. Every call waits with a timeout; a
    child that does not answer in time is killed and reported ``hung``, one that exits is
    reported ``engine_died``. Use as a context manager: leaving it kills the child."""

    def __init__(self, spec: dict, env: dict[str, str] | None = None):
        self.spec = spec
        self._imported: dict | None = None
        self._sent_start = self._sent_finish = False
        self.hung = False
        self.error: str | None = None
        self._lines: queue.Queue = queue.Queue()
        self._stderr: collections.deque = collections.deque(maxlen=200)
        cmd = [sys.executable, "-m", "vllm_kvguard.tools.ab.workload", "--serve",
               json.dumps(spec)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, bufsize=1,
                                     env=child_env(spec, env), start_new_session=True)
        for stream, sink in ((self.proc.stdout, self._stdout_line),
                             (self.proc.stderr, self._stderr.append)):
            threading.Thread(target=self._pump, args=(stream, sink), daemon=True).start()

    def _pump(self, stream, sink) -> None:
        for line in stream:
            sink(line.rstrip("\n"))
        if stream is self.proc.stdout:
            self._lines.put(None)                       # EOF: the child is gone

    def _stdout_line(self, line: str) -> None:
        for tag in (IMPORTED_TAG, READY_TAG, ROUND_TAG, RESULT_TAG):
            if line.startswith(tag):
                self._lines.put((tag, json.loads(line[len(tag):])))
                return
        self._stderr.append(line)                       # vLLM logs to stdout by default

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None and not self.hung

    def stderr_tail(self, chars: int = 4000) -> str:
        return "\n".join(self._stderr)[-chars:]

    def _expect(self, tag: str, timeout: float) -> dict | None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                item = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                self.hung = True
                self.error = f"no answer within {timeout:.0f} s"
                self.kill()
                return None
            if item is None:
                self._lines.put(None)                   # later calls see EOF too
                self.proc.wait()
                self.error = self.error or f"process exited {self.proc.returncode}"
                return None
            if item[0] == tag:
                return item[1]

    def _send(self, line: str) -> bool:
        try:
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()
            return True
        except (BrokenPipeError, OSError, ValueError):
            return False

    def imported(self, timeout: float = 600.0) -> dict:
        """Wait until the child imported vLLM: ``{"ok", "import_s", "error"}``."""
        if self._imported is None:
            msg = self._expect(IMPORTED_TAG, timeout)
            self._imported = msg if msg is not None else {"ok": False, "error": self.error}
        return self._imported

    def start(self) -> None:
        """Ask the child to build its engine (once); :meth:`ready` waits for it."""
        if not self._sent_start:
            self._sent_start = self._send("start")

    def ready(self, timeout: float = 600.0) -> dict:
        """Build the engine and wait for it: ``{"ok", "startup_s", "engine_s", "error"}``."""
        if not self.imported(timeout).get("ok") and self.error:
            return {"ok": False, "error": self.error}
        self.start()
        msg = self._sent_start and self._expect(READY_TAG, timeout)
        return msg if msg else {"ok": False, "error": self.error}

    def request_finish(self) -> None:
        """Ask the child for its result (once); :meth:`finish` collects it."""
        if not self._sent_finish:
            self._sent_finish = self._send("finish")

    def rounds(self, n: int, timeout: float = 300.0) -> dict:
        """Run ``n`` generate rounds: ``{"ok", "round_s", "engine_died", "error"}``."""
        msg = self._send(f"round {n}") and self._expect(ROUND_TAG, timeout)
        if msg:
            return msg
        return {"ok": False, "round_s": [], "engine_died": not self.hung, "hung": self.hung,
                "error": self.error}

    def finish(self, timeout: float = 120.0) -> dict:
        """The full result (as :func:`vllm_kvguard.tools.ab.workload.run` returns it), ``stderr``
        tail added; ends the child."""
        self.request_finish()
        msg = self._sent_finish and self._expect(RESULT_TAG, timeout)
        if msg:
            try:
                self.proc.wait(timeout=EXIT_GRACE_S)   # the result is in: no need to wait
            except subprocess.TimeoutExpired:
                self.kill()
            result = msg
        else:
            result = {"spec": self.spec, "ok": False, "hung": self.hung,
                      "engine_died": not self.hung, "returncode": self.proc.returncode,
                      "error": self.error}
        result["stderr"] = self.stderr_tail()
        return note_fatal_fault(result, "\n".join(self._stderr))

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass

    def __enter__(self) -> "WorkloadProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.kill()
