"""`kvbroker bench registry`, shrunk: its own registry and load processes over real gRPC."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvbroker.common.process.local_etcd import LocalEtcd
from kvbroker_tools.bench.registry_load import run_registry_bench, run_replica_hints
from kvbroker_tools.bench.registry_report import write, write_replicas
from kvbroker_tools.bench.registry_workers import HINT_RPC


async def test_a_small_registry_bench_runs_and_reports_every_figure(tmp_path: Path) -> None:
    report = await run_registry_bench(
        rates=(40,),
        live_leases=400,
        memory_points=(800,),
        restart_leases=400,
        seconds=2,
        nodes=4,
        progress=lambda message: None,
    )
    assert 0 < report["idle"]["p50_ms"] <= report["idle"]["p99_ms"]
    rows = {(row["rpc"], row["rate"]): row for row in report["load"]}
    for rpc in (HINT_RPC, "ReportRetention", "RenewLease"):
        row = rows[(rpc, 40)]
        assert row["errors"] == 0
        assert row["throughput"] > 0 and 0 < row["p50_ms"] <= row["p99_ms"]
        assert 0 < row["registry_cpu"] < 2  # one process, on a machine of 2 cores or more
    assert rows[(HINT_RPC, 40)]["throughput"] >= 30  # the offered 40 turns/s were answered
    for rpc in ("GetRoutingHint", HINT_RPC):
        assert rows[(rpc, 0)]["throughput"] > 100 and rows[(rpc, 0)]["errors"] == 0
    assert [point["live_leases"] for point in report["memory"]] == [400, 800]
    assert all(point["rss_mib"] > 10 for point in report["memory"])
    # The prefix index, at the one memory point: every look-up answered, half of them a fork
    # of a live lease (a hit), half random hashes (a miss).
    (lookups,) = report["prefix"]
    assert lookups["live_leases"] == 800 and lookups["errors"] == 0
    assert lookups["throughput"] > 100 and 0 < lookups["p50_ms"] <= lookups["p99_ms"]
    assert 0.45 <= lookups["hit_share"] <= 0.55
    restart = report["restart"]
    assert restart["leases"] == restart["recovered"] == 400
    assert restart["recovery_s"] > restart["startup_s"] > 0

    paths = write(report, tmp_path)
    assert [path.name for path in paths] == [
        "registry.json", "registry_latency.png", "registry_memory.png"
    ]  # fmt: skip
    assert json.loads(paths[0].read_text())["load"] == report["load"]
    assert all(path.stat().st_size > 10_000 for path in paths[1:])  # the plots


@pytest.mark.etcd
async def test_dry_run_hints_over_replicas_are_answered_where_asked(
    etcd: LocalEtcd, tmp_path: Path
) -> None:
    """`--replicas 1,2 --load-processes 1`, shrunk, on a real etcd: every hint answered, by
    the replica it was sent to (the follower from its copy of the leader's state), and the
    figures written."""
    report = await run_replica_hints(
        etcd.url,
        (1, 2),
        live_leases=200,
        rate=40,
        seconds=2,
        nodes=4,
        progress=lambda _: None,
        load_processes=1,
    )
    assert [c["replicas"] for c in report["configurations"]] == [1, 2]
    assert report["load_processes"] == 1
    for configuration in report["configurations"]:
        assert configuration["answered_there"] == 1.0
        rows = {(row["rpc"], row["rate"]): row for row in configuration["load"]}
        assert rows[("GetRoutingHint", 40)]["throughput"] >= 30
        for rpc, rate in (("GetRoutingHint", 40), ("GetRoutingHint", 0), (HINT_RPC, 0)):
            row = rows[(rpc, rate)]
            assert row["errors"] == 0 and 0 < row["p50_ms"] <= row["p99_ms"]
            assert row["registry_cpu"] > 0
    paths = write_replicas(report, tmp_path)
    assert json.loads(paths[0].read_text()) == report
    assert paths[1].stat().st_size > 10_000  # the plot


async def test_without_load_the_bench_measures_memory_and_restart_only(tmp_path: Path) -> None:
    """--no-load: no latency levels, and the memory plot drawn beside an earlier run's."""
    report = await run_registry_bench(
        live_leases=200,
        memory_points=(400,),
        restart_leases=200,
        nodes=2,
        progress=lambda message: None,
        load=False,
    )
    assert report["idle"] == {} and report["load"] == []
    assert [point["live_leases"] for point in report["memory"]] == [200, 400]
    assert report["restart"]["leases"] == report["restart"]["recovered"] == 200
    alone = write(report, tmp_path / "alone")
    earlier = {**report, "memory": [{**p, "rss_mib": 2 * p["rss_mib"]} for p in report["memory"]]}
    beside = write(report, tmp_path / "beside", baseline=earlier)
    assert [path.name for path in beside] == ["registry.json", "registry_memory.png"]
    # The baseline's curve and legend entry make the picture larger than the run's alone.
    assert beside[1].stat().st_size > alone[1].stat().st_size


@pytest.mark.etcd
async def test_over_etcd_the_restart_waits_out_the_election_and_takes_the_replays(
    etcd: LocalEtcd,
) -> None:
    """`--etcd --no-load`, shrunk: the killed replica is started again on the same etcd, wins
    the election once the dead leader's key expires, and every replayed lease is back."""
    report = await run_registry_bench(
        live_leases=200,
        memory_points=(),
        restart_leases=200,
        nodes=2,
        progress=lambda message: None,
        store=etcd.url,
        load=False,
    )
    assert report["store"] == "etcd" and report["load"] == []
    restart = report["restart"]
    assert restart["leases"] == restart["recovered"] == 200
    assert restart["recovery_s"] > restart["startup_s"] > 0
