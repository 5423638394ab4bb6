"""The node agent: the only path between one vLLM engine and the registry.

It keeps the node's session (register, heartbeat with readiness and load), forwards the
engine's retention events in order and in batches, hands the registry's lease commands to the
engine as deadlines, and after any reconnect replays everything the engine still retains so the
registry rebuilds its state with nothing lost or duplicated.

What the engine retains is mirrored here as soon as the engine reports it, before it is sent:
the mirror, not the send queue, is the truth a replay is built from, so a batch lost with a
broken connection is never lost to the registry.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import grpc
import httpx
import structlog
from prometheus_client.parser import text_string_to_metric_families

from kvbroker.common.clock import from_duration
from kvbroker.common.grpc_client import (
    RegistryEndpoint,
    from_grpc_error,
    open_channel,
    registry_stub,
)
from kvbroker.common.labels import label
from kvbroker.common.routing import read_refusal
from kvbroker.common.tasks import until_first_exits
from kvbroker.v1 import lease_pb2, node_pb2, registry_pb2, sidecar_pb2
from kvbroker.v1.registry_pb2_grpc import RegistryServiceStub
from sidecar.config import SidecarConfig
from sidecar.metrics import SidecarMetrics

log = structlog.get_logger("kvbroker.sidecar")

# Reasons after which the session must be re-established (registered again, then replayed).
_SESSION_LOST = frozenset(
    {registry_pb2.ERROR_REASON_SESSION_LOST, registry_pb2.ERROR_REASON_NODE_NOT_REGISTERED}
)
_RPC_TIMEOUT_S = 5.0


@dataclass
class _Mirror:
    """What the engine retains, by request id, with the lease the registry granted for it."""

    retained: dict[str, registry_pb2.RetainedBlocks] = field(default_factory=dict)

    def apply(self, event: registry_pb2.RetentionEvent) -> None:
        if event.HasField("retained"):
            entry = registry_pb2.RetainedBlocks()
            entry.CopyFrom(event.retained)
            self.retained[entry.handle.remote_request_id] = entry
        elif event.HasField("released"):
            self.retained.pop(event.released.remote_request_id, None)

    def note_lease(self, lease: lease_pb2.Lease) -> None:
        entry = self.retained.get(lease.handle.remote_request_id)
        if entry is not None:
            entry.lease_id = lease.lease_id
            entry.epoch = lease.epoch


class SessionLostError(Exception):
    """The registry no longer knows this node's session; register again and replay."""


