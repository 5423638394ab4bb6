"""The sidecar's settings with their defaults, apart from the agent so that the CLI can show
them as its flags' defaults without importing the agent's dependencies."""

from __future__ import annotations

from dataclasses import dataclass

from kvbroker.v1 import node_pb2


@dataclass(frozen=True)
class SidecarConfig:
    node_id: str
    role: node_pb2.NodeRole
    engine_url: str
    # Served model; when empty, the engine's own report (or /v1/models) names it.
    model: str = ""
    # Advertised HTTP base URL when it differs from engine_url (NAT, another interface).
    advertise_url: str = ""
    # Whether the engine caches prefixes (vLLM does unless started with
    # --no-enable-prefix-caching): the planner counts a prefill node's own cache only then.
    prefix_caching: bool = True
    max_batch: int = 512
    backoff_initial_s: float = 0.1
    # Short: after a registry failover the holder's replay is what lets its KV be reused
    # again, and one reconnect a second per node is nothing to a registry.
    backoff_max_s: float = 1.0
    health_timeout_s: float = 1.0
    # Health probes in a row that must time out before the node is reported not ready.
    unready_after_timeouts: int = 3
