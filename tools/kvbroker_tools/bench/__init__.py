"""Benchmarks and the demo's measuring client."""
