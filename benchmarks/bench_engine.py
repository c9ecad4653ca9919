"""Cost of vllm-kvguard on a whole REAL vLLM engine, plugin off vs on, in one run.

What is measured
    ``LLM.generate`` of an in-process vLLM engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``:
    front end, EngineCore, scheduler and the CPU model runner in one thread) on an
    embedded tiny dummy-weight model (``vllm_kvguard.tools.tiny_models``, built the way
    the A/B job's workload builds it), fixed token-id prompts, greedy sampling,
    ``ignore_eos``, one OpenMP thread, ``PYTHONHASHSEED=0``. Two loads:

    * ``plain``: a roomy pool, every request runs to its end;
    * ``pressure``: a small pool (``num_gpu_blocks_override``), so requests are preempted
      and recomputed; vLLM's own ``vllm:num_preemptions`` counter must move in the
      region, or the run fails.

    "off" is the engine with ``KVGUARD`` unset, "on" with ``KVGUARD=1`` (every patch that
    supports the installed vLLM, default fixes). Each side and load is one child process
    under callgrind (``_cgcount.py``): the engine is built and one uncounted ``generate``
    of other prompts warms it up, then one ``generate`` is counted (``--instr-atstart=no``:
    start-up is not counted). Both sides must produce the same tokens. The ratio per load
    is on/off of the region's instructions; target (issue 44): <= 1.003.

``--attribute`` also says where the on side's instructions go: one more child per load
    ("attr": the on side again) runs every function of the plugin, pluggy and wrapt that
    the warm-up called, and vLLM's functions the plugin wraps, through a C function of its
    own (``_cgcount.mark_functions``: callgrind sees no Python functions on CPython 3.11),
    and prints their calls, inclusive and self instructions per engine step, the marks' own
    cost taken out of self (calibrated in a second region); the same table goes into the
    docs block.

    python benchmarks/bench_engine.py [--layouts 1] [--loads plain,pressure] [--attribute]
                                      [--json RUN.json]
                                      [--write-docs docs/performance.md [--from-json RUN.json]]
"""
from __future__ import annotations

import argparse
import gc
import hashlib
import os
import random
import statistics
import sys
import time

import _cgcount
import _docs

TARGET = 1.003
BLOCK = 32                  # vLLM's CPU attention wants block_size % 32 == 0
LOADS = {
    # requests, prompt length, max_tokens, engine overrides
    "plain": dict(requests=8, prompt=48, max_tokens=32,
                  engine=dict(block_size=BLOCK, max_model_len=512,
                              num_gpu_blocks_override=96)),
    "pressure": dict(requests=8, prompt=48, max_tokens=32,
                     engine=dict(block_size=BLOCK, max_model_len=128,
                                 num_gpu_blocks_override=12)),
}
ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
       "OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
       "VLLM_HOST_IP": "127.0.0.1", "TOKENIZERS_PARALLELISM": "false"}


