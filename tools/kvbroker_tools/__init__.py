"""kvbroker-tools: what kvbroker's developers and evaluators run beside the product, in a
distribution of its own so that kvbroker's wheel (the servers, the connector, the operator's
command line) ships none of it.

- ``testmodel``: the generated test model; ``stack``: the whole stack on one machine;
  ``chat``: one streamed chat turn through a stack's router;
- ``harness``: stand-ins and fixtures the tests and benchmarks share (a fake engine, Envoy,
  Kubernetes, Dynamo, vllm-router, vLLM's example proxy, kvbroker's servers as processes);
- ``bench``: the benchmarks; ``demo``: the scripted demo;
- ``cli``: the commands they add to ``kvbroker`` (``up``, ``demo``, ``bench``), found by the
  product's command line through the ``kvbroker.commands`` entry points.

Imports go down that list only, and kvbroker's own package never imports this one
(tests/test_layers.py).
"""
