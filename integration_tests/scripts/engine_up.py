"""Start a real multiprocess engine with the plugin on, print one JSON line, wait on stdin.

The line: what the front end gets from its engine through
vLLM's ``collective_rpc`` (every process's entry; the summed counters and gauges). The
test kills processes of this tree (SIGKILL: no exit handlers) or lets it exit.

Run as a script (vLLM spawns processes); argv[1]: JSON of extra LLM(...) kwargs.
"""
import json
import sys

if __name__ == "__main__":
    from vllm import LLM

    from vllm_kvguard import metrics, remote
    from vllm_kvguard.tools.tiny_models import engine_kwargs, write_model

    extra = json.loads(sys.argv[1]) if len(sys.argv) > 1 else {}
    llm = LLM(**engine_kwargs(write_model("llama"), **extra))
    entries = remote.entries()
    print("ENGINE " + json.dumps({"entries": entries,
                                  "totals": metrics.totals(entries),
                                  "gauges": metrics.gauge_totals(entries)}), flush=True)
    sys.stdin.readline()
