"""`kvbroker bench fleet`: the control plane at fleet scale, on its real parts.

For each fleet size (half prefill, half decode nodes) a fresh etcd and registry replicas on it
(`kvbroker registry serve --store etcd://…`, each its own process) serve what a fleet's
sidecars and routers send them, over gRPC on loopback, the engines simulated:

* every node registers, replays its (empty) retention and heartbeats as a sidecar does;
* the conversations live at the start are already some turns in: their decode nodes report
  what they retain, as a sidecar replays it;
* then turns of the generated agentic trace (``fleet_trace``) at a fixed offered rate, open
  loop: the router's hint (batched, as the router sends them, spread over the replicas), the
  prefill node's fence before a READ (GetLease, as its sidecar checks), a sub-agent's look-up
  by content (MatchPrefix, then EndReadPin), and the decode node's retention report with what
  its engine frees: after a READ, to stay within its retention budget (least recently used
  first), when the conversation ends.

Each simulated decode engine keeps what it retains within its budget, so a hint can be
checked against what the engines really held. Leases do not expire during a run (the trace's
clock only orders the turns): what ends them is the engines' budget, reads and ends.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc

from kvbroker.common.client.grpc_client import (
    RegistryEndpoint,
    open_channel,
    registry_stub,
    replica_away,
)
from kvbroker.common.client.hint_batcher import HintBatcher
from kvbroker.common.process.local_etcd import LocalEtcd
from kvbroker.common.process.tasks import poll_until
from kvbroker.common.rules.checkpoints import checkpoint_blocks, probe_blocks, stride_for
from kvbroker.common.rules.routing import read_refusal
from kvbroker.v1 import lease_pb2, node_pb2, registry_pb2
from kvbroker_tools.bench.cpu import cpu_seconds, rss_mib
from kvbroker_tools.bench.fleet_config import FleetConfig
from kvbroker_tools.bench.fleet_engines import (
    BLOCK_SIZE,
    MODEL,
    Engines,
    SimDecode,
    Tally,
    node_spec,
)
from kvbroker_tools.bench.fleet_heartbeats import HeartbeatProcess
from kvbroker_tools.bench.fleet_report import FleetPoint, point_of
from kvbroker_tools.bench.fleet_trace import FleetTrace, Turn
from kvbroker_tools.harness.processes import RegistryProcess

REUSE_PATHS = (registry_pb2.TURN_PATH_READ, registry_pb2.TURN_PATH_DECODE_LOCAL)
# How long a hint's claim protects a lease for its read. A new leader protects every lease
# this long from its start (a claim its predecessor made may be in flight), answering an
# engine's reclaim with "keep": the run waits that out before the engines retain anything, so
# that what they reclaim is freed at once and their record of what they hold stays true.
CLAIM_TIMEOUT_S = 10.0
SIDECAR_ATTEMPTS = 10
# Each engine's replay of what it holds: its retained events, as its sidecar reports them.
Replays = list[tuple[SimDecode, list[registry_pb2.RetentionEvent]]]


class FleetRun:
    """One fleet size: its etcd, replicas, simulated nodes and routers."""

    def __init__(self, config: FleetConfig, nodes: int, workdir: Path) -> None:
        self.config, self.workdir = config, workdir
        self.tally = Tally()
        half = nodes // 2
        self.prefills = [node_spec(i, node_pb2.NODE_ROLE_PREFILL, config.capacity_blocks)
                         for i in range(nodes - half)]  # fmt: skip
        self.decode_specs = [node_spec(i, node_pb2.NODE_ROLE_DECODE, config.capacity_blocks)
                             for i in range(half)]  # fmt: skip
        self.trace = FleetTrace(config.trace, nodes, BLOCK_SIZE)
        self.etcd = LocalEtcd(workdir)
        beat, session = config.heartbeat_interval_s, config.session_ttl_s
        flags = ["--log-level", "warning", "--heartbeat-interval", str(beat),
                 "--session-ttl", str(session), "--lease-ttl", "3600", "--max-lease-ttl",
                 "3600", "--no-learn-idle-ttl", "--election-ttl", "15",
                 "--claim-timeout", str(CLAIM_TIMEOUT_S)]  # fmt: skip
        self.replicas = [
            RegistryProcess(
                "--store",
                self.etcd.url,
                *flags,
                name=f"registry-{i}",
                log=workdir / f"registry-{i}.log",
            )
            for i in range(config.replicas)
        ]
        self.engines = Engines()
        self.pending: dict[str, asyncio.Task[None]] = {}
        self.heartbeats: HeartbeatProcess | None = None  # once the replicas answer
        self.decodes: dict[str, SimDecode] = {}  # once the sidecars' channel is open

    async def run(self, progress: Callable[[str], None]) -> FleetPoint:
        await self.etcd.start()
        try:
            for replica in self.replicas:
                await replica.start()
            return await self._drive(progress)
        finally:
            for replica in self.replicas:
                await replica.stop()
            await self.etcd.stop()

    async def _drive(self, progress: Callable[[str], None]) -> FleetPoint:
        addresses = [r.address for r in self.replicas]
        # Sidecars list the replicas in order; each router starts at another (hints spread).
        rotations = [",".join(addresses[i:] + addresses[:i]) for i in range(len(addresses))]
        sidecars = open_channel(RegistryEndpoint.parse(rotations[0]))
        routers = [open_channel(RegistryEndpoint.parse(spec)) for spec in rotations]
        usage: asyncio.Task[None] | None = None
        try:
            stub = registry_stub(sidecars)
            await poll_until(lambda: _answers(stub), 60, "a registry replica leading", every_s=0.2)
            await asyncio.sleep(CLAIM_TIMEOUT_S + 0.5)  # see CLAIM_TIMEOUT_S
            budget = int(self.config.capacity_blocks * self.config.retention_share)
            for spec in self.decode_specs:
                self.decodes[spec.node_id] = SimDecode(spec, budget, stub, self.tally, self.engines)
            nodes = len(self.prefills) + len(self.decodes)
            progress(f"{nodes} nodes: registering, {len(self.trace.live):,} live conversations")
            # Heartbeats from each node's registration on, as its sidecar sends them.
            self.heartbeats = HeartbeatProcess(
                rotations[0], [*self.prefills, *self.decode_specs], self.config.heartbeat_interval_s
            )
            await self.heartbeats.started()
            usage = asyncio.create_task(self._usage(self.heartbeats))
            started = time.perf_counter()
            await _bounded([self._register(stub, s) for s in (*self.prefills, *self.decode_specs)])
            registered_s = time.perf_counter() - started
            progress(f"{nodes} nodes: registered in {registered_s:.1f} s; the engines replay")
            # Built before the clock starts: the replay's time is the registry's, not the
            # bench's own build of 30k events (over 10 s at 1,000 nodes).
            replays = self._retain()
            started = time.perf_counter()
            await self._replay(stub, replays)
            populated_s = time.perf_counter() - started
            hints = [HintBatcher(registry_stub(c), timeout_s=10) for c in routers]
            progress(
                f"{nodes} nodes: {self.config.rate:.0f} turns/s for {self.config.seconds:.0f} s"
            )
            measured = await self._turns(stub, hints)
            seconds = self.config.saturation_s
            progress(f"{nodes} nodes: hints alone, as fast as answered, for {seconds:.0f} s")
            saturated = await self._saturate(hints, seconds)
            rss = [rss_mib(r.pid) for r in self.replicas]
        finally:
            if usage is not None:
                usage.cancel()
                await asyncio.gather(usage, return_exceptions=True)
            if self.heartbeats is not None:
                self.tally.heartbeats = await self.heartbeats.stop()
            for channel in (sidecars, *routers):
                await channel.close()
        return point_of(
            self.config, nodes, self.tally, measured, saturated, rss, registered_s, populated_s
        )

    async def _register(self, stub: Any, spec: node_pb2.NodeSpec) -> None:
        registration = registry_pb2.RegisterNodeRequest(spec=spec)
        await _again_if_away(lambda: stub.RegisterNode(registration, timeout=30), self.tally)
        replay = registry_pb2.ReportRetentionRequest(
            node_id=spec.node_id, incarnation=spec.incarnation, full_snapshot=True
        )
        await _again_if_away(lambda: stub.ReportRetention(replay, timeout=30), self.tally)
        assert self.heartbeats is not None  # started before the nodes register
        self.heartbeats.registered(spec.node_id)

    async def _usage(self, heartbeats: HeartbeatProcess) -> None:
        """Each decode engine's KV-cache usage to the heartbeat process, once an interval, for
        the load its heartbeats report."""
        capacity = self.config.capacity_blocks
        while True:
            heartbeats.usage({n: d.used / capacity for n, d in self.decodes.items()})
            await asyncio.sleep(self.config.heartbeat_interval_s)

    def _retain(self) -> Replays:
        """The conversations already some turns in, retained on the decode nodes in turn (each
        engine keeping what its budget allows); each engine's replay of what it holds."""
        decodes = list(self.decodes.values())
        in_progress = [c for c in self.trace.live.values() if c.context]
        for index, conv in enumerate(in_progress):
            decodes[index % len(decodes)].retain(conv.name, _blocks(conv.context))
        # What an engine let go of before its replay was never reported: no word to wait for.
        self.engines.freeing.clear()
        for decode in decodes:
            decode.reclaiming.clear()
        return [
            (d, [self._retained(c, blocks, d, request) for c, (request, blocks) in d.held.items()])
            for d in decodes
        ]

    async def _replay(self, stub: Any, replays: Replays) -> None:
        """Each engine's replay reported as its sidecar sends it (500 events a report)."""

        async def report(decode: SimDecode, chunk: list[Any]) -> None:
            request = registry_pb2.ReportRetentionRequest(
                node_id=decode.spec.node_id, incarnation=decode.spec.incarnation,
                events=decode.number(chunk),
            )  # fmt: skip
            response = await _again_if_away(
                lambda: stub.ReportRetention(request, timeout=120), self.tally
            )
            self.tally.refused_events += len(response.refused)

        await _bounded(
            [report(d, events[i : i + 500])
             for d, events in replays for i in range(0, len(events), 500)],
            limit=4,
        )  # fmt: skip

    def _retained(
        self, conversation: str, blocks: int, decode: SimDecode, request_id: str
    ) -> registry_pb2.RetentionEvent:
        stride = stride_for(blocks)
        spec = decode.spec
        retained = registry_pb2.RetainedBlocks(
            conversation_id=conversation,
            handle=lease_pb2.KvHandle(
                remote_engine_id=spec.engine_id, remote_request_id=request_id,
                remote_block_groups=[lease_pb2.BlockIdGroup(block_ids=range(blocks))],
                remote_host=spec.side_channel_host, remote_port=spec.side_channel_port,
                remote_num_tokens=blocks * BLOCK_SIZE, tp_size=1,
            ),
            block_hashes=self.trace.hashes(conversation, checkpoint_blocks(blocks, stride)),
            token_count=blocks * BLOCK_SIZE, block_hash_stride=stride,
        )  # fmt: skip
        return registry_pb2.RetentionEvent(retained=retained)

    async def _turns(self, stub: Any, hints: list[HintBatcher]) -> dict[str, Any]:
        """The trace's next turns at the offered rate, open loop; a conversation's turn waits
        for its previous one (its prompt follows that answer). What it used, measured."""
        used = self._cpu_meter()
        total = int(self.config.rate * self.config.seconds)
        tasks = []
        start = time.perf_counter()
        for index in range(total):
            delay = start + index / self.config.rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            turn = self.trace.next_turn()
            # A turn follows its conversation's previous one, a sub-agent's first its parent's.
            previous = self.pending.get(turn.conversation) or self.pending.get(turn.parent)
            task = asyncio.create_task(self._play(stub, hints[index % len(hints)], turn, previous))
            self.pending[turn.conversation] = task
            tasks.append(task)
        issued = time.perf_counter() - start
        await asyncio.gather(*tasks)
        return {"seconds": time.perf_counter() - start, "issue_seconds": issued, **used()}

    async def _saturate(self, hints: list[HintBatcher], seconds: float) -> dict[str, Any]:
        """Hints alone as fast as they are answered (dry runs: nothing claimed), 64 callers
        per router, for conversations whose KV is held: what a registry core buys."""
        held = list(self.engines.holders)
        used = self._cpu_meter()
        start = time.perf_counter()
        answered = 0

        async def caller(index: int) -> None:
            nonlocal answered
            router = hints[index % len(hints)]
            while time.perf_counter() < start + seconds:
                conversation = held[(index * 7919 + answered) % len(held)]
                await router.hint(
                    registry_pb2.GetRoutingHintRequest(
                        conversation_id=conversation, model=MODEL, dry_run=True
                    )
                )
                answered += 1

        await asyncio.gather(*(caller(i) for i in range(64 * len(hints))))
        return {"seconds": time.perf_counter() - start, "hints": answered, **used()}

    def _cpu_meter(self) -> Callable[[], dict[str, Any]]:
        """Starts measuring; the returned call gives the CPU seconds each replica, etcd and
        the load (this process and the heartbeats') used since."""
        assert self.heartbeats is not None  # started before the nodes register
        pids = [p.pid for p in (*self.replicas, self.etcd.child)] + [self.heartbeats.pid]
        before, own = [cpu_seconds(pid) for pid in pids], time.process_time()

        def used() -> dict[str, Any]:
            cpu = [cpu_seconds(pid) - b for pid, b in zip(pids, before, strict=True)]
            return {"replica_cpu_s": cpu[:-2], "etcd_cpu_s": cpu[-2],
                    "loadgen_cpu_s": time.process_time() - own + cpu[-1]}  # fmt: skip

        return used

    async def _play(
        self, stub: Any, hints: HintBatcher, turn: Turn, previous: asyncio.Task[None] | None
    ) -> None:
        if previous is not None:
            await asyncio.wait([previous])
        readers = [turn.conversation, turn.parent] if turn.parent else [turn.conversation]
        self.engines.busy.update(readers)
        try:
            await self._turn(stub, hints, turn)
        except (grpc.aio.AioRpcError, KeyError):  # a refused hint, or one without a decode node
            self.tally.errors += 1
        finally:
            self.engines.busy.subtract(readers)
            if self.pending.get(turn.conversation) is asyncio.current_task():
                del self.pending[turn.conversation]

    async def _turn(self, stub: Any, hints: HintBatcher, turn: Turn) -> None:
        tally = self.tally
        request = registry_pb2.GetRoutingHintRequest(
            conversation_id=turn.conversation, model=MODEL,
            prompt_tokens=turn.context_tokens + turn.new_tokens, new_tokens=turn.new_tokens,
        )  # fmt: skip
        holder = self.engines.holders.get(turn.conversation)
        held = holder is not None or self.engines.freeing[turn.conversation] > 0
        started = time.perf_counter()
        hint = await hints.hint(request)
        tally.latencies.append(time.perf_counter() - started)
        tally.turns += 1
        reused = hint.path in REUSE_PATHS
        if turn.index > 0:
            tally.later += 1
            tally.reused += reused
            tally.held += held
            tally.reused_held += reused and held
            tally.reused_not_held += reused and not held
        if hint.path == registry_pb2.TURN_PATH_READ:
            lease = (await stub.GetLease(
                registry_pb2.GetLeaseRequest(lease_id=hint.lease.lease_id), timeout=10
            )).lease  # fmt: skip
            tally.fenced += read_refusal(lease, hint.lease.epoch) is not None
        if turn.parent:
            await self._fork_read(stub, hint, turn)
        decode = self.decodes[hint.decode.node_id]
        sends: list[tuple[SimDecode, Any]] = []
        if holder is not None and holder is not decode:
            # After a READ the holder frees the blocks (vLLM frees after a read); otherwise
            # the registry's command to free the superseded lease's blocks did.
            freed = holder.released(turn.conversation, lease_pb2.LEASE_END_CAUSE_READ)
            if hint.path == registry_pb2.TURN_PATH_READ:
                sends += [(holder, event) for event in freed]
        blocks = _blocks(turn.context_tokens + turn.new_tokens + turn.output_tokens)
        request_id, reclaims = decode.retain(turn.conversation, blocks)
        retained = self._retained(turn.conversation, blocks, decode, request_id)
        sends += [(decode, event) for event in (retained, *reclaims)]
        if turn.last:  # the agent is done: the lease idles out and the engine frees its blocks
            sends += [
                (decode, e)
                for e in decode.released(turn.conversation, lease_pb2.LEASE_END_CAUSE_IDLE)
            ]
            self.trace.forget(turn.conversation)
        await asyncio.gather(*(node.reports.submit(event) for node, event in sends))

    async def _fork_read(self, stub: Any, hint: Any, turn: Turn) -> None:
        """A sub-agent's first prompt starts with its parent's history: its prefill node's
        connector looks it up by content and, found, reads it under a pin it then ends."""
        self.tally.forks += 1
        blocks = (turn.context_tokens + turn.new_tokens) // BLOCK_SIZE
        node_id = hint.prefill.node_id
        answer = await stub.MatchPrefix(
            registry_pb2.MatchPrefixRequest(
                node_id=node_id, conversation_id=turn.conversation, model=MODEL,
                block_size=BLOCK_SIZE,
                probe_hashes=self.trace.hashes(turn.conversation, probe_blocks(blocks)),
            ),
            timeout=10,
        )  # fmt: skip
        if answer.pin_id:
            self.tally.fork_hits += 1
            await stub.EndReadPin(
                registry_pb2.EndReadPinRequest(
                    node_id=node_id, lease_id=answer.lease.lease_id, pin_id=answer.pin_id
                ),
                timeout=10,
            )


