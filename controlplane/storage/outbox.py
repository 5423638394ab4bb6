"""The command outbox: lease commands for holders' sidecars, sent only once committed.

A mutation queues the commands its change implies (``send``); the registry's unit of work
takes them when it releases the lock (``take``) and hands them over once the store has
committed the change (``deliver``), so a holder never acts on a change that could still be
lost. One queue per node incarnation buffers commands while no sidecar is watching.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from kvbroker.common.rules.clock import to_duration
from kvbroker.controlplane.metrics import RegistryMetrics
from kvbroker.controlplane.records.model import Lease
from kvbroker.v1 import registry_pb2


@dataclass(eq=False)
class CommandQueue:
    """Commands for one node incarnation, kept while no sidecar is watching, and the one
    watcher they go to: the latest. Two streams for one node would otherwise split its
    commands between them, each seeing half of its deadlines."""

    incarnation: str
    pending: deque[registry_pb2.LeaseCommand] = field(default_factory=deque)
    # Set when a command arrives, a newer watcher takes over, or the queue is replaced.
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    # Which watch the commands go to (each new watch takes the next number).
    watcher: int = 0


Unsent = list[tuple[CommandQueue, registry_pb2.LeaseCommand]]


class Outbox:
    def __init__(self, max_pending: int, metrics: RegistryMetrics) -> None:
        self._max_pending = max_pending
        self._metrics = metrics
        self._queues: dict[str, CommandQueue] = {}
        # Commands of the mutation in progress, sent once it is committed.
        self._unsent: Unsent = []

    def open(self, node_id: str, incarnation: str) -> None:
        """A fresh queue for a node's new incarnation; its old one's watcher ends."""
        old = self._queues.get(node_id)
        self._queues[node_id] = CommandQueue(incarnation)
        if old is not None:
            old.wake.set()

    def send(self, lease: Lease, ttl: float, reason: str) -> None:
        """Queues a command for the lease's holder, if it is still the incarnation that holds
        the lease."""
        queue = self._queues.get(lease.node_id)
        if queue is None or queue.incarnation != lease.node_incarnation:
            return
        self._unsent.append(
            (
                queue,
                registry_pb2.LeaseCommand(
                    lease_id=lease.lease_id,
                    remote_request_id=lease.handle.remote_request_id,
                    epoch=lease.epoch,
                    time_to_live=to_duration(ttl),
                    state=lease.state,
                    reason=reason,
                    cause=lease.end_cause,
                ),
            )
        )

    def send_to_node(self, node_id: str, command: registry_pb2.LeaseCommand) -> None:
        """Queues a command for a node's current incarnation (no lease to name it by)."""
        queue = self._queues.get(node_id)
        if queue is not None:
            self._unsent.append((queue, command))

    def take(self) -> Unsent:
        """The commands of the mutation that just ended (call under the lock)."""
        unsent, self._unsent = self._unsent, []
        return unsent

    def deliver(self, unsent: Unsent) -> None:
        """Hands committed commands to their queues; a full queue drops its oldest."""
        for queue, command in unsent:
            if len(queue.pending) >= self._max_pending:
                queue.pending.popleft()
                self._metrics.commands_dropped.inc()
            queue.pending.append(command)
            queue.wake.set()

    async def watch(
        self, node_id: str, incarnation: str
    ) -> AsyncIterator[registry_pb2.LeaseCommand]:
        """A node's commands until a newer watch or a new incarnation takes over, or the
        outbox closes."""
        queue = self._queues.setdefault(node_id, CommandQueue(incarnation))
        queue.watcher += 1
        me = queue.watcher
        queue.wake.set()  # an older watcher wakes and finds itself replaced

        def current() -> bool:
            return queue.watcher == me and queue is self._queues.get(node_id)

        while True:
            while not queue.pending and current():
                queue.wake.clear()
                await queue.wake.wait()
            if not current():
                return
            yield queue.pending.popleft()

    def forget(self, node_id: str) -> None:
        """Drops a forgotten node's queue; a watcher still on it ends."""
        queue = self._queues.pop(node_id, None)
        if queue is not None:
            queue.wake.set()

    def close(self) -> None:
        """Ends every command stream: their sidecars reconnect to whichever replica leads
        next."""
        queues, self._queues = list(self._queues.values()), {}
        for queue in queues:
            queue.wake.set()
