"""`kvbroker bench registry --etcd --hint-sources`: a dry-run hint (a placement hop's) answered
by each of the three places that can answer one: the leader, a follower from its copy of the
leader's state, and a router from its own copy (``router.local_hints``, fed by the follower),
each at a paced rate (latency) and as fast as it answers (hints per core of the process that
answers them).

The leader and the follower answer over gRPC from their own processes, asked by two load
processes (batched at saturation, as a router sends them); the router's copy answers in the
process that holds it, one load process of its own that keeps the copy watched meanwhile, as a
router does. Every latency is from a hint's call to its answer (the gRPC ones' include both
processes' gRPC work and loopback, the router's copy's only the rule and the copy).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from pathlib import Path
from typing import Any

import uvloop

from kvbroker.common.client.grpc_client import RegistryEndpoint, open_channel, registry_stub
from kvbroker.common.process.tasks import poll_until
from kvbroker.router.local_hints import HintSource, LocalHints
from kvbroker.router.metrics import RouterMetrics
from kvbroker.v1 import registry_pb2
from kvbroker_tools.bench.plotting import ready_plotting, save_figure
from kvbroker_tools.bench.registry_load import (
    Fleet,
    MeasuredRegistry,
    _populate,
    _register,
    _summed,
    _until_copied,
)
from kvbroker_tools.bench.registry_report import summarise
from kvbroker_tools.bench.registry_workers import (
    HINT_RPC,
    paced_hint_worker,
    run_workers,
    saturation_worker,
)

SOURCES = ("leader", "follower", "router cache")


async def run_hint_sources(
    store: str,
    live_leases: int = 10_000,
    rate: float = 1000.0,
    seconds: float = 10.0,
    nodes: int = 50,
    progress: Any = print,
) -> dict[str, Any]:
    """A leader and a follower on the etcd at ``store``, ``live_leases`` populated through the
    leader; then each source paced at ``rate`` and at saturation."""
    flags = ("--etcd-prefix", f"/kvbroker-bench-sources-{uuid.uuid4().hex[:8]}")
    # A long election TTL: a leader starved for 2 s on a busy machine would lose its term.
    leader, follower = (MeasuredRegistry(store, *flags, "--election-ttl", "10") for _ in "ab")
    rows: list[dict[str, Any]] = []
    try:
        progress(f"leader and follower: starting, populating {live_leases:,} live leases")
        await leader.start()
        await follower.start()
        fleet = Fleet.of(nodes)
        async with open_channel(RegistryEndpoint.parse(leader.address)) as channel:
            stub = registry_stub(channel)
            await _register(stub, fleet)
            await _populate(stub, fleet, live_leases, 0)
        await _until_copied(follower.address, live_leases - 1)
        for source, replica in (("leader", leader), ("follower", follower)):
            progress(f"{source}: {rate:.0f} dry-run hints/s for {seconds:.0f} s")
            cores = replica.cpu_meter()
            outputs = await asyncio.to_thread(
                run_workers,
                paced_hint_worker,
                [(replica.address, live_leases, rate / 2, seconds, seed) for seed in (0, 1)],
            )
            rows.append(_row(source, _summed("GetRoutingHint", rate, outputs, cores())))
            progress(f"{source}: saturation, {HINT_RPC} from 2 processes x 64 callers")
            cores = replica.cpu_meter()
            outputs = await asyncio.to_thread(
                run_workers,
                saturation_worker,
                [(replica.address, live_leases, seconds, True)] * 2,
            )
            rows.append(_row(source, _summed(HINT_RPC, 0, outputs, cores())))
        progress(f"router cache (fed by the follower): {rate:.0f} hints/s, then saturation")
        (cached,) = await asyncio.to_thread(
            run_workers, router_cache_worker, [(follower.address, live_leases, rate, seconds)]
        )
        rows += cached["rows"]
    finally:
        for replica in (leader, follower):
            await replica.process.stop()
    return {
        "rows": rows,
        "live_leases": live_leases,
        "nodes": nodes,
        "seconds": seconds,
        "cores": os.cpu_count(),
        "load_average": os.getloadavg(),
    }


def _row(source: str, result: Any) -> dict[str, Any]:
    row = {"source": source, **result.__dict__}
    row["per_core"] = result.throughput / result.registry_cpu if result.registry_cpu else 0.0
    return row


def router_cache_worker(
    address: str, conversations: int, rate: float, seconds: float, out: Any
) -> None:
    out.put(uvloop.run(_router_cache(address, conversations, rate, seconds)))


async def _router_cache(
    address: str, conversations: int, rate: float, seconds: float
) -> dict[str, Any]:
    """A router's copy watched from ``address``; once whole, hints from it at ``rate``, then
    as fast as they come (hints per CPU second of this process, the watch's share included:
    the loop yields to it every 64 hints). Each hint is timed from its call, as the gRPC
    load processes time theirs."""
    hints = LocalHints(1.0, RouterMetrics())
    async with open_channel(RegistryEndpoint.parse(address)) as channel:
        hints.start(registry_stub(channel))
        last = registry_pb2.GetRoutingHintRequest(
            conversation_id=f"conv-{conversations - 1}", dry_run=True
        )

        async def whole() -> bool:
            hint, source = hints.answer(last)
            return source is HintSource.LOCAL and hint is not None and hint.lease.epoch > 0

        await poll_until(whole, 60, "the router's copy of the leader's state", every_s=0.2)
        requests = [
            registry_pb2.GetRoutingHintRequest(conversation_id=f"conv-{i}", dry_run=True)
            for i in range(conversations)
        ]
        latencies: list[float] = []
        errors = 0
        cpu, start = time.process_time(), time.perf_counter()
        for index in range(int(rate * seconds)):
            due = start + index / rate
            delay = due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            began = time.perf_counter()
            hint, _ = hints.answer(requests[(index * 7919) % conversations])
            latencies.append(time.perf_counter() - began)
            errors += hint is None
        elapsed = time.perf_counter() - start
        paced = summarise("in process", rate, latencies, elapsed, errors, _cores(cpu, start))
        latencies, errors = [], 0
        cpu, start = time.process_time(), time.perf_counter()
        index = 0
        while time.perf_counter() - start < seconds:
            began = time.perf_counter()
            hint, _ = hints.answer(requests[(index * 97) % conversations])
            latencies.append(time.perf_counter() - began)
            errors += hint is None
            index += 1
            if index % 64 == 0:
                await asyncio.sleep(0)
        elapsed = time.perf_counter() - start
        saturated = summarise("in process", 0, latencies, elapsed, errors, _cores(cpu, start))
        await hints.close()
    return {"rows": [_row("router cache", paced), _row("router cache", saturated)]}


def _cores(cpu: float, start: float) -> float:
    """This process's CPU since ``cpu``, in cores over the time since ``start``."""
    return (time.process_time() - cpu) / (time.perf_counter() - start)


