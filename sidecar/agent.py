"""The node agent: the only path between one vLLM engine and the registry.

It keeps the node's session (register, heartbeat with readiness and load), forwards the
engine's retention events in order and in batches, hands the registry's lease commands to the
engine as deadlines, and after any reconnect replays everything the engine still retains so the
registry rebuilds its state with nothing lost or duplicated.

The agent owns the session loop and the engine-facing calls; what the engine retains, its
reports, replays and the commands back are the ``RetentionRelay``'s (``retention``), and what
the engine's HTTP server says is the ``EngineProbe``'s (``engine_probe``).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
import uuid
from collections.abc import AsyncIterator, Sequence

import grpc
import structlog

from kvbroker.common.client.grpc_client import (
    RegistryEndpoint,
    from_grpc_error,
    open_channel,
    registry_stub,
)
from kvbroker.common.process.tasks import until_first_exits
from kvbroker.common.rules.clock import from_duration
from kvbroker.common.rules.routing import pinned, read_refusal
from kvbroker.sidecar.config import SidecarConfig
from kvbroker.sidecar.engine_probe import EngineProbe
from kvbroker.sidecar.metrics import SidecarMetrics
from kvbroker.sidecar.retention import RetentionRelay
from kvbroker.sidecar.session import RPC_TIMEOUT_S, Session, SessionLostError
from kvbroker.v1 import node_pb2, registry_pb2, sidecar_pb2
from kvbroker.v1.registry_pb2_grpc import RegistryServiceStub

log = structlog.get_logger("kvbroker.sidecar")

# Reasons after which the session must be re-established (registered again, then replayed).
_SESSION_LOST = frozenset(
    {registry_pb2.ERROR_REASON_SESSION_LOST, registry_pb2.ERROR_REASON_NODE_NOT_REGISTERED}
)

# How long a heartbeat waits for its probe of the engine, as a share of the heartbeat interval
# (the registry's session TTL is longer than an interval: a heartbeat this late is on time).
FRESH_LOAD_WAIT = 0.25


def _node_in_use(error: grpc.aio.AioRpcError) -> bool:
    """The registry refused the registration: another incarnation's session of this node id
    is live."""
    return bool(from_grpc_error(error).reason == registry_pb2.ERROR_REASON_NODE_IN_USE)


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
        # An incarnation this sidecar replaced whose session may still be live: ended before
        # the new one registers, as the registry refuses a rival of a live session.
        self._replaced: str | None = None
        self.engine: sidecar_pb2.EngineInfo | None = None
        self.connected = asyncio.Event()
        self._engine_attached = asyncio.Event()
        self._relay = RetentionRelay(config.node_id, config.max_batch, self.metrics)
        self._heartbeat_interval_s = 2.0
        # The registry's session TTL, from its answer to the registration (0 until then, or
        # from a registry that sends none: a failed heartbeat ends the session).
        self._session_ttl_s = 0.0
        # The registry session being set up or running, if any.
        self._current: Session | None = None
        # The model the node registered as serving ("" until it has registered).
        self._model = ""
        self._probe = EngineProbe(config, self.metrics)

    # ------------------------------------------------------------ engine side

    def attach_engine(
        self, info: sidecar_pb2.EngineInfo, retained: Sequence[registry_pb2.RetainedBlocks]
    ) -> None:
        """The engine (re)connected: what it retains now replaces the mirror."""
        another_process = self.engine is not None and self.engine.engine_id != info.engine_id
        if another_process:
            # Another engine process: the old one's blocks are gone with it, and its metrics
            # began again.
            self._replaced = self.incarnation
            self.incarnation = uuid.uuid4().hex
        self._probe.attach(info, another_process)
        self.engine = info
        self._relay.replace(retained)
        self._engine_attached.set()
        # Force a fresh session so the registry gets the engine's snapshot.
        self.connected.clear()
        if self._current is not None:
            self._relay.end(
                self._current, SessionLostError("the engine re-attached; a new snapshot is due")
            )
        log.info("engine_attached", engine=info.engine_id, retained=len(retained))

    def submit(self, events: Sequence[registry_pb2.RetentionEvent]) -> int:
        """Mirrors the engine's events and queues them for the registry without waiting;
        returns how many are waiting."""
        return self._relay.submit(events)

    def deadlines(self) -> AsyncIterator[registry_pb2.LeaseCommand]:
        return self._relay.deadlines()

    async def check_lease(self, lease_id: str, epoch: int) -> sidecar_pb2.CheckLeaseResponse:
        """The fence before a read (``routing.read_refusal``), on the registry's current
        record of the lease; ``shared`` when forks' read pins hold it (the read must not free
        the blocks)."""
        session = self._current
        if session is None or not session.live:
            return sidecar_pb2.CheckLeaseResponse(reason="the sidecar has no registry session")
        try:
            response = await session.stub.GetLease(
                registry_pb2.GetLeaseRequest(lease_id=lease_id), timeout=RPC_TIMEOUT_S
            )
        except grpc.aio.AioRpcError as error:
            return sidecar_pb2.CheckLeaseResponse(
                reason=f"registry could not confirm lease {lease_id}: {error.details()}"
            )
        refusal = read_refusal(response.lease, epoch)
        return sidecar_pb2.CheckLeaseResponse(
            usable=refusal is None, reason=refusal or "", shared=pinned(response.lease)
        )

    async def resolve_prefix(
        self, request: sidecar_pb2.ResolvePrefixRequest, timeout_s: float
    ) -> registry_pb2.MatchPrefixResponse:
        """The registry's MatchPrefix for this node: a lease of another conversation the
        engine's prompt starts with, pinned for its read. Raises ``grpc.aio.AioRpcError`` as
        the registry answered, and ``SessionLostError`` with no live session."""
        session = self._current
        if session is None or not session.live or not self._model:
            raise SessionLostError("the sidecar has no registry session")
        response: registry_pb2.MatchPrefixResponse = await session.stub.MatchPrefix(
            registry_pb2.MatchPrefixRequest(
                node_id=self.config.node_id,
                conversation_id=request.conversation_id,
                model=self._model,
                block_size=request.block_size,
                probe_hashes=request.probe_hashes,
            ),
            timeout=min(timeout_s, RPC_TIMEOUT_S),
        )
        return response

    async def resolve_handle(
        self, request: sidecar_pb2.ResolveHandleRequest, timeout_s: float
    ) -> registry_pb2.RoutingHint:
        """The registry's hint for a turn another router placed on this node (its engine got
        it with a session id and no kvbroker handle). Raises ``grpc.aio.AioRpcError`` as the
        registry answered, and ``SessionLostError`` with no live session."""
        session = self._current
        if session is None or not session.live or not self._model:
            raise SessionLostError("the sidecar has no registry session")
        response: registry_pb2.GetRoutingHintResponse = await session.stub.GetRoutingHint(
            registry_pb2.GetRoutingHintRequest(
                conversation_id=request.conversation_id,
                model=self._model,
                prompt_tokens=request.prompt_tokens,
                path=request.path,
                on_node_id=self.config.node_id,
            ),
            timeout=min(timeout_s, RPC_TIMEOUT_S),
        )
        return response.hint

    async def end_pin(self, lease_id: str, pin_id: str) -> None:
        """The engine's read of a lease pinned for it has ended: the registry's EndReadPin.
        Best effort: a pin not ended here ends at its timeout."""
        session = self._current
        if session is None or not session.live:
            return
        with contextlib.suppress(grpc.aio.AioRpcError):
            await session.stub.EndReadPin(
                registry_pb2.EndReadPinRequest(
                    node_id=self.config.node_id, lease_id=lease_id, pin_id=pin_id
                ),
                timeout=RPC_TIMEOUT_S,
            )

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
            prefix_caching=self.config.prefix_caching,
            kv_retention=self.engine.kv_retention,
            vllm_version=self.engine.vllm_version,
            nixl_connector_version=self.engine.nixl_connector_version,
            registration_generation=self.engine.registration_generation,
            kv_device=self.engine.kv_device,
            gateway_endpoint=self.config.gateway_endpoint,
            dynamo_worker_id=self.config.dynamo_worker_id,
            kubernetes_pod=self.config.kubernetes_pod,
        )

    async def run(self) -> None:
        """Probes the engine and keeps a session with the registry until cancelled."""
        await self._engine_attached.wait()
        await self._probe.probe()  # the first heartbeat reports what the engine said
        await until_first_exits(self._probes(), self._sessions())

    async def _sessions(self) -> None:
        """Keeps a session with the registry, reconnecting with backoff."""
        backoff = self.config.backoff_initial_s
        while True:
            try:
                async with open_channel(self.registry) as channel:
                    await self._session(registry_stub(channel))
            except (grpc.aio.AioRpcError, SessionLostError) as error:
                if self.connected.is_set():
                    # A session was up: this is a new outage, not more of the last one, and a
                    # node the registry just declared lost must be back before it is missed.
                    backoff = self.config.backoff_initial_s
                self.connected.clear()
                self.metrics.reconnects.inc()
                detail = error.details() if isinstance(error, grpc.aio.AioRpcError) else str(error)
                retry_in_s = round(backoff, 2)
                if isinstance(error, grpc.aio.AioRpcError) and _node_in_use(error):
                    # Another sidecar's session holds this node id, or this one's predecessor's
                    # after a crash: said loudly, and tried again until that session ends.
                    self.metrics.node_in_use.set(1)
                    log.warning(
                        "node_in_use", node=self.config.node_id, error=detail, retry_in_s=retry_in_s
                    )
                else:
                    log.warning("registry_session_lost", error=detail, retry_in_s=retry_in_s)
                await asyncio.sleep(backoff * random.uniform(0.8, 1.2))
                backoff = min(backoff * 2, self.config.backoff_max_s)

    async def close(self) -> None:
        """Ends the session on purpose: the registry withdraws this node's leases at once
        (a restarted sidecar's replay revives those the engine still holds)."""
        await self._probe.close()
        self._relay.close()
        if self.engine is None or not self.connected.is_set():
            return
        with contextlib.suppress(grpc.aio.AioRpcError):
            async with open_channel(self.registry) as channel:
                await registry_stub(channel).DeregisterNode(
                    registry_pb2.DeregisterNodeRequest(
                        node_id=self.config.node_id, incarnation=self.incarnation
                    ),
                    timeout=RPC_TIMEOUT_S,
                )

    async def _session(self, stub: RegistryServiceStub) -> None:
        session = self._current = Session(stub, self.incarnation)
        try:
            model = self.config.model or (self.engine.model if self.engine else "")
            if not model:
                model = await self._probe.served_model()
            self._model = model
            if self._replaced is not None:
                await self._end_replaced(stub, self._replaced)
            response = await stub.RegisterNode(
                registry_pb2.RegisterNodeRequest(spec=self.node_spec(model)),
                timeout=RPC_TIMEOUT_S,
            )
            self.metrics.node_in_use.set(0)
            self._heartbeat_interval_s = from_duration(response.heartbeat_interval)
            self._session_ttl_s = from_duration(response.session_ttl)
            await self._relay.replay(stub, self.incarnation)
            session.replayed = True
            if session.live:
                self._relay.report_in(session)
            self.connected.set()
            log.info("registry_session", node=self.config.node_id, incarnation=self.incarnation)
            await until_first_exits(
                self._heartbeats(stub), self._watch(stub), session.until_ended()
            )
        finally:
            self._relay.end(session, SessionLostError("the session ended"))
            self._current = None

    async def _end_replaced(self, stub: RegistryServiceStub, incarnation: str) -> None:
        """Ends the session of the incarnation this sidecar replaced (its engine was
        replaced): deregistered, as a clean stop does, so the new one is no rival of it. A
        session already gone is as good."""
        try:
            await stub.DeregisterNode(
                registry_pb2.DeregisterNodeRequest(
                    node_id=self.config.node_id, incarnation=incarnation
                ),
                timeout=RPC_TIMEOUT_S,
            )
        except grpc.aio.AioRpcError as error:
            if from_grpc_error(error).reason not in _SESSION_LOST:
                raise
        if self._replaced == incarnation:
            self._replaced = None

    async def _watch(self, stub: RegistryServiceStub) -> None:
        stream = stub.WatchLeaseCommands(
            registry_pb2.WatchLeaseCommandsRequest(
                node_id=self.config.node_id, incarnation=self.incarnation
            )
        )
        async for response in stream:
            self._relay.to_engine(response.command)
        raise SessionLostError("the registry closed the command stream")

    async def _heartbeats(self, stub: RegistryServiceStub) -> None:
        """Each heartbeat carries a probe of the engine begun as it is sent, and the engine's
        work since the last heartbeat. The registry counts the turns it sends a node from one
        heartbeat to the next on top of the load that heartbeat reports, so a load read an
        interval earlier would hide the turns that began in between. A heartbeat waits for
        its probe ``FRESH_LOAD_WAIT`` of an interval at most, and then carries the last known
        load: a slow engine cannot make its node miss heartbeats and lose its session. Work a
        failed heartbeat carried is not sent again: it only refines estimates, and the next
        intervals' work does as well.

        A heartbeat that fails without the registry's word that the session is over (a
        registry busy with a fleet's replays, a call lost on the way) ends nothing while the
        registry's session TTL has not passed since the last one answered: the next one goes
        at its time. Ending the session would re-register the node and replay its whole
        retention into the registry that was too busy to answer, the same moment as every other
        node's. Past the TTL the registry has declared the node lost, and the session ends."""
        answered = time.monotonic()
        while True:
            load = await self._probe.fresh_load(self._heartbeat_interval_s * FRESH_LOAD_WAIT)
            try:
                await stub.Heartbeat(
                    registry_pb2.HeartbeatRequest(
                        node_id=self.config.node_id,
                        incarnation=self.incarnation,
                        engine_ready=self.engine_ready,
                        load=load,
                        work=self._probe.take_work(),
                    ),
                    timeout=RPC_TIMEOUT_S,
                )
            except grpc.aio.AioRpcError as error:
                refusal = from_grpc_error(error)
                if refusal.reason in _SESSION_LOST:
                    raise SessionLostError(refusal.message or "session lost") from error
                silent_s = time.monotonic() - answered
                if silent_s + self._heartbeat_interval_s >= self._session_ttl_s:
                    raise
                self.metrics.heartbeats_failed.labels(code=error.code().name).inc()
                log.warning(
                    "heartbeat_failed", code=error.code().name, error=error.details(),
                    silent_s=round(silent_s, 2),
                )  # fmt: skip
            else:
                answered = time.monotonic()
            await asyncio.sleep(self._heartbeat_interval_s)

    # ------------------------------------------------------------ the engine's HTTP server

    async def _probes(self) -> None:
        """Probes the engine between sessions (its readiness is still this sidecar's to
        say); during one, each heartbeat probes it."""
        while True:
            await asyncio.sleep(self._heartbeat_interval_s)
            if not self.connected.is_set():
                await self._probe.probe()

    @property
    def engine_ready(self) -> bool:
        return self._probe.ready
