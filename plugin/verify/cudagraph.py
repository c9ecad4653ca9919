"""Self-test of the ``cudagraph`` patch: the coverage probe the startup audit and the
planner use runs on the installed vLLM's own graph owner (V2 ``CudaGraphManager``, or
V1 ``CudagraphDispatcher`` where it still exists), with vLLM's own capture sizing: every
decode family is found, the smallest decode dispatches to a graph, and the widest shape
the audit calls covered really does."""
from __future__ import annotations

from vllm_kvguard.verify import SelfTestFailed


def check() -> None:
    from vllm_kvguard.fixes.cudagraph import planner
    from vllm_kvguard.tools import plan as planning

    runner = planning.default_runner()
    vc = planning.plan_config(cudagraph_mode="FULL_DECODE_ONLY", runner=runner,
                              max_num_seqs=64, max_num_batched_tokens=2048)
    owner = planning.plan_owner(vc, runner)
    cov = planner.audit(owner)
    if not cov.rows:
        raise SelfTestFailed(f"the {runner} coverage probe found no decode shape")
    row = cov.rows[0]
    q = row.family.q
    if row.covered < 1:
        raise SelfTestFailed(f"the {runner} probe sees no graph for a 1-request decode")
    mode, _tokens = owner.probe(row.family.lo + row.covered - 1, q)
    if "NONE" in str(mode).upper():
        raise SelfTestFailed(f"the audit calls {row.family.lo + row.covered - 1} requests covered, "
                             f"{runner} dispatch runs them eager")
