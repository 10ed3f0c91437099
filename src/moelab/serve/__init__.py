"""Serving: sampling-based generation with a KV cache."""
