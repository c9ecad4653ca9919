"""Connector containment: a KV connector call that fails ends only its request."""