def parse_loads(text: str) -> list[str]:
    """``plain,pressure`` -> the load names, in order; unknown names refused."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in LOADS]
    if bad or not names:
        raise ValueError(f"unknown load(s) {', '.join(bad) or '(none)'}; "
                         f"valid: {', '.join(LOADS)}")
    return list(dict.fromkeys(names))


def side_name(side: str, load: str) -> str:
    return f"{side}.{load}"


def split_side(name: str) -> tuple[str, str]:
    side, _, load = name.partition(".")
    if side not in ("off", "on", "attr") or load not in LOADS:
        raise ValueError(f"bad child side {name!r}")
    return side, load


# ------------------------------------------------------------------ in the child
def set_env(side: str) -> None:
    """Before vLLM or torch is imported: the in-process engine, one thread, the side."""
    os.environ.update(ENV)
    if side in ("on", "attr"):
        os.environ["KVGUARD"] = "1"
    else:
        for k in [k for k in os.environ if k.startswith("KVGUARD") and
                  k != "KVGUARD_BENCH_UNDER_CALLGRIND"]:
            del os.environ[k]


def prompts(seed: int, n: int, length: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(3, 1000) for _ in range(length + i % 4)]}
            for i in range(n)]


def build(model: str, load: str):
    from vllm import LLM

    from vllm_kvguard.tools.tiny_models import engine_kwargs, write_model

    engine = dict(LOADS[load]["engine"], disable_log_stats=False)  # vLLM's counters
    return LLM(**engine_kwargs(write_model(model), **engine))


def stats(llm) -> dict:
    """vLLM's own counters: preemptions, engine steps (iteration histogram's count)."""
    out = {"preemptions": 0, "steps": 0}
    for m in llm.get_metrics():
        if m.name == "vllm:num_preemptions":
            out["preemptions"] += int(m.value)
        elif m.name == "vllm:iteration_tokens_total":
            out["steps"] += int(m.count)
    return out


def child(args) -> int:
    side, load = split_side(args.child)
    _cgcount.shift_layout(args.layout)
    quiet(args.verbose)
    from vllm import SamplingParams

    spec = LOADS[load]
    llm = build(args.model, load)
    params = SamplingParams(temperature=0, ignore_eos=True, detokenize=False,
                            max_tokens=spec["max_tokens"], seed=0)
    warm = prompts(args.seed + 1, spec["requests"], spec["prompt"])
    batch = prompts(args.seed, spec["requests"], spec["prompt"])
    llm.generate(warm, params, use_tqdm=False)
    extra = {}
    if side == "attr":
        again = prompts(args.seed + 2, spec["requests"], spec["prompt"])
        extra = mark(lambda: llm.generate(again, params, use_tqdm=False))
    before = stats(llm)
    gc.collect()
    results = _cgcount.region(lambda: llm.generate(batch, params, use_tqdm=False))
    after = stats(llm)
    if side == "attr":
        _cgcount.region(extra.pop("calibrate"))
    tokens = [list(r.outputs[0].token_ids) for r in results]
    digest = hashlib.sha256(repr(tokens).encode()).hexdigest()[:16]
    from vllm_kvguard import activation
    _cgcount.emit(dict(extra, regions=2 if side == "attr" else 1, digest=digest,
                       tokens=sum(map(len, tokens)),
                       steps=after["steps"] - before["steps"],
                       preemptions=after["preemptions"] - before["preemptions"],
                       patches=sorted(k for k, v in (activation.results() or {}).items()
                                      if str(v).startswith("applied"))))
    return 0


def mark(run) -> dict:
    """In the attr child: route the plugin's, pluggy's and wrapt's functions that ``run()``
    calls, and the vLLM functions the plugin wraps, through marks of their own."""
    import tempfile

    import pluggy
    import wrapt

    import vllm_kvguard
    from vllm_kvguard import patches, registry

    dirs = tuple(os.path.dirname(m.__file__) + os.sep
                 for m in (vllm_kvguard, patches, pluggy, wrapt))
    wrapped = {}                                        # the vLLM functions we wrap
    for name, module in list(sys.modules.items()):
        if not name.startswith("vllm.") or module is None:
            continue
        for value in list(vars(module).values()):
            owners = [value] if registry.is_wrapped(value) else []
            if isinstance(value, type) and value.__module__ == name:
                owners += [v for v in vars(value).values() if registry.is_wrapped(v)]
            for w in owners:
                if hasattr(w.__wrapped__, "__code__"):
                    wrapped[id(w.__wrapped__)] = w.__wrapped__
    codes = {f.__code__ for f in wrapped.values()}
    fns = _cgcount.called_functions(run, lambda code: code in codes or code.co_filename
                                    .startswith(dirs) or "vllm_kvguard" in code.co_filename)
    called = {f.__code__ for f in fns}
    ours = [f for f in fns if f.__code__.co_filename.startswith(dirs)
            or "vllm_kvguard" in f.__code__.co_filename]
    labelled = {}
    for fn in ours + [f for f in wrapped.values() if f.__code__ in called]:
        label = (f"vLLM {fn.__qualname__}" if id(fn) in wrapped
                 else _cgcount.label_of(fn))
        n = 2
        while label in labelled:
            label = f"{label.rsplit(' #', 1)[0]} #{n}"
            n += 1
        labelled[label] = fn
    d = tempfile.mkdtemp(prefix="kvguard-marks-")
    marks = _cgcount.build_marks(d)
    _cgcount.cleanup(d)                  # loaded (and read by callgrind): not needed now
    calibrate, cal = _cgcount.overhead_region(marks)
    return dict(names=_cgcount.mark_functions(marks, labelled), cal=cal, calibrate=calibrate)


def start_attribution(args, loads: list[str]) -> tuple[str, list]:
    """Start the attr child of each load (they run beside the counts)."""
    argv = [os.path.abspath(__file__), "--model", args.model, "--seed", str(args.seed),
            "--layout", "0"]
    d = _cgcount.tmpdir()
    return d, [(load, _cgcount.start(argv + ["--child", side_name("attr", load)],
                                     os.path.join(d, f"{load}.out"),
                                     options=_cgcount.MARK_OPTIONS)) for load in loads]


def finish_attribution(started: tuple[str, list], res: dict) -> str:
    """Wait for the attr children; print and return the tables (Markdown)."""
    d, procs = started
    tables = []
    try:
        for load, proc in procs:
            out = os.path.join(d, f"{load}.out")
            result, _counts = _cgcount.finish(proc, out, f"attr.{load}")
            inside, outside = _cgcount.overhead(f"{out}.2", result["cal"])
            costs = _cgcount.corrected(_cgcount.marked_costs(
                f"{out}.1", result["names"], {"wrapt (C)": r"^Wrapt"}), inside, outside)
            tables.append(table(load, costs, result["steps"], res.get(load), inside + outside))
    finally:
        for _load, proc in procs:
            if proc.poll() is None:
                proc.kill()
        _cgcount.cleanup(d)
    return "\n\n".join(tables)


def table(load: str, costs: dict, steps: int, counted: dict | None, mark_cost: float,
          top: int = 20) -> str:
    """Markdown: where the on side's instructions go in ``load``, per engine step."""
    ours = {k: v for k, v in costs.items() if not k.startswith("vLLM ")}
    total = sum(v["self"] for v in ours.values())
    head = (f"Where the plugin's instructions go, `{load}` load ({steps} engine steps; "
            f"functions of the plugin, pluggy and wrapt, instructions per step; self is "
            f"less the marks' own cost, {mark_cost:,.0f} per marked call): "
            f"sum of self {total / steps:,.0f}")
    if counted:
        diff = (statistics.fmean(counted["on"]) - statistics.fmean(counted["off"])) / steps
        head += f" against on-off {diff:,.0f} counted"
    rows = ["| function | calls/step | inclusive/step | self/step |", "|---|---:|---:|---:|"]
    for k, v in sorted(ours.items(), key=lambda kv: -kv[1]["self"])[:top]:
        name = k.replace("|", "/")
        calls, incl = ((f"{v['calls'] / steps:.2f}", f"{v['incl'] / steps:,.0f}")
                       if v["calls"] else ("", ""))
        rows.append(f"| `{name}` | {calls} | {incl} | {v['self'] / steps:,.0f} |")
    return head + ".\n\n" + "\n".join(rows)


