"""The engine's side of the local link to its sidecar, for code that runs inside vLLM.

vLLM's scheduler is synchronous and must never block, so this client runs its own asyncio
loop on a daemon thread: ``retained``/``released`` only record and enqueue,
``poll_deadlines`` drains what the sidecar sent since the last call (vLLM's connector calls it
once per scheduler step), and ``start_lease_check`` returns a future the connector looks at on
later steps. After any disconnect the link re-attaches and sends everything the engine still
retains (its ``RetentionMirror``'s replay), so a restarted sidecar rebuilds its view.

No vLLM import here: engine_ext adapts vLLM's objects to these proto messages. It logs through
stdlib ``logging``, which vLLM configures in the engine process.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass

import grpc

from kvbroker.common.process.tasks import until_first_exits
from kvbroker.common.rules.clock import from_duration
from kvbroker.common.rules.retention_mirror import RetentionMirror
from kvbroker.common.rules.routing import LIVE_LEASE_STATES
from kvbroker.v1 import lease_pb2, registry_pb2, sidecar_pb2, sidecar_pb2_grpc

log = logging.getLogger("kvbroker.engine_link")


@dataclass(frozen=True)
class Deadline:
    """Keep ``remote_request_id``'s blocks until ``expires_at`` (this process's monotonic
    clock), computed on receipt from the registry's duration."""

    remote_request_id: str
    lease_id: str
    epoch: int
    expires_at: float
    state: lease_pb2.LeaseState
    reason: str
    # Why the lease ended (UNSPECIFIED while it is live).
    cause: lease_pb2.LeaseEndCause = lease_pb2.LEASE_END_CAUSE_UNSPECIFIED

    @property
    def lease_live(self) -> bool:
        return self.state in LIVE_LEASE_STATES


@dataclass(frozen=True, slots=True)
class LeaseAnswer:
    """The registry's word on a lease, or why there is none."""

    # The registry said the lease may be read at the handle's epoch.
    usable: bool
    reason: str
    # False when no answer came from the registry (no link, RPC failed): nothing was declined,
    # the lease just could not be checked.
    from_registry: bool = True
    # Forks' read pins hold the lease: a read must not free its blocks.
    shared: bool = False


@dataclass(frozen=True, slots=True)
class PrefixAnswer:
    """The registry's word on a prompt's prefix (MatchPrefix), or why there is none: the
    match (a pinned lease, or a typed reason for none), or None when no answer came."""

    match: registry_pb2.MatchPrefixResponse | None
    reason: str = ""


