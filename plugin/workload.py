"""Run one tiny, deterministic workload on a real vLLM engine and report what happened.

Used by the A/B tool and the integration tests, so both measure the same thing::

    python -m vllm_kvguard.workload '{"model": "llama", "num_requests": 8}'

prints one line ``KVGUARD_WORKLOAD_RESULT {json}``. :func:`run_in_subprocess` starts that
in a fresh interpreter (vLLM loads our entry point there, so the environment decides
whether the plugin is on) and returns the parsed result, or a ``hung`` result after its
timeout. The engine runs in-process inside that interpreter unless ``multiprocess`` is set.

``python -m vllm_kvguard.workload --serve SPEC`` keeps the engine and takes commands on
stdin, one a line (the A/B tool interleaves the rounds of two such engines):

* once vLLM is imported it prints ``KVGUARD_WORKLOAD_IMPORTED {"ok", "import_s", "platform",
  "versions", "error"}``
  (several children can import at once; the plugin activates only when the engine is built);
* ``start`` builds the engine and prints ``KVGUARD_WORKLOAD_READY {"ok", "startup_s",
  "engine_s", "import_s", "error"}`` (``engine_s``: ``LLM(...)`` alone);
* ``round N`` runs N generate rounds and prints ``KVGUARD_WORKLOAD_ROUND {"ok", "round_s",
  "engine_died", "error"}`` (a dead engine runs nothing and answers ``ok: false``);
* ``finish`` prints ``KVGUARD_WORKLOAD_RESULT`` with the same dict :func:`run` returns, then
  exits. :class:`WorkloadProcess` is the parent's side of this protocol.
"""
from __future__ import annotations

import collections
import contextlib
import json
import os
import queue
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from typing import Any

RESULT_TAG = "KVGUARD_WORKLOAD_RESULT "
IMPORTED_TAG = "KVGUARD_WORKLOAD_IMPORTED "
READY_TAG = "KVGUARD_WORKLOAD_READY "
ROUND_TAG = "KVGUARD_WORKLOAD_ROUND "

DEFAULTS: dict[str, Any] = {
    "model": "llama",          # "llama", "nemotron_h" (embedded) or a model directory
    "engine": {},              # extra LLM(...) keyword arguments
    "gpu_engine": {},          # extra LLM(...) keyword arguments used only on CUDA-like GPUs
    "num_requests": 8,
    "prompt_len": 48,
    "max_tokens": 32,
    "seed": 0,
    "repetitive": True,        # prompts repeat a short pattern, so ngram drafting proposes
    "rounds": 1,               # generate() calls on the same engine (throughput samples)
    "multiprocess": False,
    "cpus": None,              # CPU ids to pin the process to once the engine is built
}

FINISHED = ("length", "stop")
EXIT_GRACE_S = 2.0      # a --serve child that sent its result and has not exited is killed


