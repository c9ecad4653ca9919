"""A real local Ray cluster (loopback) started WITHOUT any KVGUARD variable; then the
plugin is switched on in this process (the one that would start vLLM's executor), and
two of vLLM's own ``RayWorkerWrapper`` actors get the environment the way vLLM's
``RayExecutor`` gives it (``get_env_vars_to_copy`` + ``update_environment_variables``)
and load plugins as ``init_worker`` does (``load_general_plugins``); their counters
come back the way EngineCore fetches them, through the executor's ``collective_rpc``.

Writes JSON to argv[1]: each actor's state before and after, and the driver's totals.
Run as a script; argv[2]: Ray's temp dir (short: Ray puts sockets in it).
"""
import json
import os
import sys

DRIVER_FLAGS = {"KVGUARD": "1", "KVGUARD_FAULTS": "every=7", "KVGUARD_PATCHES": "allocator"}


def before(wrapper):
    import os as _os

    return {k: v for k, v in _os.environ.items() if k.startswith("KVGUARD")}


def after(wrapper):
    import os as _os

    from vllm.plugins import load_general_plugins

    load_general_plugins()                       # what WorkerWrapperBase.init_worker runs first
    from vllm_kvguard import activation, process, report

    report.count("ray_probe", f"rank{wrapper.rpc_rank}")
    from vllm_kvguard.versions import vllm_version

    fl = activation.flags()
    res = activation.results()                   # None: the plugin stayed off here
    return {"pid": _os.getpid(), "results": res,
            "line": res and activation.startup_line(vllm_version(), res),
            "mismatch": res and process.mismatch([n for n, r in res.items()
                                                  if r.startswith("applied")]),
            "faults": repr(fl.faults), "patches": list(fl.patches),
            "speaker": process.describe(), "kind": process.kind(),
            "env": {k: v for k, v in _os.environ.items() if k.startswith("KVGUARD")}}


if __name__ == "__main__":
    import ray

    assert not any(k.startswith("KVGUARD") for k in os.environ), "start the cluster without"
    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1",
             _temp_dir=sys.argv[2], log_to_driver=True)
    try:
        os.environ.update(DRIVER_FLAGS)
        from vllm.plugins import load_general_plugins

        load_general_plugins()                   # the driver: plugin on
        from vllm.ray.ray_env import get_env_vars_to_copy
        from vllm.v1.executor.ray_utils import WORKER_SPECIFIC_ENV_VARS, RayWorkerWrapper

        from vllm_kvguard import metrics

        workers = [ray.remote(num_cpus=0)(RayWorkerWrapper).remote(rpc_rank=rank)
                   for rank in range(2)]
        states = ray.get([w.execute_method.remote(before) for w in workers], timeout=180)
        names = get_env_vars_to_copy(exclude_vars=WORKER_SPECIFIC_ENV_VARS,
                                     destination="workers")
        envs = [{n: os.environ[n] for n in names if n in os.environ} for _ in workers]
        ray.get([w.update_environment_variables.remote(envs) for w in workers], timeout=60)
        answers = ray.get([w.execute_method.remote(after) for w in workers], timeout=180)
        # what RayExecutor.collective_rpc sends for a callable (EngineCore's reply to
        # "kvguard_snapshot" takes the workers' entries this way)
        import cloudpickle

        from vllm_kvguard import remote

        sent = cloudpickle.dumps(remote.worker_entry)
        entries = ray.get([w.execute_method.remote(sent) for w in workers], timeout=60)
        answer = {"before": states, "after": answers, "driver_pid": os.getpid(),
                  "entries": entries, "driver_totals": metrics.totals(entries)}
        with open(sys.argv[1], "w") as f:
            json.dump(answer, f)
    finally:
        ray.shutdown()
