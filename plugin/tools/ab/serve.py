"""``kvguard-ab --serve``: the A/B scenarios on the real serving path.

A and B are real ``vllm serve`` processes (:class:`vllm_kvguard.tools.serve.Server`: API
server, EngineCore and worker, on 127.0.0.1), started together from the same model and
engine flags; only their environment differs (:func:`scenarios.scenario_envs`). An
asynchronous ``openai`` client sends both the same request stream: token-id prompts,
greedy, ``ignore_eos``, streamed so time to first token (TTFT), inter-token latency (ITL,
one gap per streamed chunk, as vLLM's serving benchmark counts it) and end-to-end latency
are measured; arrivals are open-loop Poisson at ``--request-rate`` (seeded), like vLLM's
``benchmark_serving``. Every request has a timeout, a stream a deadline for sending.
Output tok/s is a stream's output tokens over its wall time, arrivals included: below the
server's capacity it is the offered load (``--request-rate inf`` measures capacity).

``--repeat`` streams per side, in ABBA order, against the same two servers; a side whose
server died gets no more streams. Greedy outputs are compared as the in-process tool does
(against a fault-free plugin-off run of the same stream when A completed nothing). The
plugin's counters, EngineCore's included, are read from each live server's ``/metrics``.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import random
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from vllm_kvguard.tools.ab import stats as abstats
from vllm_kvguard.tools.ab.scenarios import EMBEDDED, Scenario, scenario_envs, scenario_spec, \
    workload_key
from vllm_kvguard.tools.serve import Batch, Outcome, Server, classify
from vllm_kvguard.tools.tiny_models import engine_kwargs, write_model
from vllm_kvguard.tools.ab.workload import DEFAULTS, make_prompts

SERVE_REQUESTS = 32          # requests per stream unless --num-requests
INJECTED = "injected: Cannot get"      # the injected fault's message (fixes.faults)


# ---------------------------------------------------------------------------- load
def poisson_offsets(n: int, rate: float, seed: int) -> list[float]:
    """Send times (s from the stream's start) of ``n`` requests arriving as a Poisson
    process of ``rate`` requests/s (exponential gaps; the first at 0); ``inf``: all at 0."""
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    out, t = [], 0.0
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


@dataclass
class Timed(Outcome):
    ttft: float | None = None                  # s to the first chunk with tokens
    itl: list[float] = field(default_factory=list)   # s between token chunks


def _chunk_ids(choice) -> list[int]:
    ids = getattr(choice, "token_ids", None)
    if ids is None:
        ids = (choice.model_extra or {}).get("token_ids")
    return list(ids or [])


async def _request(client, model: str, i: int, prompt: list[int], max_tokens: int,
                   timeout: float) -> Timed:
    out = Timed(i, "ok", token_ids=[])
    t0 = last = time.perf_counter()

    async def body() -> None:
        nonlocal last
        stream = await client.completions.create(
            model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
            extra_body={"return_token_ids": True, "ignore_eos": True})
        async for chunk in stream:
            now = time.perf_counter()
            for choice in chunk.choices:
                ids = _chunk_ids(choice)
                if ids:
                    if out.ttft is None:
                        out.ttft = now - t0
                    else:
                        out.itl.append(now - last)
                    last = now
                    out.token_ids.extend(ids)
                out.finish_reason = choice.finish_reason or out.finish_reason

    try:
        await asyncio.wait_for(body(), timeout)
        if out.finish_reason not in abstats.FINISHED:
            out.kind = f"finish {out.finish_reason}"
    except asyncio.TimeoutError:
        out.kind, out.detail = "timeout", f"no complete answer within {timeout:.0f} s"
    except Exception as exc:                   # what the client saw, never raised
        out.kind, out.detail = classify(exc)
    out.seconds = time.perf_counter() - t0
    return out


async def _stream(base_url: str, model: str, prompts: list[list[int]], max_tokens: int,
                  offsets: list[float], request_timeout: float, deadline_s: float) -> Batch:
    import openai

    client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="EMPTY", max_retries=0,
                                timeout=request_timeout)
    t0 = time.perf_counter()

    async def fire(i: int) -> Timed:
        if offsets[i] > deadline_s:
            return Timed(i, "not sent (deadline)")
        await asyncio.sleep(max(0.0, offsets[i] - (time.perf_counter() - t0)))
        return await _request(client, model, i, prompts[i], max_tokens, request_timeout)

    try:
        outcomes = await asyncio.gather(*(fire(i) for i in range(len(prompts))))
    finally:
        await client.close()
    return Batch(list(outcomes), time.perf_counter() - t0)


def send_stream(base_url: str, model: str, prompts: list[list[int]], max_tokens: int,
                offsets: list[float], request_timeout: float, deadline_s: float) -> Batch:
    """One open-loop request stream (every request once, at its offset); never raises for a
    failed request: each outcome is what the client saw."""
    return asyncio.run(_stream(base_url, model, prompts, max_tokens, offsets,
                               request_timeout, deadline_s))


def stream_tok_s(batch: Batch) -> float | None:
    """Output tokens per second of a stream in which every request completed."""
    if not batch.outcomes or not batch.all_ok or batch.seconds <= 0:
        return None
    return sum(len(o.token_ids or ()) for o in batch.outcomes) / batch.seconds


# ---------------------------------------------------------------------------- servers
def serve_args(spec: dict, model_dir: str) -> list[str]:
    """The ``vllm serve`` flags of a workload spec's engine settings (the tiny-engine
    defaults, then the scenario's and the user's): ``a_b=1`` -> ``--a-b 1``, True ->
    ``--a-b``, False -> ``--no-a-b``, objects as JSON."""
    kw = engine_kwargs(model_dir, **spec["engine"])
    kw.pop("model")
    args: list[str] = []
    for key, val in kw.items():
        flag = "--" + key.replace("_", "-")
        if val is None:
            continue
        if isinstance(val, bool):
            args.append(flag if val else "--no-" + flag[2:])
        elif isinstance(val, (dict, list)):
            args += [flag, json.dumps(val)]
        else:
            args += [flag, str(val)]
    return args


class ServedSide:
    """One ``vllm serve`` of a scenario and the streams it answered."""

    def __init__(self, key: str, label: str, env: dict):
        self.key, self.label, self.env = key, label, env
        self.server: Server | None = None
        self.batches: list[Batch] = []
        self.counters: dict = {}
        self.error: str | None = None
        self.died = False

    @property
    def usable(self) -> bool:
        return self.server is not None and self.server.startup_s is not None and \
            self.server.alive

    def finish(self) -> None:
        """After the streams: did the server die (waiting a little for a failing one to
        exit), and the plugin's counters of every process, from ``/metrics``."""
        if self.server is None or self.server.startup_s is None:
            return
        failing = any(not b.all_ok for b in self.batches)
        if failing and self.server.alive:
            self.server.wait_exit(30)
        self.died = not self.server.alive
        if not self.died:
            try:
                self.counters = self.server.kvguard_counters()
            except Exception as exc:
                self.error = f"/metrics: {type(exc).__name__}: {exc}"

    def summary(self, repeat: int) -> dict:
        outs = [o for b in self.batches for o in b.outcomes]
        ok = [o for o in outs if o.ok]
        errors: dict[str, int] = {}
        for o in outs:
            if not o.ok:
                errors[o.kind] = errors.get(o.kind, 0) + 1
        first = self.batches[0] if self.batches else None
        outputs = first.tokens() if first is not None and first.all_ok else None
        log = self.server.log() if self.server else ""
        faults = (self.counters.get("fault") or {}).get("injected")
        if faults is None:                   # a dead server: its log shows the fault
            faults = int(INJECTED in log)
        tok_s = [stream_tok_s(b) for b in self.batches]
        started = self.server is not None and self.server.startup_s is not None
        return {
            "label": self.label, "env": self.env, "served": True,
            "startup_s": self.server.startup_s if self.server else None,
            "startup_failed": not started, "engine_died": self.died, "hung": False,
            "error": self.error or next((o.detail for o in outs if not o.ok), None),
            "totals": {"submitted": len(outs), "completed": len(ok),
                       "failed": len(outs) - len(ok), "aborted": 0},
            "errors": dict(sorted(errors.items())),
            "latency": abstats.latency_summary({
                "ttft": [o.ttft for o in ok if o.ttft is not None],
                "itl": [g for o in ok for g in o.itl], "e2e": [o.seconds for o in ok]}),
            "tok_s": tok_s + [None] * (repeat - len(tok_s)),
            "output_tokens": sum(len(o.token_ids or ()) for o in ok),
            "outputs": outputs,
            "finish_reasons": [o.finish_reason for o in first.outcomes] if outputs else None,
            "outputs_consistent": all(b.tokens() == outputs for b in self.batches
                                      if b.all_ok) if outputs else True,
            "counters": self.counters, "faults_injected": faults,
            "held_blocks": None, "audit_violations": None, "patches": None,
            "processes": sorted(self.server.kvguard_reports()) if self.server else [],
            "log_path": self.server.log_path if self.server else None,
            "stderr_tail": self.server.tail(3000) if self.server and (
                self.died or not started) else None,
        }


