"""The test harness, shipped so that the benchmarks and the tests use the same one: a fake
engine, builders of the registry's messages, and kvbroker's servers as child processes.

Product code never imports it; ``tests/`` holds the tests and their fixtures only.
"""
