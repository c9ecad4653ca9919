"""Real ``vllm serve`` runs for the integration tests, shared and started ahead.

A server start costs tens of seconds here (three interpreters import vLLM: API server,
EngineCore, worker), so a test never owns a server. Each *configuration* (model, serve
options, environment) is run once per test session by a :class:`ServePool`: start the
server, send the standard request set through the ``openai`` client, read ``/metrics``,
stop the server, and keep the :class:`ServeRun` record. Tests assert on records; several
tests share one. The pool runs up to ``parallel`` configurations at once, in the order the
selected tests first need them, so later servers start while earlier tests assert.
Every server is stopped (its whole process group) when its run ends, and :meth:`close`
stops any left.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import time
import traceback
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from vllm_kvguard.tools.serve import Batch, Server, complete_all, parse_events, parse_gauges
from vllm_kvguard.tools.tiny_models import write_model
from vllm_kvguard.tools.ab.workload import make_prompts


PADDING_SITECUSTOMIZE = """\
try:
    import wrapt

    @wrapt.when_imported("vllm.model_executor.layers.mamba.ops.cpu.causal_conv1d")
    def _kvguard_pad(module):
        from vllm_kvguard.tools.ab.workload import pad_cpu_conv_weights

        pad_cpu_conv_weights()
except Exception:
    pass
"""


@dataclass(frozen=True)
class ServeConfig:
    name: str
    model: str                                   # tiny model kind: "llama", "nemotron_h"
    args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    num_requests: int = 32
    concurrency: int = 16
    prompt_len: int = 48
    max_tokens: int = 32
    expect_death: bool = False                   # fixes off + faults: wait for the exit
    # hybrid + spec decoding on CPU: pad the conv weight vLLM's CPU kernel reads past, in
    # every server process (workload.pad_cpu_conv_weights; a harness workaround, both sides)
    cpu_conv_padding: bool = False
    startup_timeout: float = 900.0             # a busy 2-core machine: 5+ min seen


@dataclass
class ServeRun:
    config: ServeConfig
    startup_s: float | None = None
    batch: Batch | None = None
    counters: dict = field(default_factory=dict)
    gauges: dict = field(default_factory=dict)   # kvguard_<gauge>{label} summed over processes
    reports: dict = field(default_factory=dict)  # process -> vllm-kvguard startup line
    alive_after: bool | None = None              # server still serving after the batch
    exit_code: int | None = None
    log: str = ""
    error: str | None = None                     # the run itself failed (startup, ...)
    run_s: float = 0.0

    def log_has(self, text: str) -> bool:
        return text in self.log


class ServePool:
    def __init__(self, configs: list[ServeConfig], parallel: int = 2,
                 log_dir: str | None = None):
        self.configs = {c.name: c for c in configs}
        self.log_dir = (log_dir or os.environ.get("KVGUARD_SERVE_LOG_DIR")
                        or tempfile.mkdtemp(prefix="kvguard-serve-logs-"))
        os.makedirs(self.log_dir, exist_ok=True)
        self._models: dict[str, str] = {}
        self._tmp = tempfile.mkdtemp(prefix="kvguard-serve-models-")
        self._servers: dict[str, Server] = {}
        self._closed = False
        self._executor = ThreadPoolExecutor(max_workers=max(1, parallel),
                                            thread_name_prefix="kvguard-serve")
        self._futures: dict[str, Future] = {}

    def prefetch(self, names: list[str]) -> None:
        """Queue these runs in this order (each once)."""
        for name in names:
            if name not in self._futures:
                self._futures[name] = self._executor.submit(self._run, self.configs[name])

    def get(self, name: str, timeout: float | None = None) -> ServeRun:
        self.prefetch([name])
        return self._futures[name].result(timeout=timeout)

    def _model_dir(self, kind: str) -> str:
        if kind not in self._models:
            self._models[kind] = write_model(kind, os.path.join(self._tmp, kind))
        return self._models[kind]

    def _padding_site(self) -> str:
        """A directory whose ``sitecustomize`` installs the conv-weight padding in every
        process once vLLM's CPU conv module is imported (spawned children inherit it)."""
        site = os.path.join(self._tmp, "conv-padding-site")
        if not os.path.isdir(site):
            os.makedirs(site)
            with open(os.path.join(site, "sitecustomize.py"), "w") as f:
                f.write(PADDING_SITECUSTOMIZE)
        return site

    def _run(self, cfg: ServeConfig) -> ServeRun:
        run = ServeRun(cfg)
        if self._closed:
            run.error = "pool closed"
            return run
        t0 = time.monotonic()
        env = dict(cfg.env)
        if cfg.cpu_conv_padding:
            path = [self._padding_site(), os.environ.get("PYTHONPATH", "")]
            env["PYTHONPATH"] = os.pathsep.join(p for p in path if p)
        server = Server(self._model_dir(cfg.model), list(cfg.args), env,
                        name=cfg.name, log_dir=self.log_dir)
        self._servers[cfg.name] = server
        try:
            server.start()
            run.startup_s = server.wait_ready(cfg.startup_timeout)
            prompts = make_prompts({"num_requests": cfg.num_requests, "seed": 0,
                                    "prompt_len": cfg.prompt_len, "repetitive": True})
            run.batch = complete_all(server.base_url, server.model, prompts, cfg.max_tokens,
                                     concurrency=cfg.concurrency, request_timeout=90,
                                     deadline_s=240)
            if cfg.expect_death:
                run.exit_code = server.wait_exit(60)
            run.alive_after = server.alive
            if run.alive_after:
                try:
                    text = server.settled_metrics_text()
                    run.counters, run.gauges = parse_events(text), parse_gauges(text)
                except Exception as exc:
                    run.error = f"/metrics: {type(exc).__name__}: {exc}"
        except Exception as exc:
            run.error = f"{type(exc).__name__}: {exc}"
            run.error += "\n" + traceback.format_exc()[-2000:]
        finally:
            server.stop()
            run.exit_code = server.exit_code if run.exit_code is None else run.exit_code
            run.log = server.log()
            run.reports = server.kvguard_reports()
            run.run_s = time.monotonic() - t0
        return run

    def close(self) -> None:
        self._closed = True
        for fut in self._futures.values():
            fut.cancel()
        for server in list(self._servers.values()):
            server.stop(grace=2)
        self._executor.shutdown(wait=True, cancel_futures=True)
        for server in list(self._servers.values()):
            server.stop(grace=0)
        shutil.rmtree(self._tmp, ignore_errors=True)


def complete_once(server, timeout: float, **request) -> tuple[str, str, float]:
    """One ``/v1/completions`` request (temperature 0, ``ignore_eos``): what the client saw
    (``finish REASON``, ``http CODE`` or ``timeout``), the error text, and the seconds."""
    import openai

    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="EMPTY",
                           max_retries=0, timeout=timeout)
    t0 = time.monotonic()
    try:
        r = client.completions.create(model=server.model_id(), temperature=0,
                                      extra_body={"ignore_eos": True}, **request)
        seen, text = f"finish {r.choices[0].finish_reason}", ""
    except openai.APIStatusError as exc:
        seen, text = f"http {exc.status_code}", str(exc)
    except openai.APITimeoutError as exc:
        seen, text = "timeout", str(exc)
    finally:
        client.close()
    return seen, text, time.monotonic() - t0
