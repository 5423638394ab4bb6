"""The node agent: the only path between one vLLM engine and the registry.

It keeps the node's session (register, heartbeat with readiness and load), forwards the
engine's retention events in order and in batches, hands the registry's lease commands to the
engine as deadlines, and after any reconnect replays everything the engine still retains so the
registry rebuilds its state with nothing lost or duplicated.

What the engine retains is mirrored here (``RetentionMirror``) as soon as the engine reports
it, before it is sent: the mirror, not the send queue, is the truth a replay is built from, so
a batch lost with a broken connection is never lost to the registry. Events go out through a
``Batcher``: one report in flight, the rest in the next, in the order they came; each report is
numbered at sending (the registry ignores numbers at or below the last it applied), and only
in a session whose replay the registry has acknowledged. A report that fails (the registry
gone, or refusing it) ends the session; the next one's replay carries what it held. An event
the registry refuses on its own (it answers per event) is dropped and logged, never replayed.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import grpc
import httpx
import structlog
from prometheus_client.parser import text_string_to_metric_families

from kvbroker.common.batcher import Batcher
from kvbroker.common.clock import from_duration
from kvbroker.common.engine_metrics import Totals, TotalsReader, WorkMeter
from kvbroker.common.grpc_client import (
    RegistryEndpoint,
    from_grpc_error,
    open_channel,
    registry_stub,
)
from kvbroker.common.labels import label
from kvbroker.common.retention_mirror import RetentionMirror
from kvbroker.common.routing import read_refusal
from kvbroker.common.tasks import until_first_exits
from kvbroker.sidecar.config import SidecarConfig
from kvbroker.sidecar.metrics import SidecarMetrics
from kvbroker.sidecar.readiness import Probe, Readiness
from kvbroker.v1 import lease_pb2, node_pb2, registry_pb2, sidecar_pb2
from kvbroker.v1.registry_pb2_grpc import RegistryServiceStub

log = structlog.get_logger("kvbroker.sidecar")

# Reasons after which the session must be re-established (registered again, then replayed).
_SESSION_LOST = frozenset(
    {registry_pb2.ERROR_REASON_SESSION_LOST, registry_pb2.ERROR_REASON_NODE_NOT_REGISTERED}
)
_RPC_TIMEOUT_S = 5.0


class SessionLostError(Exception):
    """The registry no longer knows this node's session; register again and replay."""


@dataclass(frozen=True, slots=True)
class _Queued:
    """A retention event waiting to be reported, with its position in the mirror's stream."""

    position: int
    event: registry_pb2.RetentionEvent


