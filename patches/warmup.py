"""Host surface: model-runner warmup and profiling (placeholder; see issue 7)."""
from vllm_kvguard.registry import Patch

PATCH = Patch(
    name="warmup",
    summary="spec-aware warmup block estimate, in-bounds and best-effort warmup",
    targets=[],
    vllm_versions=">=0.27.1,<0.34",
    upstream=("vllm#51438", "vllm#37521"),
    remove_when="TBD",
)
