"""Spec-aware block estimation and what it certifies: the reserved-block model, the startup capacity report, the warmup guard, admission at the door and the liveness guard."""
