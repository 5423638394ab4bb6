"""The sidecar's Prometheus metrics."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge


class SidecarMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.reports = Counter(
            "kvbroker_sidecar_reports",
            "Retention events forwarded to the registry.",
            registry=self.registry,
        )
        self.commands = Counter(
            "kvbroker_sidecar_commands",
            "Lease deadlines handed to the engine, by the lease state they carry.",
            ["state"],
            registry=self.registry,
        )
        self.reconnects = Counter(
            "kvbroker_sidecar_reconnects",
            "Registry sessions re-established after a failure.",
            registry=self.registry,
        )
        self.heartbeats_failed = Counter(
            "kvbroker_sidecar_heartbeats_failed",
            "Heartbeats that failed without ending the session (the registry slow or "
            "unreachable for less than its session TTL), by gRPC status code.",
            ["code"],
            registry=self.registry,
        )
        self.node_in_use = Gauge(
            "kvbroker_sidecar_node_in_use",
            "1 while the registry refuses this sidecar's registration because another live "
            "session holds its node id (another sidecar, or its predecessor's until it lapses).",
            registry=self.registry,
        )
        self.replay_size = Gauge(
            "kvbroker_sidecar_replay_size",
            "Retained requests in the last snapshot replayed to the registry.",
            registry=self.registry,
        )
        self.queue_depth = Gauge(
            "kvbroker_sidecar_queue_depth",
            "Retention events waiting to reach the registry.",
            registry=self.registry,
        )
        self.engine_ready = Gauge(
            "kvbroker_sidecar_engine_ready",
            "1 while the engine answers its health check.",
            registry=self.registry,
        )
