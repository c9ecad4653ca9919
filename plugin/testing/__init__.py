"""Shared test scaffolding: builders of real vLLM objects and canned results for tests."""
