"""Command-line tools that run outside a vLLM engine."""
