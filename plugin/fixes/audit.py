"""Placeholder: implemented in its issue."""