class EngineLink:
    def __init__(
        self,
        target: str,
        engine: sidecar_pb2.EngineInfo,
        reconnect_initial_s: float = 0.05,
        reconnect_max_s: float = 2.0,
    ) -> None:
        self.target = target
        self.engine = engine
        self._reconnect = (reconnect_initial_s, reconnect_max_s)
        self._mirror = RetentionMirror()
        self._deadlines: queue.SimpleQueue[Deadline] = queue.SimpleQueue()
        self._loop: asyncio.AbstractEventLoop | None = None
        # Each event with its position in the mirror's stream.
        self._outbox: asyncio.Queue[tuple[int, registry_pb2.RetentionEvent]] | None = None
        self._thread: threading.Thread | None = None
        self._stop: asyncio.Event | None = None
        self.attached = threading.Event()
        self.node_id = ""
        self._stub: sidecar_pb2_grpc.SidecarServiceStub | None = None

    # ------------------------------------------------------------ called by the engine

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kvbroker-engine-link", daemon=True)
        self._thread.start()

    def retained(self, blocks: registry_pb2.RetainedBlocks) -> None:
        self._send(registry_pb2.RetentionEvent(retained=blocks))

    def released(self, remote_request_id: str, reason: str, cause: lease_pb2.LeaseEndCause) -> None:
        self._send(
            registry_pb2.RetentionEvent(
                released=registry_pb2.ReleasedBlocks(
                    remote_request_id=remote_request_id, reason=reason, cause=cause
                )
            )
        )

    def not_retained(self, conversation_id: str, reason: registry_pb2.NotRetainedReason) -> None:
        """A decode turn of the conversation ended without retaining its KV: the registry
        need not wait for its retention. Lost if the link is down (the wait is bounded)."""
        self._send(
            registry_pb2.RetentionEvent(
                not_retained=registry_pb2.TurnNotRetained(
                    conversation_id=conversation_id, reason=reason
                )
            )
        )

    def reclaim(self, remote_request_id: str, cause: lease_pb2.LeaseEndCause) -> None:
        """Asks the registry to end a lease so its blocks can be freed; the answer comes back
        as a deadline (free now, or keep for a read in flight). Lost if the link is down."""
        self._send(
            registry_pb2.RetentionEvent(
                reclaim=registry_pb2.ReclaimRequest(
                    remote_request_id=remote_request_id, cause=cause
                )
            )
        )

    def poll_deadlines(self) -> list[Deadline]:
        drained: list[Deadline] = []
        with contextlib.suppress(queue.Empty):
            while True:
                drained.append(self._deadlines.get_nowait())
        return drained

    def start_lease_check(self, lease_id: str, epoch: int, timeout_s: float) -> Future[LeaseAnswer]:
        """Asks the registry, through the sidecar, whether a handle may still be read, without
        waiting: the future completes within about ``timeout_s`` (unless the link's loop dies),
        and any failure answers "no" with the reason."""
        loop, stub = self._loop, self._stub
        if loop is None or stub is None or not self.attached.is_set():
            unanswered: Future[LeaseAnswer] = Future()
            unanswered.set_result(LeaseAnswer(False, "no link to the sidecar", from_registry=False))
            return unanswered
        request = sidecar_pb2.CheckLeaseRequest(lease_id=lease_id, epoch=epoch)
        # The call is made on the link's loop: grpc.aio calls belong to the loop they run on.
        return asyncio.run_coroutine_threadsafe(_check_lease(stub, request, timeout_s), loop)

    def start_prefix_match(
        self, conversation_id: str, block_size: int, probes: list[bytes], timeout_s: float
    ) -> Future[PrefixAnswer]:
        """Asks the registry, through the sidecar, for the live lease of another conversation
        the prompt starts with (its hashes at blocks 2^k - 1), without waiting, as
        ``start_lease_check`` does; any failure answers no match with the reason."""
        loop, stub = self._loop, self._stub
        if loop is None or stub is None or not self.attached.is_set():
            unanswered: Future[PrefixAnswer] = Future()
            unanswered.set_result(PrefixAnswer(None, "no link to the sidecar"))
            return unanswered
        request = sidecar_pb2.ResolvePrefixRequest(
            conversation_id=conversation_id, block_size=block_size, probe_hashes=probes
        )
        return asyncio.run_coroutine_threadsafe(_resolve_prefix(stub, request, timeout_s), loop)

    def end_pin(self, lease_id: str, pin_id: str) -> None:
        """The read a prefix match pinned ``lease_id`` for has ended: tells the registry,
        through the sidecar, without waiting. Lost if the link is down (the pin then ends at
        its timeout)."""
        loop, stub = self._loop, self._stub
        if loop is None or stub is None or not self.attached.is_set():
            return
        request = sidecar_pb2.EndPinRequest(lease_id=lease_id, pin_id=pin_id)
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            asyncio.run_coroutine_threadsafe(_end_pin(stub, request), loop)

    def check_lease(self, lease_id: str, epoch: int, timeout_s: float) -> tuple[bool, str]:
        """``start_lease_check`` for callers that may block: waits at most about ``timeout_s``."""
        future = self.start_lease_check(lease_id, epoch, timeout_s)
        try:
            answer = future.result(timeout_s + 0.05)
        except Exception as error:  # timeout, loop gone: both mean "not verified"
            future.cancel()
            return False, f"lease check failed: {error!r}"
        return answer.usable, answer.reason

    def retained_count(self) -> int:
        return len(self._mirror)

    def close(self, timeout: float = 2.0) -> None:
        """Stops the link, first sending what is queued while attached (within ``timeout``):
        the frees of an engine that released its blocks on its way out reach the registry."""
        loop, outbox = self._loop, self._outbox
        if loop is not None and outbox is not None and self.attached.is_set():
            sent = asyncio.wait_for(outbox.join(), timeout)
            try:
                future = asyncio.run_coroutine_threadsafe(sent, loop)
            except RuntimeError:  # the link's loop has ended
                sent.close()
            else:
                with contextlib.suppress(Exception):  # not sent in time
                    future.result(timeout + 0.5)
        if self._loop is not None and self._stop is not None:
            with contextlib.suppress(RuntimeError):  # closed already: the loop has ended
                self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(timeout)

    def _send(self, event: registry_pb2.RetentionEvent) -> None:
        position = self._mirror.record(event)
        loop, outbox = self._loop, self._outbox
        if position is not None and loop is not None and outbox is not None:
            # If the link is down, the next attach's snapshot carries the change instead.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(outbox.put_nowait, (position, event))

    # ------------------------------------------------------------ the link's own thread

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        finally:
            self.attached.clear()

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._outbox = asyncio.Queue()
        self._stop = asyncio.Event()
        stopper = asyncio.create_task(self._stop.wait())
        backoff, backoff_max = self._reconnect
        while not self._stop.is_set():
            session = asyncio.create_task(self._session())
            done, _ = await asyncio.wait({session, stopper}, return_when=asyncio.FIRST_COMPLETED)
            if stopper in done:
                session.cancel()
                await asyncio.gather(session, return_exceptions=True)
                break
            self.attached.clear()
            error = session.exception()
            log.warning("sidecar link down (%s); retrying in %.2fs", error, backoff)
            with contextlib.suppress(TimeoutError):  # a close ends the wait
                await asyncio.wait_for(self._stop.wait(), backoff)
            backoff = min(backoff * 2, backoff_max)

    async def _session(self) -> None:
        assert self._outbox is not None
        async with grpc.aio.insecure_channel(self.target) as channel:
            stub = sidecar_pb2_grpc.SidecarServiceStub(channel)
            response = await stub.AttachEngine(
                sidecar_pb2.AttachEngineRequest(engine=self.engine, retained=self._mirror.replay()),
                timeout=5,
                wait_for_ready=True,
            )
            self.node_id = response.node_id
            self._stub = stub
            watch = stub.WatchDeadlines(sidecar_pb2.WatchDeadlinesRequest())
            self.attached.set()
            # A failure of either ends the session; the next attach's snapshot repairs it.
            try:
                await until_first_exits(self._forward(stub), self._receive(watch))
            finally:
                self._stub = None

    async def _receive(self, watch: grpc.aio.UnaryStreamCall) -> None:
        async for item in watch:
            command = item.command
            if command.state in LIVE_LEASE_STATES:
                # So that a replay restores the lease exactly.
                self._mirror.note_lease(command.remote_request_id, command.lease_id, command.epoch)
            # And so that the next attach's snapshot leaves out a lease that ended (a closed
            # session whose blocks the engine keeps only out the grace): a new sidecar replays
            # that snapshot, and a registry that lost its state would take it back as live.
            self._mirror.note_command(command)
            self._deadlines.put(
                Deadline(
                    remote_request_id=command.remote_request_id,
                    lease_id=command.lease_id,
                    epoch=command.epoch,
                    expires_at=time.monotonic() + from_duration(command.time_to_live),
                    state=command.state,
                    reason=command.reason,
                    cause=command.cause,
                )
            )
        raise ConnectionError("the sidecar closed the deadline stream")

    async def _forward(self, stub: sidecar_pb2_grpc.SidecarServiceStub) -> None:
        assert self._outbox is not None
        while True:
            queued = [await self._outbox.get()]
            while not self._outbox.empty() and len(queued) < 512:
                queued.append(self._outbox.get_nowait())
            # What the last attach's snapshot carried is not sent again.
            events = [event for position, event in queued if not self._mirror.superseded(position)]
            try:
                if events:
                    await stub.SubmitRetentionEvents(
                        sidecar_pb2.SubmitRetentionEventsRequest(events=events), timeout=5
                    )
            finally:  # sent, or left to the next attach's snapshot: either way not queued
                for _ in queued:
                    self._outbox.task_done()