class Agent:
    def __init__(
        self,
        config: SidecarConfig,
        registry: RegistryEndpoint,
        metrics: SidecarMetrics | None = None,
    ) -> None:
        self.config = config
        self.registry = registry
        self.metrics = metrics or SidecarMetrics()
        self.incarnation = uuid.uuid4().hex
        self.engine: sidecar_pb2.EngineInfo | None = None
        self.connected = asyncio.Event()
        self.engine_ready = False
        self._engine_attached = asyncio.Event()
        self._mirror = _Mirror()
        self._outbox: asyncio.Queue[registry_pb2.RetentionEvent] = asyncio.Queue()
        self._sequence = 0
        self._subscribers: set[asyncio.Queue[registry_pb2.LeaseCommand]] = set()
        self._heartbeat_interval_s = 2.0
        self._stub: RegistryServiceStub | None = None
        self._http = httpx.AsyncClient(timeout=config.health_timeout_s)

    # ------------------------------------------------------------ engine side

    def attach_engine(
        self, info: sidecar_pb2.EngineInfo, retained: Sequence[registry_pb2.RetainedBlocks]
    ) -> None:
        """The engine (re)connected: what it retains now replaces the mirror."""
        if self.engine is not None and self.engine.engine_id != info.engine_id:
            # Another engine process: the old one's blocks are gone with it.
            self.incarnation = uuid.uuid4().hex
        self.engine = info
        self._mirror.retained = {}
        for blocks in retained:
            self._mirror.apply(registry_pb2.RetentionEvent(retained=blocks))
        self._engine_attached.set()
        # Force a fresh session so the registry gets the engine's snapshot.
        self.connected.clear()
        self._outbox.put_nowait(registry_pb2.RetentionEvent())  # wakes the forwarder
        log.info("engine_attached", engine=info.engine_id, retained=len(retained))

    def submit(self, events: Sequence[registry_pb2.RetentionEvent]) -> int:
        for event in events:
            self._mirror.apply(event)
            self._outbox.put_nowait(event)
        self.metrics.queue_depth.set(self._outbox.qsize())
        return self._outbox.qsize()

    async def deadlines(self) -> AsyncIterator[registry_pb2.LeaseCommand]:
        queue: asyncio.Queue[registry_pb2.LeaseCommand] = asyncio.Queue()
        self._subscribers.add(queue)
        try:
            while True:
                yield await queue.get()
        finally:
            self._subscribers.discard(queue)

    async def check_lease(self, lease_id: str, epoch: int) -> tuple[bool, str]:
        """The fence before a read (``routing.read_refusal``), on the registry's current
        record of the lease."""
        stub = self._stub
        if stub is None:
            return False, "the sidecar has no registry session"
        try:
            response = await stub.GetLease(
                registry_pb2.GetLeaseRequest(lease_id=lease_id), timeout=_RPC_TIMEOUT_S
            )
        except grpc.aio.AioRpcError as error:
            return False, f"registry could not confirm lease {lease_id}: {error.details()}"
        refusal = read_refusal(response.lease, epoch)
        return refusal is None, refusal or ""

    def _to_engine(self, command: registry_pb2.LeaseCommand) -> None:
        for queue in self._subscribers:
            queue.put_nowait(command)
        self.metrics.commands.labels(label(lease_pb2.LeaseState, command.state).lower()).inc()

    # ------------------------------------------------------------ registry side

    def node_spec(self, model: str) -> node_pb2.NodeSpec:
        assert self.engine is not None
        return node_pb2.NodeSpec(
            node_id=self.config.node_id,
            role=self.config.role,
            engine_id=self.engine.engine_id,
            side_channel_host=self.engine.side_channel_host,
            side_channel_port=self.engine.side_channel_port,
            http_base_url=self.config.advertise_url or self.config.engine_url,
            model=model,
            block_size=self.engine.block_size,
            capacity_blocks=self.engine.capacity_blocks,
            bytes_per_block=self.engine.bytes_per_block,
            retention_budget_blocks=self.engine.retention_budget_blocks
            or self.engine.capacity_blocks,
            retention_hard_cap=self.engine.retention_hard_cap,
            incarnation=self.incarnation,
        )

    async def run(self) -> None:
        """Keeps a session with the registry until cancelled, reconnecting with backoff."""
        backoff = self.config.backoff_initial_s
        await self._engine_attached.wait()
        while True:
            try:
                async with open_channel(self.registry) as channel:
                    await self._session(registry_stub(channel))
            except (grpc.aio.AioRpcError, SessionLostError) as error:
                self.connected.clear()
                self.metrics.reconnects.inc()
                detail = error.details() if isinstance(error, grpc.aio.AioRpcError) else str(error)
                log.warning("registry_session_lost", error=detail, retry_in_s=round(backoff, 2))
                await asyncio.sleep(backoff * random.uniform(0.8, 1.2))
                backoff = min(backoff * 2, self.config.backoff_max_s)
                continue
            backoff = self.config.backoff_initial_s

    async def close(self) -> None:
        """Ends the session on purpose: the registry withdraws this node's leases at once
        (a restarted sidecar's replay revives those the engine still holds)."""
        await self._http.aclose()
        if self.engine is None or not self.connected.is_set():
            return
        with contextlib.suppress(grpc.aio.AioRpcError):
            async with open_channel(self.registry) as channel:
                await registry_stub(channel).DeregisterNode(
                    registry_pb2.DeregisterNodeRequest(
                        node_id=self.config.node_id, incarnation=self.incarnation
                    ),
                    timeout=_RPC_TIMEOUT_S,
                )

    async def _session(self, stub: RegistryServiceStub) -> None:
        model = self.config.model or (self.engine.model if self.engine else "")
        if not model:
            model = await self._served_model()
        response = await stub.RegisterNode(
            registry_pb2.RegisterNodeRequest(spec=self.node_spec(model)), timeout=_RPC_TIMEOUT_S
        )
        self._heartbeat_interval_s = from_duration(response.heartbeat_interval)
        await self._replay(stub)
        self._stub = stub
        self.connected.set()
        log.info("registry_session", node=self.config.node_id, incarnation=self.incarnation)
        try:
            await until_first_exits(self._heartbeats(stub), self._forward(stub), self._watch(stub))
        finally:
            self._stub = None

    def _next_sequence(self) -> int:
        self._sequence += 1
        return self._sequence

    async def _replay(self, stub: RegistryServiceStub) -> None:
        """Sends everything the engine retains as one snapshot; the queue is superseded."""
        while not self._outbox.empty():
            self._outbox.get_nowait()
        snapshot = list(self._mirror.retained.values())
        events = [
            registry_pb2.RetentionEvent(sequence=self._next_sequence(), retained=blocks)
            for blocks in snapshot
        ]
        response = await stub.ReportRetention(
            registry_pb2.ReportRetentionRequest(
                node_id=self.config.node_id,
                incarnation=self.incarnation,
                events=events,
                full_snapshot=True,
            ),
            timeout=_RPC_TIMEOUT_S * 4,
        )
        self._after_report(response.leases)
        self.metrics.replay_size.set(len(events))
        self.metrics.queue_depth.set(0)
        log.info("replayed", leases=len(events))

    def _after_report(self, leases: Sequence[lease_pb2.Lease]) -> None:
        for lease in leases:
            self._mirror.note_lease(lease)
            if lease.state in (lease_pb2.LEASE_STATE_ACTIVE, lease_pb2.LEASE_STATE_CLAIMED):
                self._to_engine(
                    registry_pb2.LeaseCommand(
                        lease_id=lease.lease_id,
                        remote_request_id=lease.handle.remote_request_id,
                        epoch=lease.epoch,
                        time_to_live=lease.time_to_live,
                        state=lease.state,
                        reason="granted",
                    )
                )

    async def _forward(self, stub: RegistryServiceStub) -> None:
        while True:
            batch = [await self._outbox.get()]
            while len(batch) < self.config.max_batch and not self._outbox.empty():
                batch.append(self._outbox.get_nowait())
            if not self.connected.is_set():
                raise SessionLostError("the engine re-attached; a new snapshot is due")
            events = [e for e in batch if e.WhichOneof("event") is not None]
            if not events:
                continue
            for event in events:
                event.sequence = self._next_sequence()
            response = await stub.ReportRetention(
                registry_pb2.ReportRetentionRequest(
                    node_id=self.config.node_id, incarnation=self.incarnation, events=events
                ),
                timeout=_RPC_TIMEOUT_S,
            )
            self._after_report(response.leases)
            self.metrics.reports.inc(len(events))
            self.metrics.queue_depth.set(self._outbox.qsize())

    async def _watch(self, stub: RegistryServiceStub) -> None:
        stream = stub.WatchLeaseCommands(
            registry_pb2.WatchLeaseCommandsRequest(
                node_id=self.config.node_id, incarnation=self.incarnation
            )
        )
        async for response in stream:
            self._to_engine(response.command)
        raise SessionLostError("the registry closed the command stream")

    async def _heartbeats(self, stub: RegistryServiceStub) -> None:
        while True:
            self.engine_ready, load = await self._probe_engine()
            try:
                await stub.Heartbeat(
                    registry_pb2.HeartbeatRequest(
                        node_id=self.config.node_id,
                        incarnation=self.incarnation,
                        engine_ready=self.engine_ready,
                        load=load,
                    ),
                    timeout=_RPC_TIMEOUT_S,
                )
            except grpc.aio.AioRpcError as error:
                refusal = from_grpc_error(error)
                if refusal.reason in _SESSION_LOST:
                    raise SessionLostError(refusal.message or "session lost") from error
                raise
            self.metrics.engine_ready.set(1 if self.engine_ready else 0)
            await asyncio.sleep(self._heartbeat_interval_s)

    # ------------------------------------------------------------ the engine's HTTP server

    async def _probe_engine(self) -> tuple[bool, node_pb2.NodeLoad]:
        """vLLM's /health for readiness and /metrics for load; any failure means not ready."""
        base = self.config.engine_url.rstrip("/")
        try:
            health = await self._http.get(f"{base}/health")
        except httpx.HTTPError:
            return False, node_pb2.NodeLoad()
        if health.status_code != 200:
            return False, node_pb2.NodeLoad()
        try:
            metrics = await self._http.get(f"{base}/metrics")
        except httpx.HTTPError:
            return True, node_pb2.NodeLoad()
        return True, parse_vllm_load(metrics.text) if metrics.status_code == 200 else (
            node_pb2.NodeLoad()
        )

    async def _served_model(self) -> str:
        base = self.config.engine_url.rstrip("/")
        try:
            models = (await self._http.get(f"{base}/v1/models")).json()
            return str(models["data"][0]["id"])
        except (httpx.HTTPError, KeyError, IndexError, ValueError) as error:
            raise SessionLostError(f"cannot learn the served model from {base}: {error}") from error


def parse_vllm_load(text: str) -> node_pb2.NodeLoad:
    """Running/waiting requests and KV usage from vLLM's Prometheus text."""
    load = node_pb2.NodeLoad()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "vllm:num_requests_running":
                load.running_requests += int(sample.value)
            elif sample.name == "vllm:num_requests_waiting":
                load.waiting_requests += int(sample.value)
            elif sample.name == "vllm:kv_cache_usage_perc":
                load.kv_cache_usage = max(load.kv_cache_usage, float(sample.value))
    return load
