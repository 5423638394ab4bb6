"""The kvbroker router: an OpenAI-compatible, KV-aware proxy that asks the registry."""