def write_sources(report: dict[str, Any], output: Path) -> list[Path]:
    """registry_hint_sources.json, and its plot: p50/p99 at the paced rate and hints per core
    at saturation, per source."""
    output.mkdir(parents=True, exist_ok=True)
    data = output / "registry_hint_sources.json"
    data.write_text(json.dumps(report, indent=2))
    ready_plotting()
    import matplotlib.pyplot as plt

    rows = report["rows"]
    paced = [next(r for r in rows if r["source"] == s and r["rate"] > 0) for s in SOURCES]
    saturated = [next(r for r in rows if r["source"] == s and r["rate"] == 0) for s in SOURCES]
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 4))
    width = 0.38
    for offset, key in ((-width / 2, "p50_ms"), (width / 2, "p99_ms")):
        positions = [i + offset for i in range(len(paced))]
        left.bar(positions, [r[key] for r in paced], width, label=key.replace("_ms", ""))
    left.axhline(1.0, color="grey", linestyle="--", label="target p99")
    left.set_xticks(range(len(SOURCES)), SOURCES)
    left.set_ylabel(f"latency at {paced[0]['rate']:.0f} hints/s (ms, log scale)")
    left.set_yscale("log")
    left.legend(fontsize=8)
    left.grid(alpha=0.3, axis="y")
    right.bar(range(len(saturated)), [r["per_core"] for r in saturated], 0.6)
    right.axhline(20_000, color="grey", linestyle="--", label="target")
    right.set_xticks(range(len(SOURCES)), SOURCES)
    right.set_ylabel("dry-run hints per core at saturation")
    right.legend(fontsize=8)
    right.grid(alpha=0.3, axis="y")
    fig.suptitle("Dry-run hints by who answers them (etcd, gRPC on loopback)")
    path = save_figure(fig, output / "registry_hint_sources.png")
    return [data, path]
