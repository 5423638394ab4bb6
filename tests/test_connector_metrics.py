"""The connector's metrics on their way to ``/metrics``: the retention gauges, the events the
scheduler side counts, the stats vLLM aggregates with NIXL's workers' and ships to the API
server, and the Prometheus series built there (vLLM's own prometheus_client registry). A
declined lease in vLLM's real scheduler is counted by its verdict."""

from __future__ import annotations

from typing import Any, cast

import pytest
from prometheus_client import REGISTRY, Counter, Gauge, Histogram
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.metrics.prometheus import unregister_vllm_metrics

from kvbroker.common.client.engine_link import LeaseAnswer
from kvbroker.engine_ext.connector import NixlConnector
from kvbroker.engine_ext.connector_metrics import (
    KEYS,
    KvBrokerPromMetrics,
    KvBrokerStats,
    MetricsRecorder,
    RetentionGauges,
    declined_key,
    retention_gauges,
    worker_stats,
)
from kvbroker.engine_ext.pressure import RetainedRequest
from kvbroker.engine_ext.verdict import Verdict
from kvbroker.engine_ext.vllm_compat import NixlKVConnectorStats, VllmConfig
from kvbroker.v1 import lease_pb2
from tests.test_connector_scheduler import (  # noqa: F401 - fixtures
    FakeLeaseLink,
    link,
    prompt,
    request_with_handle,
    scheduler,
    vllm_config,
)

LABELS = {"model_name": "m", "engine": "0"}


def retained(request_id: str, blocks: range, deadline: float = 100.0) -> RetainedRequest:
    return RetainedRequest(
        request_id=request_id,
        tokens=16 * len(blocks),
        block_ids=frozenset(blocks),
        hard_cap=200.0,
        deadline=deadline,
        last_active=0.0,
        ttl_s=30.0,
    )


def test_retention_gauges_count_shared_blocks_once_and_only_live_leases() -> None:
    turn1, turn2 = retained("t1", range(0, 6)), retained("t2", range(0, 10))
    ended = retained("ended", range(20, 22))
    ended.end_cause = lease_pb2.LEASE_END_CAUSE_SUPERSEDED
    due = retained("due", range(30, 32), deadline=9.0)

    gauges = retention_gauges([turn1, turn2, ended, due], budget_blocks=40, now=10.0)

    assert gauges == RetentionGauges(retained_blocks=14, budget_free_ratio=0.65, leases_live=2)
    assert retention_gauges([], 40, 10.0) == RetentionGauges(0, 1.0, 0)
    assert retention_gauges([turn2], 5, 10.0).budget_free_ratio == -1.0  # over its budget
    assert retention_gauges([], 0, 10.0).budget_free_ratio == 0.0  # a budget with no room


def test_the_recorder_counts_reads_and_unread_handles_and_ships_gauges_that_changed() -> None:
    recorder = MetricsRecorder()
    gauges = RetentionGauges(retained_blocks=4, budget_free_ratio=0.5, leases_live=1)

    first = recorder.take(gauges)
    assert first is not None  # the first step always says where retention stands
    assert first.newest_gauges() == gauges
    assert recorder.take(gauges) is None  # nothing new

    recorder.freed(lease_pb2.LEASE_END_CAUSE_READ)
    recorder.freed(lease_pb2.LEASE_END_CAUSE_IDLE)  # a free at expiry is not a read
    recorder.freed(lease_pb2.LEASE_END_CAUSE_SUPERSEDED)
    recorder.settled(Verdict.READ)
    recorder.settled(Verdict.DECLINE)
    recorder.settled(Verdict.RECOMPUTE)
    recorder.settled(Verdict.RECOMPUTE)
    taken = recorder.take(gauges)
    assert taken is not None
    assert taken.newest_gauges() is None  # unchanged gauges are not shipped again
    assert taken.data["kvbroker_reads_served"] == [1]
    assert taken.data[declined_key("decline")] == [1]
    assert taken.data[declined_key("recompute")] == [1, 1]

    fewer = RetentionGauges(retained_blocks=0, budget_free_ratio=1.0, leases_live=0)
    changed = recorder.take(fewer)
    assert changed is not None and changed.newest_gauges() == fewer


