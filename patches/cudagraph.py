"""Host surface: CUDA-graph dispatch and capture (placeholder; see issue 4)."""
from vllm_kvguard.registry import Patch

PATCH = Patch(
    name="cudagraph",
    summary="CUDA-graph coverage audit, capture completion, fallback accounting",
    targets=[],
    vllm_versions=">=0.27.1,<0.34",
    upstream=("vllm#27325", "vllm#54933"),
    remove_when="TBD",
)
