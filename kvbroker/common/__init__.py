"""Small helpers shared by the registry, the sidecar, the router and the CLI."""
