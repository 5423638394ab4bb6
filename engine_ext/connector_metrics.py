"""What kvbroker's connector tells a fleet's scorers, on the engine's own ``/metrics``.

A fleet's router (llm-d's endpoint picker, for one) can read an engine's Prometheus series
without code and filter or score endpoints by them (``deploy/llm-d/kvbroker-metrics.yaml``).
These series say how much a decode engine retains for its conversations and how much room its
retention budget has left, so such a router can keep new conversations off engines whose
budget is spent; and how retained KV is used: reads served on D, handles not read on P.

Series (labels ``model_name`` and ``engine``, as vLLM's own):

- ``kvbroker_retained_blocks`` (gauge): KV blocks held for retention now; blocks shared by a
  conversation's turns count once.
- ``kvbroker_retention_budget_free_ratio`` (gauge): ``1 - retained / budget``, the budget
  being ``kvbroker_retention_max_fraction`` of the cache; below 0 when retention is over it
  (pressure releases are then under way). 1 on an engine that has retained nothing yet.
- ``kvbroker_leases_live`` (gauge): retained requests whose lease the registry has not ended
  and whose deadline has not passed.
- ``kvbroker_reads_served_total`` (counter, D): retained requests a prefill node read and D
  then freed (vLLM's NIXL reports them ``finished_sending`` after P's read notification); a
  free for any other cause (the registry ended the lease, the deadline or the hard cap
  passed) is not a read (``engine_ext.pressure.end_cause_of_free`` tells them apart).
- ``kvbroker_reads_declined_total{reason}`` (counter, P): handles P did not read, by the
  verdict that settled them (``engine_ext.verdict``): ``decline`` (the registry refused the
  lease) or ``recompute`` (not worth a read, or the lease could not be checked).
- ``kvbroker_read_blocks{direction}`` and ``kvbroker_read_runs{direction,side}``
  (histograms): the blocks and the runs of consecutive block ids of every NIXL READ the
  engine issued (``engine_ext.fragmentation``): ``d_to_p`` on a prefill engine reading
  retained KV, ``p_to_d`` on a decode engine pulling a prefill leg; ``side`` ``paired`` is
  the READ's descriptors per region, ``source`` and ``destination`` each side's own runs.

How they reach ``/metrics``: the connector runs in vLLM's engine-core process and the API
server serves ``/metrics``, and vLLM's one path between them is its KV connector stats. Every
step the scheduler takes the scheduler-side connector's ``get_kv_connector_stats()``,
aggregates it with the workers' (``KVConnectorStats.aggregate``) and ships ``to_dict()`` to
the API server, which rebuilds it with the connector class's ``build_kv_connector_stats`` (for
its log line) and records it through the class's ``build_prom_metrics``. vLLM's NIXL connector
uses that path for its transfer telemetry, so kvbroker's stats and Prometheus classes extend
NIXL's: one dict carries NIXL's keys and ours, and NIXL's series stay as they are. Gauges
travel as snapshots taken when they change (the newest wins), counters as one entry per event.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from kvbroker.engine_ext import metric_catalog as catalog
from kvbroker.engine_ext.fragmentation import DIRECTIONS, IssuedRead
from kvbroker.engine_ext.pressure import RetainedRequest
from kvbroker.engine_ext.verdict import Verdict
from kvbroker.engine_ext.vllm_compat import (
    KVConnectorStats,
    NixlKVConnectorStats,
    NixlPromMetrics,
    PromMetric,
    PromMetricT,
    VllmConfig,
    create_metric_per_engine,
    unregister_metrics,
)
from kvbroker.v1 import lease_pb2

PREFIX = "kvbroker_"

# The stats' keys. Every value is a list, as NIXL's are, so that NIXL's own aggregation (list
# concatenation) carries ours too: gauge snapshots oldest first, one entry per counted event.
RETAINED_BLOCKS = catalog.RETAINED_BLOCKS.name
BUDGET_FREE_RATIO = catalog.BUDGET_FREE_RATIO.name
LEASES_LIVE = catalog.LEASES_LIVE.name
READS_SERVED = catalog.READS_SERVED.name
READS_DECLINED = catalog.READS_DECLINED.name

# The verdicts that leave a handle unread: the ``reason`` label's values.
DECLINE_REASONS = tuple(v.value for v in Verdict if v not in (Verdict.READ, Verdict.WAIT))


def declined_key(reason: str) -> str:
    """The stats' key counting the handles not read for ``reason``."""
    return f"{READS_DECLINED}.{reason}"


