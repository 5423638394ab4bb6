"""The kvbroker sidecar: the agent beside each vLLM server."""