async def _check_lease(
    stub: sidecar_pb2_grpc.SidecarServiceStub,
    request: sidecar_pb2.CheckLeaseRequest,
    timeout_s: float,
) -> LeaseAnswer:
    try:
        response = await stub.CheckLease(request, timeout=timeout_s)
    except Exception as error:  # timeout, RPC error: the lease is not verified
        return LeaseAnswer(False, f"lease check failed: {error!r}", from_registry=False)
    return LeaseAnswer(bool(response.usable), str(response.reason), shared=bool(response.shared))


async def _resolve_prefix(
    stub: sidecar_pb2_grpc.SidecarServiceStub,
    request: sidecar_pb2.ResolvePrefixRequest,
    timeout_s: float,
) -> PrefixAnswer:
    try:
        response = await stub.ResolvePrefix(request, timeout=timeout_s)
    except Exception as error:  # timeout, RPC error: no match, computed locally
        return PrefixAnswer(None, f"prefix match failed: {error!r}")
    return PrefixAnswer(response.match)


async def _end_pin(
    stub: sidecar_pb2_grpc.SidecarServiceStub, request: sidecar_pb2.EndPinRequest
) -> None:
    with contextlib.suppress(Exception):  # best effort: the pin ends at its timeout anyway
        await stub.EndPin(request, timeout=2)
