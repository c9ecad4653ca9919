"""Start a real multiprocess engine (front end + EngineCore + worker) and ask each worker
which vllm-kvguard wrappers are installed there. Writes the answer as JSON to argv[2] (a
file: the engine's processes share stdout, and their log lines can split ours).

Run as a script (vLLM spawns processes); argv[1]: JSON of extra LLM(...) kwargs.
"""
import json
import sys


def worker_probe(worker):
    import multiprocessing
    import os
    import sys as _sys

    from vllm_kvguard.activation import unwrapped_loaded_targets, wrapped_targets

    imported = "vllm_kvguard.patches" in _sys.modules
    return {"pid": os.getpid(), "proc": multiprocessing.current_process().name,
            "wrapped": wrapped_targets(), "imported": imported,
            "unwrapped_loaded": unwrapped_loaded_targets() if imported else []}


if __name__ == "__main__":
    from vllm import LLM

    from vllm_kvguard.activation import unwrapped_loaded_targets, wrapped_targets
    from vllm_kvguard.tools.tiny_models import engine_kwargs, write_model

    extra = json.loads(sys.argv[1]) if len(sys.argv) > 1 else {}
    llm = LLM(**engine_kwargs(write_model("llama"), **extra))
    answer = {"front_end": wrapped_targets(), "front_end_unwrapped": unwrapped_loaded_targets(),
              "workers": llm.collective_rpc(worker_probe)}
    with open(sys.argv[2], "w") as f:
        json.dump(answer, f)