READ_BLOCKS = catalog.READ_BLOCKS.name
READ_RUNS = catalog.READ_RUNS.name
# The ``side`` label's values, and the ReadShape field each is taken from.
RUN_SIDES = {"paired": "runs", "source": "source_runs", "destination": "destination_runs"}


def read_blocks_key(direction: str) -> str:
    """The stats' key listing the blocks of each READ issued in ``direction``."""
    return f"{READ_BLOCKS}.{direction}"


def read_runs_key(direction: str, side: str) -> str:
    """The stats' key listing the runs on ``side`` of each READ issued in ``direction``."""
    return f"{READ_RUNS}.{direction}.{side}"


KEYS = (
    RETAINED_BLOCKS,
    BUDGET_FREE_RATIO,
    LEASES_LIVE,
    READS_SERVED,
    *(declined_key(reason) for reason in DECLINE_REASONS),
    *(read_blocks_key(direction) for direction in DIRECTIONS),
    *(read_runs_key(direction, side) for direction in DIRECTIONS for side in RUN_SIDES),
)


@dataclass(frozen=True, slots=True)
class RetentionGauges:
    """A decode engine's retention at one moment."""

    retained_blocks: int
    budget_free_ratio: float
    leases_live: int


# An engine that has retained nothing: the gauges' value before the first step reports them,
# so that a router filtering on headroom does not shut out a fresh engine.
NOTHING_RETAINED = RetentionGauges(retained_blocks=0, budget_free_ratio=1.0, leases_live=0)


def retention_gauges(
    retained: Iterable[RetainedRequest], budget_blocks: int, now: float
) -> RetentionGauges:
    """The gauges for what the engine retains at ``now`` (``perf_counter``), against a budget
    of ``budget_blocks`` (a budget of 0 has no room at all)."""
    requests = list(retained)
    blocks = len(frozenset().union(*(r.block_ids for r in requests)))
    live = sum(
        r.end_cause == lease_pb2.LEASE_END_CAUSE_UNSPECIFIED and r.deadline > now for r in requests
    )
    ratio = 1.0 - blocks / budget_blocks if budget_blocks > 0 else 0.0
    return RetentionGauges(retained_blocks=blocks, budget_free_ratio=ratio, leases_live=live)