def quiet(verbose: bool) -> None:
    import logging

    import vllm  # noqa: F401  (vLLM sets its logger up on import)

    if not verbose:
        logging.getLogger("vllm").setLevel(logging.ERROR)
        logging.getLogger("vllm_kvguard").setLevel(logging.ERROR)


# ------------------------------------------------------------------ in the parent
def count(args, loads: list[str]) -> dict:
    """{load: {"off": [Ir per layout], "on": [...], "steps", "preemptions", ...}}."""
    argv = [os.path.abspath(__file__), "--model", args.model, "--seed", str(args.seed)]
    layouts = _cgcount.LAYOUTS[:args.layouts]
    sides = [side_name(s, load) for load in loads for s in ("off", "on")]
    done = _cgcount.count_each(argv, sides, layouts, parallel=args.parallel)
    res = {}
    for load in loads:
        r = res[load] = {"off": [], "on": [], "layouts": list(layouts)}
        for n in layouts:
            (off, (c_off,)), (on, (c_on,)) = (done[(side_name(s, load), n)]
                                              for s in ("off", "on"))
            if off["digest"] != on["digest"]:
                raise RuntimeError(f"{load}: off and on generated different tokens")
            if (off["steps"], off["preemptions"]) != (on["steps"], on["preemptions"]):
                raise RuntimeError(f"{load}: off and on ran different schedules "
                                   f"({off['steps']}/{off['preemptions']} steps/preemptions "
                                   f"off, {on['steps']}/{on['preemptions']} on)")
            if load == "pressure" and not on["preemptions"]:
                raise RuntimeError("pressure: no preemption happened in the region")
            r["off"].append(c_off)
            r["on"].append(c_on)
            r.update(steps=on["steps"], preemptions=on["preemptions"],
                     tokens=on["tokens"], patches=on["patches"])
    return res


