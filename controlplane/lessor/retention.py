"""Retention reports and replay: what a decode node's engine retained, freed or wants back,
in its sidecar's ordered events, and the full snapshot it replays after a reconnect.

A replayed lease is kept, revived or recreated unless a newer epoch fences it (then the engine
is told to free it); with a full snapshot, whatever the registry thinks the node holds and the
snapshot lacks is ended, and the node's leases may be offered again (it is synced).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from kvbroker.common.rules.checkpoints import Checkpoints
from kvbroker.common.rules.clock import from_duration
from kvbroker.common.rules.routing import LIVE_LEASE_STATES
from kvbroker.controlplane.context import RegistryContext
from kvbroker.controlplane.errors import InvalidArgument, NotHolder, RegistryError, hint_error
from kvbroker.controlplane.lessor.lease_reads import LeaseReads
from kvbroker.controlplane.lessor.leases import Leases
from kvbroker.controlplane.lessor.turns import Turns
from kvbroker.controlplane.records import codec
from kvbroker.controlplane.records.model import (
    ENGINE,
    FENCED,
    NODE_LOST,
    PRESSURE,
    RELEASED,
    REVOKED,
    Lease,
    Node,
)
from kvbroker.controlplane.records.validation import MAX_COUNTER
from kvbroker.controlplane.sessions.nodes import NodeRuntime, NodeSessions
from kvbroker.controlplane.storage.outbox import Outbox
from kvbroker.v1 import registry_pb2

# Events with the block count of each (counted once, when checked), or the error a malformed
# one is refused with.
CheckedEvents = list[tuple[registry_pb2.RetentionEvent, int | InvalidArgument]]
# A report yields to the event loop after this many events. A replay of thousands would
# otherwise hold the loop for seconds (its awaits on the memory store never suspend), and
# gRPC's server accepts a call only when the loop runs: its core cancels a call nobody
# accepted within 30 s (``grpc.server_max_unrequested_time_in_server``), so during a
# fleet's replays the other replays and the heartbeats ended CANCELLED.
YIELD_EVERY = 100


class RetentionReports:
    def __init__(
        self,
        context: RegistryContext,
        nodes: NodeSessions,
        leases: Leases,
        reads: LeaseReads,
        outbox: Outbox,
        turns: Turns,
    ) -> None:
        self._store = context.store
        self._turns = turns
        self._now = context.now
        self._nodes = nodes
        self._leases = leases
        self._reads = reads
        self._outbox = outbox
        self._validate = context.validate
        self._log = context.log
        # A report runs as one batch: its live leases' index entries and deadlines are done
        # at each yield and at its end (``Leases.tracking_deferred``). Off: each at once, as
        # the tests compare.
        self.batched = True

    def check(self, events: Sequence[registry_pb2.RetentionEvent]) -> CheckedEvents:
        """The events in sequence order, each with its block count or, for a malformed one,
        the error it alone is refused with (check before taking the lock)."""
        checked: CheckedEvents = []
        for event in events:
            try:
                checked.append((event, self._validate.event(event)))
            except InvalidArgument as error:
                checked.append((event, error))
        checked.sort(key=lambda item: item[0].sequence)
        return checked

    async def apply(
        self, node: Node, checked: CheckedEvents, full_snapshot: bool
    ) -> registry_pb2.ReportRetentionResponse:
        """Applies a node's checked events (call under the lock, with the node's session), each
        on its own: an event refused (malformed, or at odds with the registry's state) changes
        nothing and is answered in ``refused``; the others are applied."""
        runtime = self._nodes.current(node)
        # Acks are built in the response itself: copying 100k of them into it afterwards
        # costs a replay as much as building them.
        response = registry_pb2.ReportRetentionResponse()
        if full_snapshot:
            self._reserve_index(checked)
        if not self.batched:
            return await self._apply_all(node, runtime, checked, full_snapshot, response)
        with self._leases.tracking_deferred():
            return await self._apply_all(node, runtime, checked, full_snapshot, response)

    async def _apply_all(
        self,
        node: Node,
        runtime: NodeRuntime,
        checked: CheckedEvents,
        full_snapshot: bool,
        response: registry_pb2.ReportRetentionResponse,
    ) -> registry_pb2.ReportRetentionResponse:
        snapshot_ids: set[str] = set()
        for index, (event, blocks) in enumerate(checked, 1):
            if index % YIELD_EVERY == 0:
                self._leases.flush_tracking()
                await asyncio.sleep(0)
            if not event.HasField("retained"):
                # Released, reclaimed, not retained: they read pins and leases as tracked.
                self._leases.flush_tracking()
            try:
                if isinstance(blocks, RegistryError):
                    raise blocks
                await self._apply_one(node, event, blocks, runtime, full_snapshot, response)
                if event.HasField("retained"):
                    snapshot_ids.add(response.leases[-1].lease_id)
            except RegistryError as error:
                refused = response.refused.add(sequence=event.sequence)
                refused.error.CopyFrom(hint_error(error))
                self._log.warning(
                    "retention_event_refused",
                    node=node.spec.node_id,
                    sequence=event.sequence,
                    error=error.message,
                )
            if event.sequence <= MAX_COUNTER:
                runtime.applied_sequence = max(runtime.applied_sequence, event.sequence)
        if full_snapshot:
            runtime.synced = True
            for lease_id in self._store.live_lease_ids(node.node_id) - snapshot_ids:
                lease = await self._reads.lease(lease_id)
                await self._leases.end(
                    lease, REVOKED, FENCED, "not retained by the engine after reconnect", None
                )
        response.applied_sequence = runtime.applied_sequence
        return response

    def _reserve_index(self, checked: CheckedEvents) -> None:
        """Sizes the prefix index once for a snapshot's leases (a restart replays thousands into
        an empty registry): a lease is keyed at most at its probe blocks, ``bit_length`` of its
        block count (``probe_blocks``); too many only leaves the table emptier."""
        self._leases.prefix_index.reserve(
            sum(
                blocks.bit_length()
                for event, blocks in checked
                if isinstance(blocks, int) and event.HasField("retained")
            )
        )

    async def _apply_one(
        self,
        node: Node,
        event: registry_pb2.RetentionEvent,
        blocks: int,
        runtime: NodeRuntime,
        full_snapshot: bool,
        response: registry_pb2.ReportRetentionResponse,
    ) -> None:
        """One checked event: every check of it against the registry's state comes before
        its first change."""
        stale = event.sequence <= runtime.applied_sequence and not full_snapshot
        if event.HasField("retained"):
            self._nodes.require_holder_role(node)
            lease = await self._retained(node, event.retained, blocks, stale)
            self._leases.ack(lease, response.leases.add())
        elif stale:
            pass
        elif event.HasField("released"):
            await self._released(node, event.released)
        elif event.HasField("not_retained"):
            self._turns.not_retained(node.node_id, event.not_retained)
        else:
            await self._reclaim(node, event.reclaim)

    async def _retained(
        self, node: Node, retained: registry_pb2.RetainedBlocks, blocks: int, replay: bool
    ) -> Lease:
        ttl = self._leases.ttl(from_duration(retained.time_to_live) or None, node.spec.node_id)
        if not retained.lease_id:
            if replay:
                existing = await self._store.find_lease(
                    node.spec.node_id, retained.handle.remote_request_id
                )
                if existing is not None:
                    return existing
            return await self._leases.grant(
                node,
                retained.conversation_id,
                codec.handle_of(retained.handle, blocks),
                Checkpoints.of(retained.block_hashes, retained.block_hash_stride),
                retained.token_count,
                ttl,
            )
        return await self._replayed(node, retained, ttl, blocks)

    async def _replayed(
        self, node: Node, retained: registry_pb2.RetainedBlocks, ttl: float, blocks: int
    ) -> Lease:
        """A replayed lease: kept, revived or recreated, unless a newer epoch fences it."""
        lease = await self._store.get_lease(retained.lease_id)
        conversation = await self._store.get_conversation(retained.conversation_id)
        current_epoch = conversation.epoch if conversation is not None else 0
        fenced = current_epoch > retained.epoch
        if lease is not None and lease.node_id != node.spec.node_id:
            raise NotHolder(
                f"lease {lease.lease_id} is held by node {lease.node_id!r}, "
                f"not {node.spec.node_id!r}"
            )
        await self._check_replayed(node, retained, lease)
        if lease is not None and lease.state in LIVE_LEASE_STATES:
            if lease.node_incarnation != node.spec.incarnation:
                lease.node_incarnation = node.spec.incarnation
                await self._store.put_lease(lease)
            return lease
        revivable = lease is None or (lease.state == REVOKED and lease.end_cause == NODE_LOST)
        if fenced or not revivable:
            if lease is None:
                lease = Lease(
                    lease_id=retained.lease_id,
                    conversation_id=retained.conversation_id,
                    node_id=codec.intern(node.node_id),
                    node_incarnation=codec.intern(node.spec.incarnation),
                    epoch=retained.epoch,
                    handle=codec.handle_of(retained.handle, blocks),
                    state=REVOKED,
                    end_cause=FENCED,
                    end_reason=f"fenced: conversation is at epoch {current_epoch}",
                    end_time=self._now(),
                )
            # The engine still holds blocks the registry no longer stands behind: free them.
            self._outbox.send(lease, 0.0, lease.end_reason)
            return lease
        if lease is None:
            checkpoints = Checkpoints.of(retained.block_hashes, retained.block_hash_stride)
            lease = Lease(
                lease_id=retained.lease_id,
                conversation_id=retained.conversation_id,
                node_id=codec.intern(node.node_id),
                epoch=retained.epoch,
                handle=codec.handle_of(retained.handle, blocks),
                checkpoints=codec.checkpoints(checkpoints.hashes),
                block_hash_stride=checkpoints.stride,
                token_count=retained.token_count,
                grant_time=self._now(),
            )
        await self._leases.revive(lease, node.spec.incarnation, ttl, conversation)
        self._log.debug(
            "lease_restored", lease=lease.lease_id, node=node.spec.node_id, epoch=lease.epoch
        )
        return lease

    async def _check_replayed(
        self,
        node: Node,
        retained: registry_pb2.RetainedBlocks,
        lease: Lease | None,
    ) -> None:
        """A replayed lease id must name what the engine says it retained: the same
        conversation, request and epoch; and no other live lease may hold that request."""
        request_id = retained.handle.remote_request_id
        if lease is not None and (
            lease.conversation_id != retained.conversation_id
            or lease.handle.remote_request_id != request_id
            or lease.epoch != retained.epoch
        ):
            raise InvalidArgument(
                f"lease {lease.lease_id} is conversation {lease.conversation_id!r} request "
                f"{lease.handle.remote_request_id!r} at epoch {lease.epoch}, not what was "
                "replayed"
            )
        other = await self._store.find_lease(node.spec.node_id, request_id)
        if (
            other is not None
            and other.lease_id != retained.lease_id
            and other.state in LIVE_LEASE_STATES
        ):
            raise InvalidArgument(
                f"request {request_id!r} is retained under live lease {other.lease_id}, not "
                f"{retained.lease_id}"
            )

    async def _released(self, node: Node, released: registry_pb2.ReleasedBlocks) -> None:
        lease = await self._store.find_lease(node.spec.node_id, released.remote_request_id)
        if lease is not None and lease.state in LIVE_LEASE_STATES:
            await self._leases.end(
                lease,
                RELEASED,
                released.cause or ENGINE,
                released.reason or "freed by engine",
                None,
            )

    async def _reclaim(self, node: Node, reclaim: registry_pb2.ReclaimRequest) -> None:
        """The holder's engine wants blocks back. Ended here first, freed by the command after:
        from this moment no hint offers the lease and a prefill node's lease check declines it,
        so the only reads that can still touch the blocks are claimed ones, which are kept."""
        lease = await self._store.find_lease(node.spec.node_id, reclaim.remote_request_id)
        if lease is None or lease.state not in LIVE_LEASE_STATES:
            # Nothing the registry stands behind: the engine may free at once.
            self._outbox.send_to_node(
                node.spec.node_id,
                registry_pb2.LeaseCommand(
                    remote_request_id=reclaim.remote_request_id,
                    lease_id=lease.lease_id if lease is not None else "",
                    state=lease.state if lease is not None else RELEASED,
                    cause=lease.end_cause if lease is not None else reclaim.cause,
                    reason="no live lease: free now",
                ),
            )
            return
        leases = self._leases
        now = self._now()
        if leases.reads_protected_until(lease) > now or leases.inherited_claims_until > now:
            # A read may be in flight (a claim or a fork's pin of this registry's, or a claim a
            # previous leader made and did not write down): the holder keeps the blocks for it.
            self._outbox.send(lease, leases.keep_for(lease), "claimed by a read: keep for it")
            return
        why = "memory pressure" if reclaim.cause == PRESSURE else "over its retention budget"
        await leases.end(
            lease, RELEASED, reclaim.cause, f"released by {node.spec.node_id}: {why}", 0.0
        )
