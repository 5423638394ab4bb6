"""kvbroker's vLLM extension: the KV connector loaded inside vLLM, and the test model maker.

The only part of kvbroker that imports vLLM (and torch/transformers), and within it only
``engine_ext.vllm_compat`` touches vLLM or NIXL: the connector's settings (``settings``) and
rules (``verdict``, ``pressure``, ``prefix``) are plain Python.
"""
