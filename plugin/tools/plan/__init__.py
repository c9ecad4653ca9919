"""``kvguard plan``: the pre-flight planner, no GPU. ``preflight`` is the command (per-group
KV capacity, admission limits, CUDA-graph coverage); ``layer_specs`` builds the per-layer KV
specs on the meta device (``meta_model``: what that build needs without CUDA);
``cudagraph`` is the CUDA-graph coverage planner; ``warmup_check`` the V2 warmup check."""