class KvBrokerStats(NixlKVConnectorStats):
    """NIXL's transfer stats with kvbroker's keys beside them."""

    def reset(self) -> None:
        super().reset()
        self.data.update({key: [] for key in KEYS})

    @classmethod
    def of(cls, data: dict[str, Any] | None) -> KvBrokerStats:
        """Stats from a shipped dict, or from a NIXL worker's (which lacks kvbroker's keys)."""
        stats = cls()
        stats.data.update({key: list(values) for key, values in (data or {}).items()})
        return stats

    def is_empty(self) -> bool:
        return bool(super().is_empty()) and not any(self.data[key] for key in KEYS)

    def reduce(self) -> dict[str, int | float]:
        """vLLM's periodic log line: NIXL's summary, then retention now and this interval's
        reads."""
        summary: dict[str, int | float] = dict(super().reduce())
        gauges = self.newest_gauges()
        if gauges is not None:
            summary["Retained blocks"] = gauges.retained_blocks
            summary["Retention budget free"] = round(gauges.budget_free_ratio, 3)
            summary["Leases live"] = gauges.leases_live
        summary["Reads served"] = len(self.data[READS_SERVED])
        summary["Reads declined"] = sum(len(self.data[declined_key(r)]) for r in DECLINE_REASONS)
        for direction in DIRECTIONS:
            blocks = self.data[read_blocks_key(direction)]
            if blocks:
                summary[f"READs {direction}"] = len(blocks)
                summary[f"READ blocks {direction}"] = sum(blocks)
                summary[f"READ runs {direction}"] = sum(
                    self.data[read_runs_key(direction, "paired")]
                )
        return summary

    def newest_gauges(self) -> RetentionGauges | None:
        """The newest snapshot these stats carry, or None."""
        if not self.data[RETAINED_BLOCKS]:
            return None
        return RetentionGauges(
            retained_blocks=int(self.data[RETAINED_BLOCKS][-1]),
            budget_free_ratio=float(self.data[BUDGET_FREE_RATIO][-1]),
            leases_live=int(self.data[LEASES_LIVE][-1]),
        )


def worker_stats(stats: KVConnectorStats | None) -> KvBrokerStats | None:
    """A worker's NIXL stats as kvbroker's: the scheduler aggregates the workers' stats with
    the scheduler side's by the workers' class, and NIXL's would refuse kvbroker's keys."""
    return None if stats is None else KvBrokerStats.of(stats.data)


class MetricsRecorder:
    """The scheduler side's events and retention, until the scheduler takes them as stats."""

    def __init__(self) -> None:
        self._stats = KvBrokerStats()
        self._shipped: RetentionGauges | None = None

    def freed(self, cause: int) -> None:
        """A retained request's blocks were freed, for ``cause`` (a ``LeaseEndCause``)."""
        if cause == lease_pb2.LEASE_END_CAUSE_READ:
            self._stats.data[READS_SERVED].append(1)

    def settled(self, verdict: Verdict) -> None:
        """A remote handle's verdict was settled on the prefill side."""
        if verdict.value in DECLINE_REASONS:
            self._stats.data[declined_key(verdict.value)].append(1)

    def read(self, issued: IssuedRead) -> None:
        """The connector queued a READ of this shape."""
        self._stats.data[read_blocks_key(issued.direction)].append(issued.shape.blocks)
        for side, field in RUN_SIDES.items():
            runs = getattr(issued.shape, field)
            self._stats.data[read_runs_key(issued.direction, side)].append(runs)

    def take(self, gauges: RetentionGauges) -> KvBrokerStats | None:
        """What to ship this step: the events since the last take, and ``gauges`` when they
        differ from those last shipped (always on the first take); None when nothing is new."""
        if gauges != self._shipped:
            self._stats.data[RETAINED_BLOCKS].append(gauges.retained_blocks)
            self._stats.data[BUDGET_FREE_RATIO].append(gauges.budget_free_ratio)
            self._stats.data[LEASES_LIVE].append(gauges.leases_live)
            self._shipped = gauges
        if self._stats.is_empty():
            return None
        taken, self._stats = self._stats, KvBrokerStats()
        return taken


