"""`kvbroker bench registry`: the registry under load, over real gRPC, from its own processes.

Simulated sidecars (many nodes) and routers drive a registry served by `kvbroker registry
serve` in its own process:

1. populate: nodes register, then report retained blocks until the live-lease target;
2. fixed rates: turns at given rates, each a routing hint (claim; concurrent turns' hints share
   BatchGetRoutingHints calls, as the router sends them) plus the decode node's
   retention report (a grant that supersedes the previous lease; one ReportRetention call in
   flight per node, the rest in the next, as its sidecar sends them), and a renewal every
   fourth turn; open loop, so a slow registry cannot slow the load down;
3. saturation: hints from many concurrent callers as fast as they are answered, one
   GetRoutingHint call each and then batched;
4. memory: the registry's RSS as live leases grow, and at each size the prefix index's
   look-ups (MatchPrefix, a fork's match by content) as fast as they are answered;
5. restart: the registry is killed and started again, every node re-registers and replays
   its leases; the time until all are back.

With ``--replicas 1,3`` (on etcd) it measures instead what more replicas answer: dry-run hints
spread over 1, then 3 replicas, every follower answering from its copy of the leader's state
(``run_replica_hints``).
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from kvbroker.common.client.grpc_client import (
    SERVED_BY_METADATA_KEY,
    RegistryEndpoint,
    open_channel,
    registry_stub,
)
from kvbroker.common.client.hint_batcher import HintBatcher
from kvbroker.common.process.tasks import poll_until
from kvbroker.common.rules.checkpoints import probe_blocks
from kvbroker.v1 import node_pb2, registry_pb2
from kvbroker_tools.bench.cpu import cpu_seconds, rss_mib
from kvbroker_tools.bench.registry_report import LoadResult, summarise
from kvbroker_tools.bench.registry_workers import (
    BLOCK_SIZE,
    HINT_RPC,
    fixed_rate_worker,
    paced_hint_worker,
    prefix_worker,
    retained_blocks,
    run_workers,
    saturation_worker,
)
from kvbroker_tools.bench.stats import quantile
from kvbroker_tools.harness.processes import RegistryProcess


def _spec(index: int, role: node_pb2.NodeRole) -> node_pb2.NodeSpec:
    name = "prefill" if role == node_pb2.NODE_ROLE_PREFILL else "decode"
    return node_pb2.NodeSpec(
        node_id=f"{name}-{index}",
        role=role,
        engine_id=f"engine-{name}-{index}",
        side_channel_host="10.0.0.1",
        side_channel_port=5600 + index,
        http_base_url=f"http://10.0.0.1:{8000 + index}",
        model="bench",
        block_size=BLOCK_SIZE,
        capacity_blocks=100_000,
        bytes_per_block=1 << 20,
        incarnation=uuid.uuid4().hex,
    )


# ---------------------------------------------------------------- the registry process


class MeasuredRegistry:
    """The registry under test, in its own process, and what that process uses."""

    def __init__(self, store: str = "memory", *flags: str) -> None:
        self.store = store
        self.process = RegistryProcess(
            "--log-level", "warning", "--session-ttl", "3600", "--heartbeat-interval", "60",
            "--lease-ttl", "3600", "--no-learn-idle-ttl", "--store", store, *flags,
        )  # fmt: skip
        self.address = self.process.address

    async def start(self) -> float:
        """Starts it; returns the seconds until it answered its first call."""
        started = time.perf_counter()
        await self.process.start()
        if self.store != "memory":
            await self._until_leading()
        return time.perf_counter() - started

    async def _until_leading(self, within_s: float = 30) -> None:
        """A replica on etcd serves once it has won the election."""
        async with open_channel(RegistryEndpoint.parse(self.address)) as channel:
            stub = registry_stub(channel)

            async def answers() -> bool:
                await stub.ListNodes(registry_pb2.ListNodesRequest(), timeout=2)
                return True

            await poll_until(answers, within_s, "the registry replica leading", every_s=0.2)

    def cpu_meter(self) -> Callable[[], float]:
        """Starts measuring; the returned call gives the cores the process used since."""
        cpu, started = cpu_seconds(self.process.pid), time.perf_counter()
        return lambda: (cpu_seconds(self.process.pid) - cpu) / (time.perf_counter() - started)

    def rss_mib(self) -> float:
        return rss_mib(self.process.pid)

    async def kill(self) -> None:
        self.process.kill()
        await self.process.wait()


@dataclass
class Fleet:
    decodes: list[node_pb2.NodeSpec]
    prefills: list[node_pb2.NodeSpec]
    # What each decode node retains, as its sidecar would replay it.
    retained: dict[str, list[Any]]

    @classmethod
    def of(cls, nodes: int) -> Fleet:
        """``nodes`` decode and ``nodes`` prefill nodes, none of them retaining anything yet."""
        decodes = [_spec(i, node_pb2.NODE_ROLE_DECODE) for i in range(nodes)]
        prefills = [_spec(i, node_pb2.NODE_ROLE_PREFILL) for i in range(nodes)]
        return cls(decodes, prefills, {n.node_id: [] for n in decodes})


async def _register(stub: Any, fleet: Fleet) -> None:
    for spec in (*fleet.prefills, *fleet.decodes):
        await stub.RegisterNode(registry_pb2.RegisterNodeRequest(spec=spec), timeout=10)


async def _populate(stub: Any, fleet: Fleet, target: int, start: int) -> None:
    """Grants leases until ``target`` are live, in batches of 500 per node report."""
    batch = 500
    index = start
    while index < target:
        node = fleet.decodes[(index // batch) % len(fleet.decodes)]
        count = min(batch, target - index)
        blocks = [
            retained_blocks(f"conv-{index + i}", f"req-{index + i}", node, 32) for i in range(count)
        ]
        events = [registry_pb2.RetentionEvent(sequence=index + i + 1, retained=b)
                  for i, b in enumerate(blocks)]  # fmt: skip
        response = await stub.ReportRetention(
            registry_pb2.ReportRetentionRequest(
                node_id=node.node_id, incarnation=node.incarnation, events=events
            ),
            timeout=60,
        )
        for retained, lease in zip(blocks, response.leases, strict=True):
            retained.lease_id = lease.lease_id
            retained.epoch = lease.epoch
            fleet.retained[node.node_id].append(retained)
        index += count


async def _idle_hints(stub: Any, conversations: int, count: int = 500) -> dict[str, float]:
    """The latency floor: hints one after another on an otherwise idle registry, the round
    trip between two Python processes included (the first 50 warm the channel up)."""
    hints = HintBatcher(stub, timeout_s=5)
    latencies: list[float] = []
    for index in range(count + 50):
        request = registry_pb2.GetRoutingHintRequest(
            conversation_id=f"conv-{index * 13 % conversations}", dry_run=True
        )
        started = time.perf_counter()
        await hints.hint(request)
        latencies.append(time.perf_counter() - started)
    measured = latencies[50:]
    return {
        "p50_ms": 1000 * statistics.median(measured),
        "p99_ms": 1000 * quantile(measured, 0.99, method="rank"),
    }


async def _prefix_lookups(
    registry: MeasuredRegistry, fleet: Fleet, fresh: list[Any], seconds: float
) -> dict[str, Any]:
    """MatchPrefix at saturation from two processes, half of the look-ups the prefixes of
    ``fresh`` leases (granted since the load levels, so none superseded: hits), half random
    (misses)."""
    sample = fresh[:: max(1, len(fresh) // 2_000)]
    probes = [[r.block_hashes[b] for b in probe_blocks(len(r.block_hashes))] for r in sample]
    prefills = [spec.node_id for spec in fleet.prefills]
    cores = registry.cpu_meter()
    outputs = await asyncio.to_thread(
        run_workers, prefix_worker, [(registry.address, prefills, probes, seconds)] * 2
    )
    cpu = cores()
    merged = [x for o in outputs for x in o["latencies"]]
    elapsed = max(o["seconds"] for o in outputs)
    errors = sum(o["errors"] for o in outputs)
    summary = summarise("MatchPrefix", 0, merged, elapsed, errors, cpu)
    return {**asdict(summary), "hit_share": sum(o["hits"] for o in outputs) / max(len(merged), 1)}


async def _grow(
    stub: Any,
    registry: MeasuredRegistry,
    fleet: Fleet,
    points: Sequence[int],
    seconds: float,
    progress: Any,
) -> tuple[list[dict[str, float]], list[dict[str, Any]]]:
    """The registry's RSS at each number of live leases in ``points``, and the prefix index's
    look-ups there."""
    populated = await _live_leases(stub)
    memory: list[dict[str, float]] = [{"live_leases": populated, "rss_mib": registry.rss_mib()}]
    prefix: list[dict[str, Any]] = []
    for point in points:
        progress(f"memory: growing to {point:,} live leases")
        held = {node: len(leases) for node, leases in fleet.retained.items()}
        await _populate(stub, fleet, point, populated)
        populated = point
        memory.append({"live_leases": point, "rss_mib": registry.rss_mib()})
        progress(f"prefix index: MatchPrefix at {point:,} live leases")
        fresh = [r for node, leases in fleet.retained.items() for r in leases[held[node] :]]
        lookups = await _prefix_lookups(registry, fleet, fresh, min(seconds, 5.0))
        prefix.append({"live_leases": point, **lookups})
    return memory, prefix


async def _replay(stub: Any, fleet: Fleet) -> None:
    await _register(stub, fleet)

    async def one(node: node_pb2.NodeSpec) -> None:
        events = [registry_pb2.RetentionEvent(sequence=i + 1, retained=r)
                  for i, r in enumerate(fleet.retained[node.node_id])]  # fmt: skip
        await stub.ReportRetention(
            registry_pb2.ReportRetentionRequest(
                node_id=node.node_id, incarnation=node.incarnation, events=events,
                full_snapshot=True,
            ),
            timeout=600,  # a guard against a hang: a busy machine replays slowly
        )  # fmt: skip

    await asyncio.gather(*(one(node) for node in fleet.decodes))


async def _live_leases(stub: Any) -> int:
    total, token = 0, ""
    while True:
        response = await stub.ListLeases(
            registry_pb2.ListLeasesRequest(page_size=1000, page_token=token), timeout=60
        )
        total += len(response.leases)
        token = response.next_page_token
        if not token:
            return total


async def run_registry_bench(
    rates: Sequence[float] = (250, 500, 1000),
    live_leases: int = 10_000,
    memory_points: Sequence[int] = (100_000, 250_000, 500_000, 1_000_000),
    restart_leases: int = 100_000,
    seconds: float = 10.0,
    nodes: int = 50,
    progress: Any = print,
    store: str = "memory",
    load: bool = True,
) -> dict[str, Any]:
    """With ``store`` an etcd URL the registry runs as a (lone) replica on it: its restart then
    waits out the killed leader's election lease, reloads the nodes from etcd and takes their
    replays (leases are not written there). ``load`` False: no latency levels (idle, fixed
    rates, saturation), only the memory points and the restart."""
    registry = MeasuredRegistry(store)
    await registry.start()
    fleet = Fleet.of(nodes)
    results: list[LoadResult] = []
    try:
        async with open_channel(RegistryEndpoint.parse(registry.address)) as channel:
            stub = registry_stub(channel)
            await _register(stub, fleet)
            progress(f"populating {live_leases:,} live leases over {nodes} decode nodes")
            await _populate(stub, fleet, live_leases, 0)
            idle: dict[str, float] = {}
            if load:
                progress("idle: one hint at a time")
                idle = await _idle_hints(stub, live_leases)
            decodes = [spec.SerializeToString() for spec in fleet.decodes]
            for rate in rates if load else ():
                progress(f"{rate:.0f} turns/s for {seconds:.0f} s")
                # Two load processes share the offered rate, each the sidecar of half the nodes.
                cores = registry.cpu_meter()
                outputs = await asyncio.to_thread(
                    run_workers,
                    fixed_rate_worker,
                    [(registry.address, decodes, live_leases, rate / 2, seconds, seed)
                     for seed in (0, 1)],
                )  # fmt: skip
                cpu = cores()
                for rpc in (HINT_RPC, "ReportRetention", "RenewLease"):
                    merged = [x for o in outputs for x in o["latencies"][rpc]]
                    errors = sum(o["errors"] for o in outputs)
                    elapsed = max(o["seconds"] for o in outputs)
                    results.append(summarise(rpc, rate, merged, elapsed, errors, cpu))
            saturating = ((False, "GetRoutingHint"), (True, HINT_RPC)) if load else ()
            for batched, rpc in saturating:
                progress(f"saturation: {rpc} from 2 processes x 64 callers for {seconds:.0f} s")
                cores = registry.cpu_meter()
                outputs = await asyncio.to_thread(
                    run_workers,
                    saturation_worker,
                    [(registry.address, live_leases, seconds, batched)] * 2,
                )
                cpu = cores()
                merged = [x for o in outputs for x in o["latencies"]]
                elapsed = max(o["seconds"] for o in outputs)
                errors = sum(o["errors"] for o in outputs)
                results.append(summarise(rpc, 0, merged, elapsed, errors, cpu))
            memory, prefix = await _grow(stub, registry, fleet, memory_points, seconds, progress)
        restart: dict[str, float] = {}
        if restart_leases:
            progress(f"restart: kill the registry, replay {restart_leases:,} leases")
            restart = await _restart(registry, fleet, restart_leases)
    finally:
        await registry.process.stop()
    return {
        "idle": idle,
        "load": [asdict(r) for r in results],
        "memory": memory,
        "prefix": prefix,
        "restart": restart,
        "nodes": nodes,
        "hashes_per_lease": 32,
        "store": "etcd" if store != "memory" else "memory",
    }


async def _restart(registry: MeasuredRegistry, fleet: Fleet, leases: int) -> dict[str, float]:
    # Keep `leases` of what the nodes hold (all, if they hold fewer), as evenly as what each
    # holds allows: nodes holding least take their share first, the rest split what is left.
    kept = 0
    by_holding = sorted(fleet.retained.items(), key=lambda item: len(item[1]))
    for left, (node_id, retained) in zip(range(len(by_holding), 0, -1), by_holding, strict=True):
        share = min(len(retained), (leases - kept) // left)
        fleet.retained[node_id] = retained[:share]
        kept += share
    await registry.kill()
    started = time.perf_counter()
    startup = await registry.start()
    async with open_channel(RegistryEndpoint.parse(registry.address)) as channel:
        stub = registry_stub(channel)
        await _replay(stub, fleet)
        recovered = time.perf_counter() - started
        back = await _live_leases(stub)
    return {"leases": kept, "recovered": back, "startup_s": startup, "recovery_s": recovered}


# ---------------------------------------------------------------- hints on every replica


async def run_replica_hints(
    store: str,
    replica_counts: Sequence[int],
    live_leases: int,
    rate: float,
    seconds: float,
    load_processes: int,
    nodes: int = 50,
    progress: Any = print,
) -> dict[str, Any]:
    """Dry-run hints (as a gateway's placement hop asks them) against 1, 3, ... replicas on
    the etcd at ``store``, each configuration under its own key prefix: the first replica
    leads and is populated, the others answer from their copy of its state. For each, hints at
    ``rate`` spread evenly over the replicas (open loop), then at saturation (single calls, then
    batched) from ``load_processes`` load processes (a machine with a core for each replica
    needs more than two to saturate three); the replicas' CPU is their sum."""
    configurations: list[dict[str, Any]] = []
    for count in replica_counts:
        prefix = f"/kvbroker-bench-{count}-{uuid.uuid4().hex[:8]}"
        # A long election TTL: on a busy machine a leader starved for 2 s would lose its term
        # mid-run, and a takeover is not what this measures.
        flags = ("--etcd-prefix", prefix, "--election-ttl", "10")
        replicas = [MeasuredRegistry(store, *flags) for _ in range(count)]
        try:
            progress(f"{count} replica(s): starting, populating {live_leases:,} live leases")
            await replicas[0].start()
            for follower in replicas[1:]:
                await follower.start()
            fleet = Fleet.of(nodes)
            async with open_channel(RegistryEndpoint.parse(replicas[0].address)) as channel:
                stub = registry_stub(channel)
                await _register(stub, fleet)
                await _populate(stub, fleet, live_leases, 0)
            for follower in replicas[1:]:
                await _until_copied(follower.address, live_leases - 1)
            addresses = ",".join(r.address for r in replicas)
            results = []
            progress(f"{count} replica(s): {rate:.0f} dry-run hints/s for {seconds:.0f} s")
            cores = _cpu_of(replicas)
            outputs = await asyncio.to_thread(
                run_workers,
                paced_hint_worker,
                [
                    (addresses, live_leases, rate / load_processes, seconds, seed)
                    for seed in range(load_processes)
                ],
            )
            results.append(_summed("GetRoutingHint", rate, outputs, cores()))
            answered = sum(o["answered_there"] for o in outputs)
            answered_there = answered / max(sum(len(o["latencies"]) for o in outputs), 1)
            for batched, rpc in ((False, "GetRoutingHint"), (True, HINT_RPC)):
                progress(
                    f"{count} replica(s): saturation, {rpc} from {load_processes} processes x 64 "
                    "callers"
                )
                cores = _cpu_of(replicas)
                outputs = await asyncio.to_thread(
                    run_workers,
                    saturation_worker,
                    [(addresses, live_leases, seconds, batched)] * load_processes,
                )
                results.append(_summed(rpc, 0, outputs, cores()))
            configurations.append(
                {
                    "replicas": count,
                    "load": [asdict(r) for r in results],
                    # Of the paced hints, the share the replica asked answered itself.
                    "answered_there": answered_there,
                }
            )
        finally:
            for replica in replicas:
                await replica.process.stop()
    return {
        "configurations": configurations,
        "live_leases": live_leases,
        "nodes": nodes,
        "seconds": seconds,
        "cores": os.cpu_count(),
        "load_processes": load_processes,
    }


async def _until_copied(address: str, conversation: int, within_s: float = 60) -> None:
    """A follower answers ``conv-N`` from its copy of the leader's state (the last lease
    populated, so the copy is whole)."""
    async with open_channel(RegistryEndpoint.parse(address)) as channel:
        stub = registry_stub(channel)
        request = registry_pb2.GetRoutingHintRequest(
            conversation_id=f"conv-{conversation}", dry_run=True
        )

        async def copied() -> bool:
            call = stub.GetRoutingHint(request, timeout=5)
            hint = (await call).hint
            served_by = dict(await call.trailing_metadata() or ()).get(SERVED_BY_METADATA_KEY)
            return served_by == address and hint.decision == registry_pb2.HINT_DECISION_REUSE

        await poll_until(copied, within_s, "the follower's copy of the leader's state", every_s=0.2)


def _cpu_of(replicas: Sequence[MeasuredRegistry]) -> Callable[[], float]:
    meters = [replica.cpu_meter() for replica in replicas]
    return lambda: sum(meter() for meter in meters)


def _summed(rpc: str, rate: float, outputs: list[dict[str, Any]], cpu: float) -> LoadResult:
    merged = [x for o in outputs for x in o["latencies"]]
    elapsed = max(o["seconds"] for o in outputs)
    errors = sum(o["errors"] for o in outputs)
    return summarise(rpc, rate, merged, elapsed, errors, cpu)
