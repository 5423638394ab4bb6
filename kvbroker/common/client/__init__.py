"""Client helpers: the channel to the registry and its errors, the engine's link to its
sidecar, and batched calls (routing hints as a router sends them)."""
