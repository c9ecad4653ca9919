"""CUDA-graph coverage: the startup coverage table, the setting that covers a gap, opt-in capture completion, and counted eager fallbacks."""
