"""The command outbox: lease commands for holders' sidecars, sent only once committed.

A mutation queues the commands its change implies (``send``); the registry's unit of work
takes them when it releases the lock (``take``) and hands them over once the store has
committed the change (``deliver``), so a holder never acts on a change that could still be
lost. One queue per node incarnation buffers commands while no sidecar is watching.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from controlplane.metrics import RegistryMetrics
from kvbroker.common.clock import to_duration
from kvbroker.v1 import lease_pb2, registry_pb2


@dataclass
class CommandQueue:
    """Commands for one node incarnation, kept while no sidecar is watching."""

    incarnation: str
    pending: asyncio.Queue[registry_pb2.LeaseCommand] = field(default_factory=asyncio.Queue)


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
        self._queues[node_id] = CommandQueue(incarnation)

    def send(self, lease: lease_pb2.Lease, ttl: float, reason: str) -> None:
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
            if queue.pending.qsize() >= self._max_pending:
                queue.pending.get_nowait()
                self._metrics.commands_dropped.inc()
            queue.pending.put_nowait(command)

    async def watch(
        self, node_id: str, incarnation: str
    ) -> AsyncIterator[registry_pb2.LeaseCommand]:
        """A node's commands until a new incarnation takes over or the outbox closes."""
        queue = self._queues.setdefault(node_id, CommandQueue(incarnation))
        while True:
            command = await queue.pending.get()
            if queue is not self._queues.get(node_id):
                return  # a new incarnation took over, or this registry stopped leading
            yield command

    def forget(self, node_id: str) -> None:
        """Drops a forgotten node's queue; a watcher still on it ends."""
        queue = self._queues.pop(node_id, None)
        if queue is not None:
            queue.pending.put_nowait(registry_pb2.LeaseCommand())

    def close(self) -> None:
        """Ends every command stream: their sidecars reconnect to whichever replica leads
        next."""
        queues, self._queues = list(self._queues.values()), {}
        for queue in queues:
            queue.pending.put_nowait(registry_pb2.LeaseCommand())
