"""kvbroker: the control plane for multi-turn KV reuse in P/D disaggregated vLLM serving.

This package holds the generated gRPC schema (``kvbroker.v1``), the helpers every part shares
(``kvbroker.common``) and the ``kvbroker`` command line (``kvbroker.cli``).
"""

__version__ = "0.1.0"