def report(res: dict, elapsed: float) -> dict:
    """Print the table; return {load: ratio of the means}."""
    ratios = {}
    print(f"{'load':10} {'off Ir':>15} {'on Ir':>15} {'on/off':>8} {'steps':>6} "
          f"{'preempt':>7} {'on-off Ir/step':>15}  per layout")
    for load, r in res.items():
        off, on = statistics.fmean(r["off"]), statistics.fmean(r["on"])
        ratios[load] = on / off
        per_step = (on - off) / r["steps"] if r["steps"] else float("nan")
        print(f"{load:10} {off:>15,.0f} {on:>15,.0f} {on / off:8.4f} {r['steps']:>6} "
              f"{r['preemptions']:>7} {per_step:>15,.0f}  "
              + " ".join(f"{b / a:.4f}" for a, b in zip(r["off"], r["on"])))
    first = next(iter(res.values()))
    print(f"({elapsed:.0f} s; identical tokens and schedules off/on; patches on: "
          f"{', '.join(first['patches'])})")
    return ratios


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--loads", default="plain,pressure",
                    help=f"comma list of {', '.join(LOADS)}")
    ap.add_argument("--model", default="llama", help="an embedded tiny model (tiny_models)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layouts", type=int, default=1,
                    choices=range(1, len(_cgcount.LAYOUTS) + 1),
                    help="heap layouts each side is counted under (one child each)")
    ap.add_argument("--parallel", type=int, default=2, help="callgrind children at a time")
    ap.add_argument("--attribute", action="store_true",
                    help="also say where the on side's instructions go, by function")
    ap.add_argument("--attribute-only", action="store_true",
                    help="only the attribution (no off/on counts, nothing written)")
    ap.add_argument("--verbose", action="store_true", help="keep vLLM's INFO logs")
    _docs.add_arguments(ap, "engine")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--layout", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    try:
        loads = parse_loads(args.loads)
    except ValueError as exc:
        ap.error(str(exc))
    if _docs.write_saved(ap, args):
        return 0
    if args.child:
        set_env(split_side(args.child)[0])
        return child(args)
    why = _cgcount.available()
    if why:
        print(f"not counted: {why}")
        return 1
    set_env("off")                       # the parent imports vLLM only for its version
    import vllm

    print(f"vLLM {vllm.__version__}: in-process LLM.generate, tiny {args.model} (dummy "
          f"weights), greedy, block {BLOCK}; loads "
          + "; ".join(f"{n}: {LOADS[n]['requests']} requests x {LOADS[n]['prompt']}-"
                      f"{LOADS[n]['prompt'] + 3} prompt + {LOADS[n]['max_tokens']} tokens, "
                      f"pool {LOADS[n]['engine']['num_gpu_blocks_override']} blocks"
                      for n in loads)
          + "; plugin on = KVGUARD=1")
    t0 = time.monotonic()
    started = start_attribution(args, loads) if args.attribute or args.attribute_only else None
    if args.attribute_only:
        print(finish_attribution(started, {}))
        return 0
    try:
        res = count(args, loads)
    except BaseException:
        if started:
            for _load, proc in started[1]:
                proc.kill()
            _cgcount.cleanup(started[0])
        raise
    ratios = report(res, time.monotonic() - t0)
    worst = max(ratios.values())
    print(f"{'PASS' if worst <= TARGET else 'MISS'}: whole engine on/off "
          + ", ".join(f"{k} {v:.4f}x" for k, v in ratios.items()) + f" (target <= {TARGET})")
    extra = ""
    if started:
        extra = finish_attribution(started, res)
        print(extra)
    rec = _docs.record(
        "engine", vllm.__version__, res[loads[0]]["layouts"], ratios, TARGET,
        per_layout={k: [b / a for a, b in zip(r["off"], r["on"])] for k, r in res.items()},
        command=f"bench_engine.py --layouts {args.layouts}"
                + (" --attribute" if args.attribute else ""),
        facts={k: dict(steps=r["steps"], preemptions=r["preemptions"],
                       per_step=(statistics.fmean(r["on"]) - statistics.fmean(r["off"]))
                       / max(r["steps"], 1)) for k, r in res.items()},
        extra=extra)
    _docs.save(args, rec)
    return 0


if __name__ == "__main__":
    sys.exit(main())
