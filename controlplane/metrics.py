"""The registry's Prometheus metrics (names are the public contract, see DESIGN.md).

Each registry instance owns its CollectorRegistry so several can run in one process (tests).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class RegistryMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.hints = Counter(
            "kvbroker_hints",
            "Routing hints answered, by decision and consistency.",
            ["decision", "consistency"],
            registry=self.registry,
        )
        self.hint_latency = Histogram(
            "kvbroker_hint_latency_seconds",
            "Time to compute a routing hint inside the registry.",
            buckets=(5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 5e-2),
            registry=self.registry,
        )
        self.lease_events = Counter(
            "kvbroker_lease_events",
            "Lease transitions: grant, renew, claim, release, revoke, expire, restore.",
            ["event"],
            registry=self.registry,
        )
        self.live_leases = Gauge(
            "kvbroker_live_leases", "Leases ACTIVE or CLAIMED.", registry=self.registry
        )
        self.retained_blocks = Gauge(
            "kvbroker_retained_blocks",
            "KV blocks retained under live leases, per node.",
            ["node"],
            registry=self.registry,
        )
        self.retained_bytes = Gauge(
            "kvbroker_retained_bytes",
            "KV bytes retained under live leases, per node.",
            ["node"],
            registry=self.registry,
        )
        self.nodes = Gauge(
            "kvbroker_nodes", "Registered nodes by state.", ["state"], registry=self.registry
        )
        self.commands_dropped = Counter(
            "kvbroker_commands_dropped",
            "Lease commands dropped because a node's queue was full.",
            registry=self.registry,
        )
