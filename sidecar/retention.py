"""The engine's retention on its way to the registry and the registry's lease commands on
their way back, apart from the session loop (``agent.Agent``), which opens the sessions they
go through and ends them.

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
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import grpc
import structlog

from kvbroker.common.client.batcher import Batcher
from kvbroker.common.rules.labels import label
from kvbroker.common.rules.retention_mirror import RetentionMirror
from kvbroker.sidecar.metrics import SidecarMetrics
from kvbroker.sidecar.session import RPC_TIMEOUT_S, Session
from kvbroker.v1 import lease_pb2, registry_pb2
from kvbroker.v1.registry_pb2_grpc import RegistryServiceStub

log = structlog.get_logger("kvbroker.sidecar")


@dataclass(frozen=True, slots=True)
class _Queued:
    """A retention event waiting to be reported, with its position in the mirror's stream."""

    position: int
    event: registry_pb2.RetentionEvent


class RetentionRelay:
    def __init__(self, node_id: str, max_batch: int, metrics: SidecarMetrics) -> None:
        self._node_id = node_id
        self._metrics = metrics
        self._mirror = RetentionMirror()
        self._reports: Batcher[_Queued, None] = Batcher(
            self._report, max_batch, "kvbroker-retention-reports"
        )
        # Events submitted and not yet reported (or superseded by a replay).
        self._waiting = 0
        self._forwarding: set[asyncio.Future[list[BaseException | None]]] = set()
        self._sequence = 0
        self._subscribers: set[asyncio.Queue[registry_pb2.LeaseCommand]] = set()
        # The session reports last went out in (``report_in``).
        self._session: Session | None = None
        # Set while that session is live: reports wait for it.
        self._reporting = asyncio.Event()

    # ------------------------------------------------------------ engine side

    def replace(self, retained: Sequence[registry_pb2.RetainedBlocks]) -> None:
        """The engine (re)attached: what it retains now replaces the mirror."""
        self._mirror.replace(retained)

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
        self._metrics.queue_depth.set(self._waiting)
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

    def to_engine(self, command: registry_pb2.LeaseCommand) -> None:
        self._mirror.note_command(command)
        for queue in self._subscribers:
            queue.put_nowait(command)
        self._metrics.commands.labels(label(lease_pb2.LeaseState, command.state).lower()).inc()

    def close(self) -> None:
        """Drops what is still waiting to be reported."""
        for forwarding in list(self._forwarding):
            forwarding.cancel()

    # ------------------------------------------------------------ registry side

    def report_in(self, session: Session) -> None:
        """``session`` is live (the current one, its replay acknowledged): reports go out in
        it from now on."""
        self._session = session
        self._reporting.set()

    def end(self, session: Session, error: Exception) -> None:
        """Ends ``session``, its loops with ``error``; if reports went out in it, they wait
        for the next session's ``report_in``."""
        if session is self._session:
            self._reporting.clear()
        session.end(error)

    def _next_sequence(self) -> int:
        self._sequence += 1
        return self._sequence

    async def replay(self, stub: RegistryServiceStub, incarnation: str) -> None:
        """Sends everything the engine retains as one snapshot; what is queued is superseded."""
        events = [
            registry_pb2.RetentionEvent(sequence=self._next_sequence(), retained=blocks)
            for blocks in self._mirror.replay()
        ]
        response = await stub.ReportRetention(
            registry_pb2.ReportRetentionRequest(
                node_id=self._node_id,
                incarnation=incarnation,
                events=events,
                full_snapshot=True,
            ),
            timeout=RPC_TIMEOUT_S * 4,
        )
        self._after_report(response.leases)
        self._drop_refused(events, response.refused)
        self._metrics.replay_size.set(len(events))
        log.info("replayed", leases=len(events))

    def _after_report(self, leases: Sequence[lease_pb2.Lease]) -> None:
        for lease in leases:
            self._mirror.note_lease(lease.handle.remote_request_id, lease.lease_id, lease.epoch)
            if lease.state in (lease_pb2.LEASE_STATE_ACTIVE, lease_pb2.LEASE_STATE_CLAIMED):
                self.to_engine(
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
                self.to_engine(
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
        session = self._session
        events = [queued.event for queued in batch if not self._mirror.superseded(queued.position)]
        # The session may have ended between the wake-up and now: then the next replay sends.
        if events and session is not None and session.live:
            for event in events:
                event.sequence = self._next_sequence()
            # A live session's incarnation is the agent's: another engine ends the session.
            try:
                response = await session.stub.ReportRetention(
                    registry_pb2.ReportRetentionRequest(
                        node_id=self._node_id, incarnation=session.incarnation, events=events
                    ),
                    timeout=RPC_TIMEOUT_S,
                )
            except grpc.aio.AioRpcError as error:
                self.end(session, error)
            else:
                self._after_report(response.leases)
                self._drop_refused(events, response.refused)
                self._metrics.reports.inc(len(events))
        self._waiting -= len(batch)
        self._metrics.queue_depth.set(self._waiting)
        return [None] * len(batch)
