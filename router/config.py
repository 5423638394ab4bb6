"""The router's settings with their defaults, apart from the proxy so that the CLI can show
them as its flags' defaults without importing the web stack."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields


@dataclass(frozen=True)
class RouterConfig:
    # Where the OpenAI-compatible HTTP API listens, HOST:PORT.
    listen: str = "127.0.0.1:8000"
    # The registry's deadline for one routing hint; past it the turn is served as plain P/D
    # (DEGRADED).
    hint_timeout_s: float = 0.5
    # How long a request waits for a ready node when the registry has none for its model
    # (0: refuse it at once).
    ready_node_wait_s: float = 3.0
    # Engine (vLLM) HTTP timeouts. Connecting to an engine; past it the engine is unreachable.
    connect_timeout_s: float = 5.0
    # The prefill leg's answer (queueing and prefill): past it the leg goes to another prefill
    # node, and the client gets a 504 when there is none.
    prefill_timeout_s: float = 120.0
    # The decode leg: the whole answer when not streaming, the gap between two chunks when
    # streaming (504 before the first chunk; after it, an error event ends the stream).
    decode_timeout_s: float = 600.0
    # A request body over this many bytes is refused with 413 (it is copied to both legs).
    max_body_bytes: int = 32 * 1024 * 1024
    # How often the node list is refreshed: what the router routes by while the registry is
    # away, tells an unknown model by, and what /health's view of the registry comes from.
    node_refresh_s: float = 5.0
    # Retain turns that come without a session id: each is given a fresh conversation id in
    # kvbroker's namespace (scoped to the client's tenant, and said in the answer's
    # x-kvbroker-session-id header), so the decode node retains it and the client's next
    # sessionless turn reads it back by content. Off: such a turn is plain P/D, retained for
    # nothing.
    retain_sessionless: bool = True
    # Answer dry-run hints (the placement endpoint's) from this router's own copy of the
    # leader's hint state, watched from the registry (``router.local_hints``), while the copy
    # is at most ``hint_staleness_s`` behind; else, and for every turn's hint, ask the registry.
    local_hints: bool = False
    # With ``local_hints``: how far behind the leader the copy may be and still answer (as a
    # registry follower's ``--hint-staleness``); further behind, the router asks the registry.
    hint_staleness_s: float = 1.0

    def __post_init__(self) -> None:
        for setting in fields(self):
            value = getattr(self, setting.name)
            if setting.name.endswith("_s") and not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{setting.name} must be a finite number of seconds, not {value}")
        for name in (
            "hint_timeout_s",
            "connect_timeout_s",
            "prefill_timeout_s",
            "decode_timeout_s",
            "node_refresh_s",
        ):
            if getattr(self, name) == 0:
                raise ValueError(f"{name} must be above 0 seconds")
        if self.max_body_bytes <= 0:
            raise ValueError("max_body_bytes must be above 0")

    def host_and_port(self) -> tuple[str, int]:
        """``listen`` split for binding; raises ValueError when it is not HOST:PORT."""
        host, _, port = self.listen.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"listen address {self.listen!r} is not HOST:PORT")
        return host, int(port)
