"""The sidecar's settings with their defaults, apart from the agent so that the CLI can show
them as its flags' defaults without importing the agent's dependencies."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from kvbroker.v1 import node_pb2


@dataclass(frozen=True)
class SidecarConfig:
    # The node's id in the registry (a Kubernetes pod's name); its credential names it.
    node_id: str
    # Prefill, decode or both: which legs the registry routes to the node.
    role: node_pb2.NodeRole
    # The engine's (vLLM's) HTTP base URL, probed for /health, /metrics and /v1/models.
    engine_url: str
    # Served model; when empty, the engine's own report (or /v1/models) names it.
    model: str = ""
    # Advertised HTTP base URL when it differs from engine_url (NAT, another interface).
    advertise_url: str = ""
    # Whether the engine caches prefixes (vLLM does unless started with
    # --no-enable-prefix-caching): the planner counts a prefill node's own cache only then.
    prefix_caching: bool = True
    # The engine's address as a gateway sees it ("10.0.0.7:8000"; empty: advertise_url's or
    # engine_url's host and port), for placement hints that name endpoints.
    gateway_endpoint: str = ""
    # The engine's worker instance id in NVIDIA Dynamo, for Dynamo's pin headers.
    dynamo_worker_id: str = ""
    # The engine's pod as "namespace/name", for llm-d's session-affinity header.
    kubernetes_pod: str = ""
    # The most retention events one report to the registry carries (the rest go in the next).
    max_batch: int = 512
    # The first wait before reconnecting to the registry after a failure; it doubles each try.
    backoff_initial_s: float = 0.1
    # Short: after a registry failover the holder's replay is what lets its KV be reused
    # again, and one reconnect a second per node is nothing to a registry.
    backoff_max_s: float = 1.0
    # How long one probe of the engine's /health waits for an answer.
    health_timeout_s: float = 1.0
    # Health probes in a row that must time out before the node is reported not ready.
    unready_after_timeouts: int = 3


def check_local_listen(listen: str) -> str:
    """``listen`` if it is where only the node's own processes reach the sidecar: a Unix
    socket (``unix:PATH``) or a loopback ``HOST:PORT``; ValueError otherwise. The sidecar
    answers its engine's calls (``ResolveHandle`` names any conversation, ``AttachEngine``
    speaks for the node) with no credential, so it is never served beyond the node."""
    if listen.startswith("unix:"):
        return listen
    host = listen.rsplit(":", 1)[0].strip("[]")
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise ValueError(
            f"the sidecar serves its engine only, on unix:PATH or a loopback address, not "
            f"{listen!r}: whoever reaches it can resolve any conversation's KV"
        )
    return listen
