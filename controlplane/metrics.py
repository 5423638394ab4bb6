"""The registry's Prometheus metrics (names are the public contract, listed in the README's
"Metrics" section).

Each registry instance owns its CollectorRegistry so several can run in one process (tests).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from kvbroker.common.rules.labels import label
from kvbroker.v1 import registry_pb2


@dataclass(frozen=True)
class NodeFigures:
    node_id: str
    state: str
    live_leases: int
    retained_blocks: int
    retained_bytes: int
    # Retained blocks over the node's KV capacity (0 when it reported none).
    retained_fraction: float
    # The live correction of its prefill and read costs (1: as calibrated).
    prefill_correction: float = 1.0
    read_correction: float = 1.0
    # Known from the store after a takeover, not down, and its replay not yet in: its leases
    # are not offered until it is.
    awaiting_replay: bool = False


class _NodeGauges(Collector):
    """Per-node gauges read at scrape time, so lease transitions pay nothing for them."""

    def __init__(self) -> None:
        # Replaced by each registry that leads in this process (one per term over etcd).
        self.snapshot: Callable[[], Iterable[NodeFigures]] = tuple

    def collect(self) -> Iterator[GaugeMetricFamily]:
        figures = list(self.snapshot())
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
        fraction = GaugeMetricFamily(
            "kvbroker_retained_fraction",
            "Share of a node's KV cache retained under live leases, per node.",
            labels=["node"],
        )
        correction = GaugeMetricFamily(
            "kvbroker_node_cost_correction",
            "Live correction of a node's calibrated costs (observed over predicted time, "
            "weighted), per node and figure (prefill, read).",
            labels=["node", "figure"],
        )
        states = GaugeMetricFamily("kvbroker_nodes", "Registered nodes by state.", labels=["state"])
        awaiting = GaugeMetricFamily(
            "kvbroker_nodes_awaiting_replay",
            "Nodes a takeover found in the store whose sidecar has not replayed yet: their "
            "leases are not offered, and their conversations recompute, until it does.",
        )
        awaiting.add_metric([], sum(f.awaiting_replay for f in figures))
        counts: dict[str, int] = dict.fromkeys(("READY", "NOT_READY", "DRAINING", "DOWN"), 0)
        for figure in figures:
            blocks.add_metric([figure.node_id], figure.retained_blocks)
            size.add_metric([figure.node_id], figure.retained_bytes)
            fraction.add_metric([figure.node_id], figure.retained_fraction)
            correction.add_metric([figure.node_id, "prefill"], figure.prefill_correction)
            correction.add_metric([figure.node_id, "read"], figure.read_correction)
            counts[figure.state] = counts.get(figure.state, 0) + 1
        for state, count in counts.items():
            states.add_metric([state], count)
        yield from (leases, blocks, size, fraction, correction, states, awaiting)


class RegistryMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.hints = Counter(
            "kvbroker_hints",
            "Routing hints answered, by decision and consistency.",
            ["decision", "consistency"],
            registry=self.registry,
        )
        self.hint_paths = Counter(
            "kvbroker_hint_paths",
            "Routing hints answered, by the path chosen for the turn (READ, DECODE_LOCAL, "
            "RECOMPUTE).",
            ["path"],
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
            "Lease transitions: grant, renew, claim, release, revoke, expire, restore; pin and "
            "prefix_match (a fork matched the lease by content and pinned it).",
            ["event"],
            registry=self.registry,
        )
        self.lease_ends = Counter(
            "kvbroker_lease_ends",
            "Leases ended, by cause: read, pressure, budget, idle, superseded, revoked, "
            "node_lost, engine, fenced, drained.",
            ["cause"],
            registry=self.registry,
        )
        self.idle_ttl = Gauge(
            "kvbroker_idle_ttl_seconds",
            "The idle TTL new leases get (learned from gaps between turns, or the default).",
            registry=self.registry,
        )
        self.settle_waits = Counter(
            "kvbroker_hint_settle_waits",
            "Hints that waited for the previous turn's retention, by outcome (settled, timeout, "
            "no_time: the caller's deadline left no time to wait).",
            ["outcome"],
            registry=self.registry,
        )
        self.turns_not_retained = Counter(
            "kvbroker_turns_not_retained",
            "Turns whose decode node reported their end without retaining their KV, by reason "
            "(retention_off, aborted, failed, declined).",
            ["reason"],
            registry=self.registry,
        )
        self.commands_dropped = Counter(
            "kvbroker_commands_dropped",
            "Lease commands dropped because a node's queue was full.",
            registry=self.registry,
        )

        self.leader = Gauge(
            "kvbroker_registry_leader",
            "1 while this replica leads (always 1 with the memory store).",
            registry=self.registry,
        )
        self.takeovers = Counter(
            "kvbroker_registry_takeovers",
            "Times this replica became the leader.",
            registry=self.registry,
        )
        self.takeover_seconds = Histogram(
            "kvbroker_registry_takeover_seconds",
            "From winning the election to serving: reloading the store and rebuilding deadlines.",
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=self.registry,
        )
        self.forwarded = Counter(
            "kvbroker_registry_forwarded",
            "Calls a follower replica passed to the leader, by outcome.",
            ["outcome"],
            registry=self.registry,
        )
        self.follower_hints = Counter(
            "kvbroker_registry_follower_hints",
            "Dry-run hints a follower replica was asked, by who answered: local (its copy of "
            "the leader's state), stale (its copy was too far behind: forwarded).",
            ["answer"],
            registry=self.registry,
        )
        self.hint_state_behind = Gauge(
            "kvbroker_registry_hint_state_behind_seconds",
            "How far behind its leader a follower's copy of the hint state was at its last "
            "dry-run hint (+Inf: it has none).",
            registry=self.registry,
        )
        self._hint_children: dict[tuple[int, bool, int], tuple[Counter, Counter]] = {}
        self._event_children: dict[str, Counter] = {}
        self._end_children: dict[str, Counter] = {}
        self._node_gauges = _NodeGauges()
        self.registry.register(self._node_gauges)

    # Label children are cached: prometheus_client's labels() costs a few microseconds a call,
    # which a hint cannot spare.
    def hint(
        self, decision: registry_pb2.HintDecision, exact: bool, path: registry_pb2.TurnPath
    ) -> None:
        """Counts one hint by its decision and consistency, and by its path; the children
        are cached by the enums' numbers, since naming them costs more than counting."""
        key = (decision, exact, path)
        children = self._hint_children.get(key)
        if children is None:
            consistency = "EXACT" if exact else "DEGRADED"
            children = self._hint_children[key] = (
                self.hints.labels(label(registry_pb2.HintDecision, decision), consistency),
                self.hint_paths.labels(label(registry_pb2.TurnPath, path)),
            )
        for child in children:
            child.inc()

    def lease_event(self, event: str) -> Counter:
        child = self._event_children.get(event)
        if child is None:
            child = self._event_children[event] = self.lease_events.labels(event)
        return child

    def lease_end(self, cause: str) -> Counter:
        child = self._end_children.get(cause)
        if child is None:
            child = self._end_children[cause] = self.lease_ends.labels(cause)
        return child

    def watch_nodes(self, snapshot: Callable[[], Iterable[NodeFigures]]) -> None:
        self._node_gauges.snapshot = snapshot