def _start(sides: list[ServedSide], model_dir: str, args: list[str], name: str,
           log_dir: str, timeout: float) -> None:
    for side in sides:                      # both start at once, each under the other's load
        side.server = Server(model_dir, args, side.env, name=f"{name}-{side.key}",
                             log_dir=log_dir).start()

    def ready(side: ServedSide) -> None:       # polled at once: each one's own startup time
        try:
            side.server.wait_ready(timeout)
        except RuntimeError as exc:
            side.error = str(exc)[:3000]

    with ThreadPoolExecutor(len(sides)) as pool:
        list(pool.map(ready, sides))


def steps_for(settings: dict) -> int:
    per_scenario = 2 + 2 * settings["repeat"] + 1       # starts, streams, stop
    return (per_scenario * len(settings["scenarios"])
            + (2 if settings.get("microbench", True) else 0))


def run_scenario(sc: Scenario, settings: dict, prog, references: dict[str, dict],
                 environment: dict) -> dict:
    """One A/B server pair of one scenario: start both, ``--repeat`` streams each in ABBA
    order, counters, stop; the summary in the shape of :func:`abrun.run_scenario`'s."""
    spec = {**DEFAULTS, **scenario_spec(sc, settings)}
    spec["num_requests"] = settings["workload"].get("num_requests", SERVE_REQUESTS)
    env_a, env_b, label_a, label_b = scenario_envs(sc, settings)
    prompts = make_prompts(spec)
    rate = settings["request_rate"]
    offsets = poisson_offsets(len(prompts), rate, spec["seed"])
    stream = dict(prompts=prompts, max_tokens=spec["max_tokens"], offsets=offsets,
                  request_timeout=settings["request_timeout"], deadline_s=settings["timeout"])
    tmp = tempfile.mkdtemp(prefix="kvguard-ab-serve-")
    model = spec["model"]
    model_dir = write_model(model, os.path.join(tmp, model)) if model in EMBEDDED else model
    args = serve_args(spec, model_dir)
    sides = [ServedSide("A", label_a, env_a), ServedSide("B", label_b, env_b)]
    log_dir = settings.get("log_dir") or tmp
    os.makedirs(log_dir, exist_ok=True)
    try:
        prog.say(f"{sc.name}: starting vllm serve A (plugin {label_a}) and B (plugin "
                 f"{label_b})")
        _start(sides, model_dir, args, sc.name, log_dir, settings["timeout"])
        for side in sides:
            prog.say(f"{sc.name}: server {side.key} " + (
                f"up in {side.server.startup_s:.1f} s" if side.error is None
                else f"failed to start: {side.error.splitlines()[0]}"), advance=1)
        if settings["warmup"] and not sc.faults:     # faults: A's first stream is the test
            for side in (s for s in sides if s.usable):
                n = min(4, len(prompts))
                send_stream(side.server.base_url, model_dir, prompts[:n], spec["max_tokens"],
                            [0.0] * n, settings["request_timeout"], settings["timeout"])
        for i in range(settings["repeat"]):
            order = sides if i % 2 == 0 else sides[::-1]
            for side in order:
                if not side.usable:
                    continue
                batch = send_stream(side.server.base_url, model_dir, **stream)
                side.batches.append(batch)
                prog.say(f"{sc.name} [{i + 1}/{settings['repeat']}]: {side.key} "
                         f"{batch.summary()} in {batch.seconds:.1f} s", advance=1)
        for side in sides:
            side.finish()
    finally:
        for side in sides:
            if side.server is not None:
                side.server.stop()
        prog.say(f"{sc.name}: servers stopped", advance=1)
    summary = {s.key: s.summary(settings["repeat"]) for s in sides}
    a, b = summary["A"], summary["B"]
    key = "serve " + workload_key(spec) + f" rate={rate}"
    if not sc.faults and a["outputs"] is not None:
        references.setdefault(key, {"outputs": a["outputs"], "finish_reasons":
                                    a["finish_reasons"], "source": f"{sc.name} A"})
    reference = None
    if a["outputs"] is None and b["outputs"] is not None:
        reference = references.get(key) or _reference(
            sc, settings, model_dir, args, stream, log_dir, prog)
        references[key] = reference
    if log_dir != tmp:
        shutil.rmtree(tmp, ignore_errors=True)
    par = abstats.parity(a, b, reference)
    thr = abstats.throughput_summary(a["tok_s"], b["tok_s"])
    checks = abstats.checks(a, b, par, thr, settings["tolerance"])
    return {"name": sc.name, "description": sc.description, "spec": spec, "served": True,
            "request_rate": rate, "requests_per_stream": len(prompts),
            "rounds_per_sample": 1, "sides": summary,
            "reference": None if reference is None else {
                k: reference.get(k) for k in ("source", "error")},
            "parity": par, "throughput": thr,
            "latency_ratios": abstats.latency_ratios(a["latency"], b["latency"]),
            "checks": checks, "ok": abstats.verdict(checks)}


def _reference(sc: Scenario, settings: dict, model_dir: str, args: list[str], stream: dict,
               log_dir: str, prog) -> dict:
    """A fault-free plugin-off server answering the same stream once (A completed nothing)."""
    prog.say(f"{sc.name}: A completed nothing; reference server (plugin off, no faults)")
    ref = ServedSide("ref", "off", dict(settings.get("thread_env") or {}))
    try:
        _start([ref], model_dir, args, sc.name, log_dir, settings["timeout"])
        if ref.usable:
            ref.batches.append(send_stream(ref.server.base_url, model_dir, **stream))
    finally:
        with contextlib.suppress(Exception):
            ref.server.stop()
    s = ref.summary(1)
    return {"outputs": s["outputs"], "finish_reasons": s["finish_reasons"],
            "source": "reference server", "error": s["error"]}