class KvBrokerPromMetrics(NixlPromMetrics):
    """NIXL's Prometheus metrics and kvbroker's, registered in the API server process."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        if self._gauge_cls.__module__.startswith("prometheus_client"):
            unregister_metrics(PREFIX)
        self.retained_blocks = self._gauge(catalog.RETAINED_BLOCKS, labelnames)
        self.budget_free_ratio = self._gauge(catalog.BUDGET_FREE_RATIO, labelnames)
        self.leases_live = self._gauge(catalog.LEASES_LIVE, labelnames)
        counter_cls: Any = self._counter_cls
        served = counter_cls(
            name=READS_SERVED,
            documentation=catalog.READS_SERVED.documentation,
            labelnames=labelnames,
        )
        self.reads_served: dict[int, Any] = create_metric_per_engine(served, per_engine_labelvalues)
        declined = counter_cls(
            name=READS_DECLINED,
            documentation=catalog.READS_DECLINED.documentation,
            labelnames=[*labelnames, *catalog.READS_DECLINED.extra_labels],
        )
        # Every reason from the start, so that a rate over it exists before the first one.
        self.reads_declined: dict[tuple[int, str], Any] = {
            (engine, reason): declined.labels(*values, reason)
            for engine, values in per_engine_labelvalues.items()
            for reason in DECLINE_REASONS
        }
        histogram_cls: Any = self._histogram_cls
        read_blocks = histogram_cls(
            name=READ_BLOCKS,
            documentation=catalog.READ_BLOCKS.documentation,
            labelnames=[*labelnames, *catalog.READ_BLOCKS.extra_labels],
            buckets=list(catalog.READ_SHAPE_BUCKETS),
        )
        read_runs = histogram_cls(
            name=READ_RUNS,
            documentation=catalog.READ_RUNS.documentation,
            labelnames=[*labelnames, *catalog.READ_RUNS.extra_labels],
            buckets=list(catalog.READ_SHAPE_BUCKETS),
        )
        self.read_blocks: dict[tuple[int, str], Any] = {
            (engine, direction): read_blocks.labels(*values, direction)
            for engine, values in per_engine_labelvalues.items()
            for direction in DIRECTIONS
        }
        self.read_runs: dict[tuple[int, str, str], Any] = {
            (engine, direction, side): read_runs.labels(*values, direction, side)
            for engine, values in per_engine_labelvalues.items()
            for direction in DIRECTIONS
            for side in RUN_SIDES
        }
        for engine in per_engine_labelvalues:
            self._set_gauges(engine, NOTHING_RETAINED)

    def _gauge(self, metric: catalog.EngineMetric, labelnames: list[str]) -> dict[int, Any]:
        gauge_cls: Any = self._gauge_cls  # vLLM types the three classes as one union
        gauge = gauge_cls(
            name=metric.name,
            documentation=metric.documentation,
            multiprocess_mode="mostrecent",
            labelnames=labelnames,
        )
        per_engine: dict[int, Any] = create_metric_per_engine(gauge, self.per_engine_labelvalues)
        return per_engine

    def _set_gauges(self, engine: int, gauges: RetentionGauges) -> None:
        self.retained_blocks[engine].set(gauges.retained_blocks)
        self.budget_free_ratio[engine].set(gauges.budget_free_ratio)
        self.leases_live[engine].set(gauges.leases_live)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        stats = KvBrokerStats.of(transfer_stats_data)
        super().observe(stats.data, engine_idx)
        gauges = stats.newest_gauges()
        if gauges is not None:
            self._set_gauges(engine_idx, gauges)
        if stats.data[READS_SERVED]:
            self.reads_served[engine_idx].inc(len(stats.data[READS_SERVED]))
        for reason in DECLINE_REASONS:
            if stats.data[declined_key(reason)]:
                self.reads_declined[engine_idx, reason].inc(len(stats.data[declined_key(reason)]))
        for direction in DIRECTIONS:
            for blocks in stats.data[read_blocks_key(direction)]:
                self.read_blocks[engine_idx, direction].observe(blocks)
            for side in RUN_SIDES:
                for runs in stats.data[read_runs_key(direction, side)]:
                    self.read_runs[engine_idx, direction, side].observe(runs)


class ConnectorMetricsClasses:
    """What vLLM asks the connector's class for, to carry and show kvbroker's series: the
    stats class the scheduler's and workers' stats aggregate into, and the Prometheus
    metrics the API server records them in. Put before vLLM's NIXL connector in the bases."""

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats:
        return KvBrokerStats.of(data)

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KvBrokerPromMetrics:
        return KvBrokerPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
