"""kvbroker's vLLM extension: the KV connector loaded inside vLLM, and the test model maker.

The only part of kvbroker that imports vLLM (and torch/transformers).
"""