def make_prompts(spec: dict) -> list[list[int]]:
    rng = random.Random(spec["seed"])
    prompts = []
    for i in range(spec["num_requests"]):
        n = spec["prompt_len"] + (i % 4)
        if spec["repetitive"]:
            period = [rng.randrange(3, 1000) for _ in range(5)]
            ids = (period * (n // 5 + 1))[:n]
        else:
            ids = [rng.randrange(3, 1000) for _ in range(n)]
        prompts.append(ids)
    return prompts


def _pin(cpus) -> None:
    """Pin every thread of this process (and the ones it starts later) to ``cpus``."""
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = [0]
    for tid in tids:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(tid, cpus)


def pad_cpu_conv_weights() -> bool:
    """Harness workaround for a vLLM CPU defect, applied alike to A and B (never by the plugin).

    With speculative decoding the Mamba conv state is ``conv_kernel - 1 + k`` wide, but the
    CPU ``causal_conv1d_update`` kernel (``csrc/cpu/mamba_kernels.hpp``, reached through
    ``model_executor/layers/mamba/ops/cpu/causal_conv1d.py``) takes that width as its
    number of taps: the last channel reads ``k`` values past the end of the conv weight,
    i.e. whatever the heap holds there. About one process in seven then produces NaN
    logits (greedy output ``[t, 0, 0, ...]``) or rounds that disagree, with or without the
    plugin. Handing the kernel a copy of the weight followed by zeros makes the read
    deterministic, so A and B compare like with like. (The math stays vLLM's: spec
    decoding of hybrid models is not correct on CPU either way.) Returns whether it was
    installed now.
    """
    try:
        import torch
        from vllm.model_executor.layers.mamba.ops.cpu import causal_conv1d as cc
    except Exception:
        return False
    kernel = getattr(cc, "causal_conv1d_update_cpu_vec", None)
    if kernel is None or getattr(kernel, "kvguard_padded", False):
        return False
    padded: dict = {}

    def causal_conv1d_update_cpu_vec(x, conv_state, weight, *args, **kwargs):
        key = (weight.data_ptr(), weight._version)
        w = padded.get(key)
        if w is None:
            buf = torch.zeros(weight.numel() + 64, dtype=weight.dtype)
            buf[: weight.numel()] = weight.reshape(-1)
            w = padded[key] = buf[: weight.numel()].view(weight.shape)
        return kernel(x, conv_state, w, *args, **kwargs)

    causal_conv1d_update_cpu_vec.kvguard_padded = True
    cc.causal_conv1d_update_cpu_vec = causal_conv1d_update_cpu_vec
    return True


def _scheduler(llm):
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    core = getattr(core, "engine_core", None)        # InprocClient -> EngineCore
    return getattr(core, "scheduler", None)


def _pool_state(llm) -> dict:
    sched = _scheduler(llm)
    if sched is None:
        return {}
    pool = sched.kv_cache_manager.block_pool
    state = {"pool_blocks": pool.num_gpu_blocks,
             "held_blocks": pool.num_gpu_blocks - 1 - pool.get_num_free_blocks()}
    try:
        from vllm_kvguard.fixes import audit

        violations = audit.audit_kv_cache_manager(sched.kv_cache_manager, sched)
        state["audit_violations"] = [str(v) for v in violations]
    except (ImportError, AttributeError):
        pass
    return state


class Session:
    """One engine and its workload: :meth:`start`, then :meth:`generate` per round, then
    :meth:`finish` for the result dict. Never raises; a dead engine stays dead."""

    def __init__(self, spec: dict):
        self.spec = {**DEFAULTS, **spec}
        self.out: dict[str, Any] = {"spec": self.spec, "ok": False, "engine_died": False,
                                    "error": None}
        self.llm = None
        self.round_s: list[float] = []
        self.round_cpu_s: list[float] = []       # process CPU time (all threads) per round
        self.totals = {"submitted": 0, "completed": 0, "failed": 0, "aborted": 0}
        self.outputs: list[list[int]] | None = None
        self._model_dir: str | None = None       # an embedded model written for this run
        self.reasons: list[str] | None = None
        self.consistent = True

    @property
    def alive(self) -> bool:
        return self.llm is not None and not self.out["engine_died"]

    def import_vllm(self) -> bool:
        """Import vLLM (the slow, plugin-independent part of a start): ``import_s``."""
        if "import_s" in self.out:
            return self.out["error"] is None
        t0 = time.perf_counter()
        try:
            import torch
            import vllm
            from vllm.platforms import current_platform

            self.out["platform"] = current_platform.device_type or "unknown"
            self.out["versions"] = {"vllm": vllm.__version__, "torch": torch.__version__}
        except Exception as exc:
            self.out.update(error=f"startup failed: {type(exc).__name__}: {exc}",
                            startup_failed=True)
            return False
        finally:
            self.out["import_s"] = time.perf_counter() - t0
        return True

    def start(self) -> bool:
        """Build the engine: ``engine_s`` (``LLM(...)``), ``startup_s`` (import + engine)."""
        if not self.import_vllm():
            return False
        t0 = time.perf_counter()
        try:
            from vllm import LLM, SamplingParams
            from vllm.platforms import current_platform

            from vllm_kvguard.tiny_models import MODELS, engine_kwargs, write_model

            engine = dict(self.spec["engine"])
            if current_platform.is_cuda_alike():
                engine.update(self.spec["gpu_engine"])
            elif engine.get("speculative_config") and pad_cpu_conv_weights():
                self.out.setdefault("workarounds", []).append("cpu-conv1d-spec-padding")
            model = self.spec["model"]
            if model in MODELS:
                self._model_dir = tempfile.mkdtemp(prefix=f"kvguard-{model}-")
                model_dir = write_model(model, self._model_dir)
            else:
                model_dir = model
            self.llm = LLM(**engine_kwargs(model_dir, **engine))
        except Exception as exc:
            self.out.update(error=f"startup failed: {type(exc).__name__}: {exc}",
                            startup_failed=True)
            return False
        self.out["engine_s"] = time.perf_counter() - t0
        self.out["startup_s"] = self.out["import_s"] + self.out["engine_s"]
        if self.spec["cpus"]:               # for the rounds only: building is faster unpinned
            _pin(self.spec["cpus"])
        self.params = SamplingParams(temperature=0, ignore_eos=True, detokenize=False,
                                     max_tokens=self.spec["max_tokens"])
        self.prompts = [{"prompt_token_ids": p} for p in make_prompts(self.spec)]
        return True

    def generate(self) -> float | None:
        """One round: all prompts through ``LLM.generate``; its seconds, or None if dead."""
        if not self.alive:
            return None
        self.totals["submitted"] += len(self.prompts)
        t, c = time.perf_counter(), time.process_time()
        try:
            results = self.llm.generate(self.prompts, self.params, use_tqdm=False)
        except Exception as exc:
            self.out.update(error=f"{type(exc).__name__}: {exc}", engine_died=True,
                            traceback=traceback.format_exc()[-6000:])
            self.totals["failed"] += len(self.prompts)   # generate() returns none of them
            return None
        self.round_s.append(time.perf_counter() - t)
        self.round_cpu_s.append(time.process_time() - c)
        outputs = [list(r.outputs[0].token_ids) for r in results]
        reasons = [r.outputs[0].finish_reason for r in results]
        if self.outputs is None:
            self.outputs, self.reasons = outputs, reasons
        elif outputs != self.outputs:
            self.consistent = False
        done = sum(1 for r in reasons if r in FINISHED)
        aborted = sum(1 for r in reasons if r == "abort")
        self.totals["completed"] += done
        self.totals["aborted"] += aborted
        self.totals["failed"] += len(reasons) - done - aborted
        return self.round_s[-1]

    def finish(self) -> dict:
        out = self.out
        out.update(round_s=self.round_s, round_cpu_s=self.round_cpu_s, totals=self.totals, outputs_consistent=self.consistent)
        if self.outputs is not None:
            reasons = self.reasons
            done = sum(1 for r in reasons if r in FINISHED)
            out.update(
                outputs=self.outputs, finish_reasons=reasons,
                completed=done, aborted=sum(1 for r in reasons if r == "abort"),
                failed=len(reasons) - done - sum(1 for r in reasons if r == "abort"),
                tokens_per_round=sum(len(o) for o in self.outputs),
            )
        out["ok"] = self.outputs is not None and not out["engine_died"]
        if self.llm is not None:
            try:
                state = _pool_state(self.llm)
            except Exception as exc:   # a dead engine may not answer
                state = {"pool_state_error": f"{type(exc).__name__}: {exc}"}
            if not out["engine_died"]:
                state["preemptions"] = _preemptions(self.llm)
            if out["engine_died"]:      # requests died holding blocks: not comparable
                state = {f"died_{k}": v for k, v in state.items()}
            out.update(state)
        if self._model_dir:                 # no round runs after finish()
            shutil.rmtree(self._model_dir, ignore_errors=True)
        return _finish(out)


def run(spec: dict) -> dict:
    """Build the engine, run the workload, return the result dict (never raises)."""
    session = Session(spec)
    if session.start():
        for _ in range(session.spec["rounds"]):
            if session.generate() is None:
                break
    return session.finish()


def _finish(out: dict) -> dict:
    try:
        from vllm_kvguard import activation, report

        out["kvguard"] = {"results": activation.results(), "counters": report.snapshot()}
    except Exception as exc:  # the workload result matters more than our own report
        out["kvguard"] = {"error": repr(exc)}
    try:
        from vllm_kvguard.fixes import faults

        sched = faults.schedule()
        out["faults_injected"] = sched.fired if sched is not None else 0
    except Exception:
        pass
    with contextlib.suppress(Exception):    # the CUDA-graph audit, where the runner ran here
        from vllm_kvguard.fixes import coverage

        cov = coverage.last_audit()
        if cov is not None:
            out["kvguard"]["coverage"] = {
                "ok": cov.ok, "mode": cov.mode, "graphs": cov.graphs,
                "covered": sum(r.covered for r in cov.rows),
                "total": sum(r.total for r in cov.rows), "table": coverage.format_table(cov)}
    return out


def _preemptions(llm) -> int | None:
    """vLLM's own preemption counter (needs ``disable_log_stats=False``), or None."""
    try:
        found = [m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions"]
    except Exception:
        return None
    return int(sum(found)) if found else None


def _emit(tag: str, payload: dict) -> None:
    sys.stdout.flush()
    sys.stdout.write(tag + json.dumps(payload) + "\n")   # one write: not split by log lines
    sys.stdout.flush()


def serve(spec: dict, commands=None) -> int:
    """The ``--serve`` loop (see the module docstring); ``commands`` defaults to stdin."""
    commands = sys.stdin if commands is None else commands
    session = Session(spec)
    ok = session.import_vllm()
    _emit(IMPORTED_TAG, {"ok": ok, **{k: session.out.get(k) for k in (
        "import_s", "platform", "versions", "error")}})
    for line in commands:
        cmd, _, arg = line.strip().partition(" ")
        if cmd == "start":
            ok = session.start()
            _emit(READY_TAG, {"ok": ok, **{k: session.out.get(k) for k in (
                "startup_s", "engine_s", "import_s", "error")}})
        elif cmd == "round":
            times, n0 = [], len(session.round_cpu_s)
            for _ in range(int(arg or 1)):
                t = session.generate()
                if t is None:
                    break
                times.append(t)
            _emit(ROUND_TAG, {"ok": session.alive, "round_s": times,
                              "round_cpu_s": session.round_cpu_s[n0:],
                              "engine_died": session.out["engine_died"],
                              "error": session.out["error"]})
        elif cmd == "finish":
            break
    _emit(RESULT_TAG, session.finish())
    # The result is out; skip vLLM's interpreter shutdown (~8 s on 2 cores).
    with contextlib.suppress(Exception):
        if session.llm is not None:
            session.llm.llm_engine.engine_core.shutdown()   # EngineCore process, if any
    sys.stderr.flush()
    os._exit(0)


def child_env(spec: dict, env: dict[str, str] | None = None) -> dict[str, str]:
    """This environment minus every KVGUARD* variable, plus ``env``: only the caller decides
    whether the plugin is on in the child."""
    full_env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    for key in [k for k in full_env if k.startswith("KVGUARD")]:
        del full_env[key]
    full_env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if spec.get("multiprocess") else "0"
    full_env.update(env or {})
    return full_env


def run_in_subprocess(spec: dict, env: dict[str, str] | None = None,
                      timeout: float = 300.0) -> dict:
    """Run :func:`run` in a fresh interpreter with ``env`` added to this environment."""
    cmd = [sys.executable, "-m", "vllm_kvguard.workload", json.dumps(spec)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=child_env(spec, env), start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except BaseException as exc:
        if proc.poll() is None:                 # timeout, or Ctrl-C in the caller
            os.killpg(proc.pid, signal.SIGKILL)
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
            return result
    return {"spec": spec, "ok": False, "engine_died": True, "returncode": proc.returncode,
            "error": f"process exited {proc.returncode} without a result",
            "stderr": stderr[-4000:]}


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
        cmd = [sys.executable, "-m", "vllm_kvguard.workload", "--serve", json.dumps(spec)]
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
        """The full result (as :func:`run` returns it), ``stderr`` tail added; ends the child."""
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
        return result

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


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--serve":
        return serve(json.loads(argv[1]) if len(argv) > 1 else {})
    spec = json.loads(argv[0]) if argv else {}
    result = run(spec)
    _emit(RESULT_TAG, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