def test_stats_aggregate_with_a_nixl_workers_and_survive_the_trip_to_the_api_server() -> None:
    recorder = MetricsRecorder()
    recorder.freed(lease_pb2.LEASE_END_CAUSE_READ)
    scheduler_side = recorder.take(RetentionGauges(8, 0.75, 2))
    assert scheduler_side is not None
    nixl = NixlKVConnectorStats()
    nixl.record_failed_transfer()
    workers = worker_stats(nixl)
    assert workers is not None and worker_stats(None) is None

    # As vLLM's scheduler does: the workers' stats first, then the scheduler side's.
    aggregated = workers.aggregate(scheduler_side)
    shipped = aggregated.to_dict()
    assert set(KEYS) <= set(shipped)
    assert shipped["num_failed_transfers"] == [1]

    # The API server rebuilds them from the connector class for its periodic log line.
    rebuilt = NixlConnector.build_kv_connector_stats(shipped)
    assert isinstance(rebuilt, KvBrokerStats) and not rebuilt.is_empty()
    summary = rebuilt.reduce()
    assert summary["Retained blocks"] == 8
    assert summary["Reads served"] == 1
    assert summary["Num failed transfers"] == 1
    assert NixlConnector.build_kv_connector_stats(None).is_empty()


def value(name: str, **labels: str) -> float | None:
    return REGISTRY.get_sample_value(name, {**LABELS, **labels})


def build_prom() -> KvBrokerPromMetrics:
    """The connector's metrics as vLLM's API server builds them, in its default registry."""
    unregister_vllm_metrics()  # as vLLM's stat logger does before it registers its own
    metric_types: Any = {Gauge: Gauge, Counter: Counter, Histogram: Histogram}
    return NixlConnector.build_prom_metrics(
        cast(VllmConfig, type("Config", (), {"kv_transfer_config": None})()),
        metric_types,
        ["model_name", "engine"],
        {0: ["m", "0"]},
    )


@pytest.fixture
def prom() -> KvBrokerPromMetrics:
    return build_prom()


def test_prometheus_series_start_with_full_headroom_and_record_what_is_shipped(
    prom: KvBrokerPromMetrics,
) -> None:
    assert value("kvbroker_retention_budget_free_ratio") == 1.0  # a fresh engine has room
    assert value("kvbroker_retained_blocks") == 0.0
    assert value("kvbroker_reads_declined_total", reason="decline") == 0.0
    assert value("kvbroker_reads_declined_total", reason="recompute") == 0.0

    recorder = MetricsRecorder()
    recorder.take(RetentionGauges(3, 0.9, 1))
    recorder.freed(lease_pb2.LEASE_END_CAUSE_READ)
    recorder.settled(Verdict.DECLINE)
    nixl = NixlKVConnectorStats()
    nixl.record_failed_transfer()
    worker = worker_stats(nixl)
    assert worker is not None
    older = recorder.take(RetentionGauges(5, 0.8, 2))
    assert older is not None
    data: dict[str, Any] = worker.aggregate(older).to_dict()
    prom.observe(data, 0)
    prom.observe(KvBrokerStats.of({"num_failed_transfers": [1]}).to_dict(), 0)

    assert value("kvbroker_retained_blocks") == 5.0  # the newest snapshot
    assert value("kvbroker_retention_budget_free_ratio") == 0.8
    assert value("kvbroker_leases_live") == 2.0
    assert value("kvbroker_reads_served_total") == 1.0
    assert value("kvbroker_reads_declined_total", reason="decline") == 1.0
    assert value("vllm:nixl_num_failed_transfers_total") == 2.0  # NIXL's own, unchanged


def test_building_the_metrics_again_in_one_process_replaces_them(
    prom: KvBrokerPromMetrics,
) -> None:
    prom.observe(KvBrokerStats.of({"kvbroker_reads_served": [1, 1]}).to_dict(), 0)
    build_prom()
    assert value("kvbroker_reads_served_total") == 0.0


def test_a_declined_lease_in_the_real_scheduler_is_counted_by_its_verdict(
    scheduler: Scheduler,  # noqa: F811
    link: FakeLeaseLink,  # noqa: F811
) -> None:
    connector = scheduler.connector
    assert isinstance(connector, NixlConnector)
    connector.get_kv_connector_stats()  # the first step's gauges
    declined = request_with_handle("r-declined", prompt(), remote_tokens=192, verified_tokens=192)
    short = request_with_handle("r-short", prompt(), remote_tokens=192, verified_tokens=48)
    scheduler.add_request(declined)
    scheduler.schedule()
    assert connector.get_kv_connector_stats() is None  # in flight: nothing settled yet

    link.checks[0][2].set_result(LeaseAnswer(False, "lease superseded"))
    scheduler.add_request(short)
    scheduler.schedule()

    stats = connector.get_kv_connector_stats()
    assert isinstance(stats, KvBrokerStats)
    assert stats.data[declined_key("decline")] == [1]
    assert stats.data[declined_key("recompute")] == [1]  # below the recompute threshold
