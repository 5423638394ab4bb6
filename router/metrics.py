"""The router's Prometheus metrics."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LEG_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.hints = Counter(
            "kvbroker_router_requests",
            "Requests routed, by the registry's decision and consistency (DEGRADED when the "
            "registry gave no hint).",
            ["decision", "consistency"],
            registry=self.registry,
        )
        self.prefill_seconds = Histogram(
            "kvbroker_router_prefill_leg_seconds",
            "Prefill leg time (request to P's response).",
            buckets=_LEG_BUCKETS,
            registry=self.registry,
        )
        self.decode_seconds = Histogram(
            "kvbroker_router_decode_leg_seconds",
            "Decode leg time (to the end of D's response).",
            buckets=_LEG_BUCKETS,
            registry=self.registry,
        )
        self.ttft_seconds = Histogram(
            "kvbroker_router_ttft_seconds",
            "Time to first token as the router sees it (first streamed byte, or the whole "
            "response when not streaming), by the turn's path (READ, DECODE_LOCAL, RECOMPUTE).",
            ["path"],
            buckets=_LEG_BUCKETS,
            registry=self.registry,
        )
        self.prefill_failovers = Counter(
            "kvbroker_router_prefill_failovers",
            "Prefill legs retried on another prefill node because the chosen one was unreachable.",
            registry=self.registry,
        )
        self.ready_node_waits = Counter(
            "kvbroker_router_ready_node_waits",
            "Times a request waited because the registry had no ready node for its model.",
            registry=self.registry,
        )
        self.auth_failures = Counter(
            "kvbroker_router_auth_failures",
            "Requests refused with 401: no API key, or one the router does not hold.",
            registry=self.registry,
        )
        self.overhead_seconds = Histogram(
            "kvbroker_router_overhead_seconds",
            "Router time before the prefill leg starts (parsing and the routing hint).",
            buckets=(1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 5e-2),
            registry=self.registry,
        )
        self.local_hints = Counter(
            "kvbroker_router_local_hints",
            "With --local-hints, dry-run hints by who answered: the router's copy (local), "
            "the registry as the hint was not one a copy answers (forwarded), or the registry "
            "as the copy was too far behind (stale).",
            ["answer"],
            registry=self.registry,
        )
        self.hint_state_behind = Gauge(
            "kvbroker_router_hint_state_behind_seconds",
            "With --local-hints, how far behind the leader the router's copy of its hint "
            "state was at the last dry-run hint (+Inf: no copy).",
            registry=self.registry,
        )
