"""Operator tools: the ``kvguard-ab`` A/B benchmark, its workload runner, the truth table."""
