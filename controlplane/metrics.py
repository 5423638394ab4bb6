"""The registry's Prometheus metrics (names are the public contract, see DESIGN.md).

Each registry instance owns its CollectorRegistry so several can run in one process (tests).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector


@dataclass(frozen=True)
class NodeFigures:
    node_id: str
    state: str
    live_leases: int
    retained_blocks: int
    retained_bytes: int


class _NodeGauges(Collector):
    """Per-node gauges read at scrape time, so lease transitions pay nothing for them."""

    def __init__(self, snapshot: Callable[[], Iterable[NodeFigures]]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[GaugeMetricFamily]:
        figures = list(self._snapshot())
        leases = GaugeMetricFamily("kvbroker_live_leases", "Leases ACTIVE or CLAIMED.")
        leases.add_metric([], sum(f.live_leases for f in figures))
        blocks = GaugeMetricFamily(
            "kvbroker_retained_blocks", "KV blocks retained under live leases, per node.",
            labels=["node"],
        )  # fmt: skip
        size = GaugeMetricFamily(
            "kvbroker_retained_bytes", "KV bytes retained under live leases, per node.",
            labels=["node"],
        )  # fmt: skip
        states = GaugeMetricFamily("kvbroker_nodes", "Registered nodes by state.", labels=["state"])
        counts: dict[str, int] = dict.fromkeys(("READY", "NOT_READY", "DRAINING", "DOWN"), 0)
        for figure in figures:
            blocks.add_metric([figure.node_id], figure.retained_blocks)
            size.add_metric([figure.node_id], figure.retained_bytes)
            counts[figure.state] = counts.get(figure.state, 0) + 1
        for state, count in counts.items():
            states.add_metric([state], count)
        yield from (leases, blocks, size, states)


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
        self.commands_dropped = Counter(
            "kvbroker_commands_dropped",
            "Lease commands dropped because a node's queue was full.",
            registry=self.registry,
        )

    def watch_nodes(self, snapshot: Callable[[], Iterable[NodeFigures]]) -> None:
        self.registry.register(_NodeGauges(snapshot))
