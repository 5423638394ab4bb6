"""The router's settings with their defaults, apart from the proxy so that the CLI can show
them as its flags' defaults without importing the web stack."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RouterConfig:
    # Where the OpenAI-compatible HTTP API listens, HOST:PORT.
    listen: str = "127.0.0.1:8000"
    hint_timeout_s: float = 0.5
    # How long a request waits for a ready node when the registry has none for its model
    # (0: refuse it at once).
    ready_node_wait_s: float = 3.0
    upstream_timeout_s: float = 600.0
    # How often the fallback node list is refreshed (used only while the registry is away).
    node_refresh_s: float = 5.0

    def host_and_port(self) -> tuple[str, int]:
        """``listen`` split for binding; raises ValueError when it is not HOST:PORT."""
        host, _, port = self.listen.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"listen address {self.listen!r} is not HOST:PORT")
        return host, int(port)