class _Session:
    """One registry session, and why it must end when something outside its own loops (a
    failed report, the engine re-attaching) decides so."""

    def __init__(self, stub: RegistryServiceStub) -> None:
        self.stub = stub
        self.replayed = False
        self._ended = asyncio.Event()
        self._error: Exception | None = None

    @property
    def live(self) -> bool:
        """Its replay was acknowledged and nothing has ended it since."""
        return self.replayed and not self._ended.is_set()

    def end(self, error: Exception) -> None:
        if not self._ended.is_set():
            self._error = error
            self._ended.set()

    async def until_ended(self) -> None:
        await self._ended.wait()
        assert self._error is not None
        raise self._error


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
        self._engine_attached = asyncio.Event()
        self._mirror = RetentionMirror()
        self._reports: Batcher[_Queued, None] = Batcher(
            self._report, config.max_batch, "kvbroker-retention-reports"
        )
        # Events submitted and not yet reported (or superseded by a replay).
        self._waiting = 0
        self._forwarding: set[asyncio.Future[list[BaseException | None]]] = set()
        self._sequence = 0
        self._subscribers: set[asyncio.Queue[registry_pb2.LeaseCommand]] = set()
        self._heartbeat_interval_s = 2.0
        # The registry session being set up or running, if any.
        self._current: _Session | None = None
        # Set while the current session is live: reports wait for it.
        self._reporting = asyncio.Event()
        self._http = httpx.AsyncClient(timeout=config.health_timeout_s)
        self._readiness = Readiness(config.unready_after_timeouts)
        # What the last probe read off the engine's /metrics.
        self._load = node_pb2.NodeLoad()
        # Why the last /metrics answer's figures were ignored, if they were.
        self._ignored_figures: tuple[str, ...] = ()
        # The engine's work between probes, until a heartbeat carries it.
        self._work = WorkMeter()

    # ------------------------------------------------------------ engine side

    def attach_engine(
        self, info: sidecar_pb2.EngineInfo, retained: Sequence[registry_pb2.RetainedBlocks]
    ) -> None:
        """The engine (re)connected: what it retains now replaces the mirror."""
        if self.engine is not None and self.engine.engine_id != info.engine_id:
            # Another engine process: the old one's blocks are gone with it, and its metrics
            # began again.
            self.incarnation = uuid.uuid4().hex
            self._work = WorkMeter()
        self.engine = info
        self._mirror.replace(retained)
        self._engine_attached.set()
        # Force a fresh session so the registry gets the engine's snapshot.
        self.connected.clear()
        if self._current is not None:
            self._end_session(
                self._current, SessionLostError("the engine re-attached; a new snapshot is due")
            )
        log.info("engine_attached", engine=info.engine_id, retained=len(retained))

    def submit(self, events: Sequence[registry_pb2.RetentionEvent]) -> int:
        """Mirrors the engine's events and queues them for the registry without waiting;
        returns how many are waiting."""
        queued = [
            _Queued(position, event)
            for event in events
            if (position := self._mirror.record(event)) is not None
        ]
        if queued:
            # The items join the batcher in this order: tasks start in the order made.
            forwarding = asyncio.gather(
                *(self._reports.submit(item) for item in queued), return_exceptions=True
            )
            self._forwarding.add(forwarding)
            forwarding.add_done_callback(self._forwarded)
            self._waiting += len(queued)
        self.metrics.queue_depth.set(self._waiting)
        return self._waiting

    def _forwarded(self, forwarding: asyncio.Future[list[BaseException | None]]) -> None:
        self._forwarding.discard(forwarding)
        if forwarding.cancelled():
            return
        # ``_report`` handles the registry's failures itself; anything else is a bug to show.
        for result in forwarding.result():
            if isinstance(result, Exception):
                log.error("retention_report_failed", error=repr(result))
                break

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
        session = self._current
        if session is None or not session.live:
            return False, "the sidecar has no registry session"
        try:
            response = await session.stub.GetLease(
                registry_pb2.GetLeaseRequest(lease_id=lease_id), timeout=_RPC_TIMEOUT_S
            )
        except grpc.aio.AioRpcError as error:
            return False, f"registry could not confirm lease {lease_id}: {error.details()}"
        refusal = read_refusal(response.lease, epoch)
        return refusal is None, refusal or ""

    def _to_engine(self, command: registry_pb2.LeaseCommand) -> None:
        self._mirror.note_command(command)
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
            prefix_caching=self.config.prefix_caching,
        )

    async def run(self) -> None:
        """Probes the engine and keeps a session with the registry until cancelled."""
        await self._engine_attached.wait()
        await self._probe_engine()  # the first heartbeat reports what the engine said
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
                log.warning("registry_session_lost", error=detail, retry_in_s=round(backoff, 2))
                await asyncio.sleep(backoff * random.uniform(0.8, 1.2))
                backoff = min(backoff * 2, self.config.backoff_max_s)

    async def close(self) -> None:
        """Ends the session on purpose: the registry withdraws this node's leases at once
        (a restarted sidecar's replay revives those the engine still holds)."""
        await self._http.aclose()
        for forwarding in list(self._forwarding):
            forwarding.cancel()
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
        session = self._current = _Session(stub)
        try:
            model = self.config.model or (self.engine.model if self.engine else "")
            if not model:
                model = await self._served_model()
            response = await stub.RegisterNode(
                registry_pb2.RegisterNodeRequest(spec=self.node_spec(model)),
                timeout=_RPC_TIMEOUT_S,
            )
            self._heartbeat_interval_s = from_duration(response.heartbeat_interval)
            await self._replay(stub)
            session.replayed = True
            if session.live:
                self._reporting.set()
            self.connected.set()
            log.info("registry_session", node=self.config.node_id, incarnation=self.incarnation)
            await until_first_exits(
                self._heartbeats(stub), self._watch(stub), session.until_ended()
            )
        finally:
            self._end_session(session, SessionLostError("the session ended"))
            self._current = None

    def _end_session(self, session: _Session, error: Exception) -> None:
        """Stops reports going out in ``session``; its loops end with ``error``."""
        if session is self._current:
            self._reporting.clear()
        session.end(error)

    def _next_sequence(self) -> int:
        self._sequence += 1
        return self._sequence

    async def _replay(self, stub: RegistryServiceStub) -> None:
        """Sends everything the engine retains as one snapshot; what is queued is superseded."""
        events = [
            registry_pb2.RetentionEvent(sequence=self._next_sequence(), retained=blocks)
            for blocks in self._mirror.replay()
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
        self._drop_refused(events, response.refused)
        self.metrics.replay_size.set(len(events))
        log.info("replayed", leases=len(events))

    def _after_report(self, leases: Sequence[lease_pb2.Lease]) -> None:
        for lease in leases:
            self._mirror.note_lease(lease.handle.remote_request_id, lease.lease_id, lease.epoch)
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

    def _drop_refused(
        self,
        events: Sequence[registry_pb2.RetentionEvent],
        refused: Sequence[registry_pb2.RefusedEvent],
    ) -> None:
        """Events the registry refused are dropped, not sent again (each would be refused
        again, in every replay): a refused retention leaves the mirror, and the engine is told
        to free its blocks, as no lease stands behind them."""
        if not refused:
            return
        by_sequence = {event.sequence: event for event in events}
        for item in refused:
            event = by_sequence.get(item.sequence)
            if event is None:
                continue
            log.error(
                "retention_event_refused",
                sequence=item.sequence,
                kind=event.WhichOneof("event"),
                reason=item.error.reason,
                error=item.error.message,
            )
            if event.HasField("retained"):
                request_id = event.retained.handle.remote_request_id
                self._mirror.forget(request_id)
                self._to_engine(
                    registry_pb2.LeaseCommand(
                        remote_request_id=request_id,
                        state=lease_pb2.LEASE_STATE_RELEASED,
                        reason=f"refused by the registry: {item.error.message}",
                    )
                )

    async def _report(self, batch: list[_Queued]) -> list[None]:
        """Reports a batch (the ``Batcher``'s send) once a session is live, less what a replay
        has superseded meanwhile. A failure ends the session instead of failing the items: the
        next session's replay carries what they changed."""
        await self._reporting.wait()
        session = self._current
        events = [queued.event for queued in batch if not self._mirror.superseded(queued.position)]
        # The session may have ended between the wake-up and now: then the next replay sends.
        if events and session is not None and session.live:
            for event in events:
                event.sequence = self._next_sequence()
            try:
                response = await session.stub.ReportRetention(
                    registry_pb2.ReportRetentionRequest(
                        node_id=self.config.node_id, incarnation=self.incarnation, events=events
                    ),
                    timeout=_RPC_TIMEOUT_S,
                )
            except grpc.aio.AioRpcError as error:
                self._end_session(session, error)
            else:
                self._after_report(response.leases)
                self._drop_refused(events, response.refused)
                self.metrics.reports.inc(len(events))
        self._waiting -= len(batch)
        self.metrics.queue_depth.set(self._waiting)
        return [None] * len(batch)

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
        """Heartbeats carry the latest probe's word and the engine's work since the last
        heartbeat; they never wait on a probe, so a slow engine cannot make its node miss
        heartbeats and lose its session. Work a failed heartbeat carried is not sent again: it
        only refines estimates, and the next intervals' work does as well."""
        while True:
            try:
                await stub.Heartbeat(
                    registry_pb2.HeartbeatRequest(
                        node_id=self.config.node_id,
                        incarnation=self.incarnation,
                        engine_ready=self.engine_ready,
                        load=self._load,
                        work=self._work.take(),
                    ),
                    timeout=_RPC_TIMEOUT_S,
                )
            except grpc.aio.AioRpcError as error:
                refusal = from_grpc_error(error)
                if refusal.reason in _SESSION_LOST:
                    raise SessionLostError(refusal.message or "session lost") from error
                raise
            await asyncio.sleep(self._heartbeat_interval_s)

    # ------------------------------------------------------------ the engine's HTTP server

    async def _probes(self) -> None:
        while True:
            await asyncio.sleep(self._heartbeat_interval_s)
            await self._probe_engine()

    @property
    def engine_ready(self) -> bool:
        return self._readiness.ready

    async def _probe_engine(self) -> None:
        """vLLM's /health for readiness (``Readiness`` decides) and /metrics for load and the
        work done since the last probe."""
        self._load = await self._probe()
        self.metrics.engine_ready.set(1 if self.engine_ready else 0)

    async def _probe(self) -> node_pb2.NodeLoad:
        """The engine's load, its readiness and work noted on the way (``Readiness``,
        ``WorkMeter``)."""
        base = self.config.engine_url.rstrip("/")
        try:
            health = await self._http.get(f"{base}/health")
        except httpx.TimeoutException:
            self._readiness.observe(Probe.TIMED_OUT)
            return self._load  # the last known load
        except httpx.HTTPError:
            self._readiness.observe(Probe.UNHEALTHY)
            return node_pb2.NodeLoad()
        if health.status_code != 200:
            self._readiness.observe(Probe.UNHEALTHY)
            return node_pb2.NodeLoad()
        self._readiness.observe(Probe.HEALTHY)
        try:
            metrics = await self._http.get(f"{base}/metrics")
        except httpx.HTTPError:
            return node_pb2.NodeLoad()
        if metrics.status_code != 200:
            return node_pb2.NodeLoad()
        parsed = parse_vllm_load(metrics.text)
        if parsed.ignored and parsed.ignored != self._ignored_figures:
            # Once per change, not once per probe: a broken /metrics stays broken a while.
            log.warning("engine_metrics_ignored", ignored=list(parsed.ignored))
        self._ignored_figures = parsed.ignored
        self._work.observe(parsed.totals, self.engine.bytes_per_block if self.engine else 0)
        return parsed.load

    async def _served_model(self) -> str:
        base = self.config.engine_url.rstrip("/")
        try:
            models = (await self._http.get(f"{base}/v1/models")).json()
            return str(models["data"][0]["id"])
        except (httpx.HTTPError, KeyError, IndexError, ValueError) as error:
            raise SessionLostError(f"cannot learn the served model from {base}: {error}") from error


# NodeLoad's counts are uint32: a figure beyond this cannot be sent (the proto refuses it).
_MAX_COUNT = 2**32 - 1
_COUNTS = {
    "vllm:num_requests_running": "running_requests",
    "vllm:num_requests_waiting": "waiting_requests",
}
_USAGE = "vllm:kv_cache_usage_perc"
# How much of an unreadable body's parse error a warning quotes.
_QUOTED = 200


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """What one /metrics answer said: the figures that could be read, its running totals of
    work (None when any was unusable), and why any figures were ignored (empty when none
    was)."""

    load: node_pb2.NodeLoad
    totals: Totals | None = None
    ignored: tuple[str, ...] = ()


def parse_vllm_load(text: str) -> EngineLoad:
    """Running/waiting requests and KV usage from vLLM's Prometheus text, and its running
    totals of work (``engine_metrics.TotalsReader``).

    Total: whatever the engine answers, it returns. A body that is not Prometheus text (an HTML
    error page) gives no figures; a count that is not finite, is negative or does not fit the
    proto's uint32, and a usage outside 0..1, is ignored, and a total that is not finite or is
    negative costs the answer its totals; each says why in ``ignored``. A bad answer costs the
    node its load figures (the next good one counts the work of both), never its probe loop
    and so its session."""
    counts = dict.fromkeys(_COUNTS.values(), 0)
    usage = 0.0
    ignored: list[str] = []
    totals = TotalsReader()
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                value = sample.value
                if totals.add(sample):
                    continue
                if sample.name in _COUNTS:
                    if not (math.isfinite(value) and 0 <= value <= _MAX_COUNT):
                        ignored.append(f"{sample.name} = {value!r} is not a count")
                        continue
                    field = _COUNTS[sample.name]
                    # Several series (one per model name) add up; the sum saturates.
                    counts[field] = min(counts[field] + int(value), _MAX_COUNT)
                elif sample.name == _USAGE:
                    if not (math.isfinite(value) and 0 <= value <= 1):
                        ignored.append(f"{sample.name} = {value!r} is not a fraction")
                        continue
                    usage = max(usage, value)
    # The parser is a third party's and raises whatever its line reader hits (ValueError,
    # IndexError, ...): any of it means the body is not Prometheus text. Its message quotes the
    # offending line, which may be a whole error page: the log gets its start.
    except Exception as error:
        why = f"not Prometheus text: {type(error).__name__}: {str(error)[:_QUOTED]}"
        return EngineLoad(node_pb2.NodeLoad(), ignored=(why,))
    return EngineLoad(
        node_pb2.NodeLoad(kv_cache_usage=usage, **counts),
        totals.totals(),
        (*ignored, *totals.ignored),
    )
