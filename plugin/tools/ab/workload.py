"""Run one tiny, deterministic workload on a real vLLM engine and report what happened.

The A/B tool and the integration tests both measure through this one runner, so they
measure the same thing: fixed token-id prompts, greedy sampling, every request's outputs
and finish reason, the pool's held blocks and audit after the run, and the plugin's own
counters. It runs in a fresh child interpreter (:mod:`vllm_kvguard.tools.ab.harness` starts
it), where vLLM loads our entry point, so the environment decides whether the plugin is
on; the engine runs in-process there unless ``multiprocess`` is set.

    python -m vllm_kvguard.tools.ab.workload '{"model": "llama", "num_requests": 8}'

prints one line ``KVGUARD_WORKLOAD_RESULT {json}``.

``python -m vllm_kvguard.tools.ab.workload --serve SPEC`` keeps the engine and takes commands
on stdin, one a line (the A/B tool interleaves the rounds of two such engines):

* once vLLM is imported it prints ``KVGUARD_WORKLOAD_IMPORTED {"ok", "import_s", "platform",
  "versions", "error"}``
  (several children can import at once; the plugin activates only when the engine is built);
* ``start`` builds the engine and prints ``KVGUARD_WORKLOAD_READY {"ok", "startup_s",
  "engine_s", "import_s", "error"}`` (``engine_s``: ``LLM(...)`` alone);
* ``round N`` runs N generate rounds and prints ``KVGUARD_WORKLOAD_ROUND {"ok", "round_s",
  "engine_died", "error"}`` (a dead engine runs nothing and answers ``ok: false``);
* ``finish`` prints ``KVGUARD_WORKLOAD_RESULT`` with the same dict :func:`run` returns, then
  exits.
"""
from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import sys
import tempfile
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
    "prompt_lens": None,       # one length per request (overrides num_requests, prompt_len)
    "max_tokens": 32,
    "seed": 0,
    "repetitive": True,        # prompts repeat a short pattern, so ngram drafting proposes
    "rounds": 1,               # generate() calls on the same engine (throughput samples)
    "multiprocess": False,
    "cpus": None,              # CPU ids to pin the process to once the engine is built
    "connector": None,         # a KV connector: "ExampleConnector" (KV files in a temp dir),
                               # or a dict of KVTransferConfig fields with kv_connector
}

FINISHED = ("length", "stop")


def make_prompts(spec: dict) -> list[list[int]]:
    rng = random.Random(spec["seed"])
    prompts = []
    lens = spec.get("prompt_lens") or [spec["prompt_len"] + (i % 4)
                                   for i in range(spec["num_requests"])]
    for n in lens:
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

    With speculative decoding the Mamba conv state is ``conv_kernel - 1 + k`` wide, but
    vLLM's CPU kernel ``causal_conv1d_update_cpu_vec``
    (``vllm.model_executor.layers.mamba.ops.cpu.causal_conv1d``) takes that width as its
    number of taps: the last channel reads ``k`` values past the end of the conv weight,
    i.e. whatever the heap holds there. Some processes then produce NaN logits (greedy
    output ``[t, 0, 0, ...]``) or rounds that disagree, with or without the plugin. Handing
    the kernel a copy of the weight followed by zeros makes the read deterministic, so A
    and B compare like with like. (The math stays vLLM's: spec decoding of hybrid models is
    not correct on CPU either way.) Returns whether it was installed now.
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
        from vllm_kvguard.fixes.transaction import audit

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
        self.per_round: list[dict] = []         # every round's outputs and finish reasons
        self._storage: str | None = None        # the connector's KV files
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

            from vllm_kvguard.tools.tiny_models import MODELS, engine_kwargs, write_model

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
            if self.spec["connector"]:
                engine["kv_transfer_config"] = self._connector_config(self.spec["connector"])
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

    def _connector_config(self, connector):
        from vllm.config import KVTransferConfig

        fields = dict(connector) if isinstance(connector, dict) else {"kv_connector": connector}
        extra = fields.setdefault("kv_connector_extra_config", {})
        if fields["kv_connector"] == "ExampleConnector":
            self._storage = tempfile.mkdtemp(prefix="kvguard-kv-")
            extra["shared_storage_path"] = self._storage
        return KVTransferConfig(**{"kv_role": "kv_both", **fields})

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
        self.per_round.append({"outputs": outputs, "finish_reasons": reasons})
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
        if self.spec["connector"]:
            out["per_round"] = self.per_round
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
        for tmp in (self._model_dir, self._storage):   # no round runs after finish()
            if tmp:
                shutil.rmtree(tmp, ignore_errors=True)
        return _finish(out)


def run(spec: dict) -> dict:
    """Build the engine, run the workload, return the result dict (never raises)."""
    session = Session(spec)
    if session.start():
        for _ in range(session.spec["rounds"]):
            if session.generate() is None:
                break
    return session.finish()


def counters_of_every_process(multiprocess: bool) -> dict[str, dict[str, int]]:
    """The plugin's counters of this process and, with a multiprocess engine, of every
    process it started (EngineCore, workers), asked now through vLLM's ``collective_rpc``
    (:mod:`vllm_kvguard.remote`, the same sum ``/metrics`` shows)."""
    from vllm_kvguard import metrics, report

    return metrics.totals() if multiprocess else report.snapshot()


def faults_seen(counters: dict, error: str | None) -> int:
    """Injected faults as seen from outside EngineCore: each one the fix rolled back
    (rollback reason ``InjectedFault``) plus the one that killed an unfixed engine."""
    rolled_back = (counters.get("rollback") or {}).get("InjectedFault", 0)
    return rolled_back + (1 if error and "injected: Cannot get" in error else 0)


def _finish(out: dict) -> dict:
    multiprocess = bool(out.get("spec", {}).get("multiprocess"))
    try:
        from vllm_kvguard import activation

        out["kvguard"] = {"results": activation.results(),
                          "counters": counters_of_every_process(multiprocess)}
    except Exception as exc:  # the workload result matters more than our own report
        out["kvguard"] = {"error": repr(exc)}
    try:
        if multiprocess:        # the injector runs in EngineCore, not here
            out["faults_injected"] = faults_seen(out["kvguard"].get("counters") or {},
                                                 out.get("error"))
            out["faults_counted_from"] = "rollbacks and EngineCore's error"
        else:
            from vllm_kvguard.patches import faults

            live = faults.injector()
            out["faults_injected"] = live.schedule.fired if live is not None else 0
    except Exception:
        pass
    with contextlib.suppress(Exception):    # the CUDA-graph audit, where the runner ran here
        from vllm_kvguard.fixes.cudagraph import coverage

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
    # The result is out; skip vLLM's interpreter shutdown (slow on a small machine).
    with contextlib.suppress(Exception):
        if session.llm is not None:
            session.llm.llm_engine.engine_core.shutdown()   # EngineCore process, if any
    sys.stderr.flush()
    os._exit(0)


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