async def _again_if_away(call: Callable[[], Awaitable[Any]], tally: Tally) -> Any:
    """A sidecar's call that no replica served (``replica_away``, or cancelled: on a machine
    this busy a leader can lose its election mid-replay) sent again after a second, as the
    sidecar's session would, up to ``SIDECAR_ATTEMPTS`` times; the registry applies a report's
    events once, by their sequence."""
    for attempt in range(SIDECAR_ATTEMPTS):
        try:
            return await call()
        except grpc.aio.AioRpcError as error:
            away = replica_away(error) or error.code() == grpc.StatusCode.CANCELLED
            if attempt == SIDECAR_ATTEMPTS - 1 or not away:
                raise
            tally.sidecar_retries += 1
        await asyncio.sleep(1.0)
    raise AssertionError("unreachable")


def _blocks(tokens: int) -> int:
    """The whole blocks of ``tokens`` an engine retains (the last, partial one it does not)."""
    return max(1, tokens // BLOCK_SIZE)


async def _answers(stub: Any) -> bool:
    """A replica answers calls once one of them leads (followers forward to it)."""
    await stub.ListNodes(registry_pb2.ListNodesRequest(), timeout=2)
    return True


async def _bounded(calls: list[Any], limit: int = 32) -> None:
    """Runs the coroutines ``limit`` at a time, as many sidecars starting at once would."""
    gate = asyncio.Semaphore(limit)

    async def one(call: Any) -> None:
        async with gate:
            await call

    await asyncio.gather(*(one(call) for call in calls))


async def run_fleet(config: FleetConfig, progress: Callable[[str], None]) -> list[FleetPoint]:
    """Each fleet size of ``config``, one after another, each on a fresh etcd and replicas."""
    points = []
    for nodes in config.sizes:
        with tempfile.TemporaryDirectory(prefix="kvbroker-fleet-") as workdir:
            points.append(await FleetRun(config, nodes, Path(workdir)).run(progress))
    return points
