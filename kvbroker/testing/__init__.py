"""The test harness, shipped so that the benchmarks and the tests use the same one.

Product code never imports it; ``tests/`` holds the tests and their fixtures only.
"""
