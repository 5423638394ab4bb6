"""The lessor, after etcd's ``server/lease``: leases and their conversations, with the lease
expiry and claim deadlines.

A lease is granted when a decode node retains a turn's KV, raising its conversation's epoch
and superseding the previous lease; it is renewed by keep-alives, claimed by a hint that
offers it (a read may be in flight), and ends by release, revocation, expiry or its node's
lost session. Every end that the holder did not cause itself sends it a command saying when
to free the blocks (after any read a claim protects). Call everything under the registry's
lock: changes are committed, and commands sent, by the registry's unit of work.

Every change of a lease's state passes through ``_put``, whose tracking (``lease_tracking``)
derives its deadlines and keeps the prefix index (``prefix_index``) in step; a fork's read pin
(``read_pins``) protects the blocks as a claim does, by the one rule ``reads_protected_until``
(``lease_times``, the time rules every part reads, which ``Leases`` extends).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from kvbroker.common.rules.checkpoints import Checkpoints
from kvbroker.common.rules.labels import label
from kvbroker.common.rules.routing import LIVE_LEASE_STATES
from kvbroker.common.rules.sessionless import holds_all_of, is_sessionless, may_take_over
from kvbroker.controlplane.context import RegistryContext
from kvbroker.controlplane.deadlines import DeadlineKind
from kvbroker.controlplane.errors import (
    InvalidArgument,
    LeaseEnded,
    NotHolder,
    NotRoutedHere,
)
from kvbroker.controlplane.lessor.lease_times import LeaseTimes
from kvbroker.controlplane.lessor.lease_tracking import LeaseTracking, indexed, retained
from kvbroker.controlplane.lessor.prefix_index import PrefixIndex
from kvbroker.controlplane.lessor.turns import Turns
from kvbroker.controlplane.records import codec
from kvbroker.controlplane.records.lease_ids import new_lease_id, next_epoch
from kvbroker.controlplane.records.model import (
    ACTIVE,
    CLAIMED,
    DRAINED,
    ENGINE,
    EXPIRED,
    IDLE,
    NO_CAUSE,
    NODE_LOST,
    RELEASED,
    REVOKED,
    REVOKED_BY_CALLER,
    SUPERSEDED,
    Conversation,
    KvHandle,
    Lease,
    LeaseEndCause,
    LeaseState,
    Node,
)
from kvbroker.controlplane.sessions.idle_ttl import IdleTtl
from kvbroker.controlplane.sessions.nodes import NodeSessions
from kvbroker.controlplane.storage.outbox import Outbox
from kvbroker.v1 import lease_pb2

FORGET_CONVERSATION = DeadlineKind.FORGET_CONVERSATION


class Leases(LeaseTimes):
    def __init__(
        self,
        context: RegistryContext,
        nodes: NodeSessions,
        outbox: Outbox,
        turns: Turns,
        idle_ttl: IdleTtl,
        term: int = 0,
    ) -> None:
        super().__init__(context, nodes, idle_ttl)
        self._store = context.store
        self._metrics = context.metrics
        self._deadlines = context.deadlines
        self._outbox = outbox
        self._turns = turns
        self._log = context.log
        # Rises with every registry that may grant (see ``next_epoch``); 0: no floor.
        self._term = term
        # Live leases by content (forks); their deadlines and index entries follow the records.
        self.prefix_index = PrefixIndex()
        self._tracking = LeaseTracking(
            self._config, self._deadlines, nodes, self.prefix_index, self.pins
        )

    # ----------------------------------------------------------------- lifecycle

    async def grant(
        self,
        node: Node,
        conversation_id: str,
        handle: KvHandle,
        checkpoints: Checkpoints,
        token_count: int,
        ttl: float,
    ) -> Lease:
        existing = await self._store.find_lease(node.node_id, handle.remote_request_id)
        if existing is not None and existing.conversation_id == conversation_id:
            return existing  # a duplicate report of the same retention
        if existing is not None and existing.state in LIVE_LEASE_STATES:
            # One engine request's blocks are one retention: a second live lease over them
            # would free them under the first when either ended.
            raise InvalidArgument(
                f"request {handle.remote_request_id!r} of node {node.node_id!r} is "
                f"retained under live lease {existing.lease_id} of conversation "
                f"{existing.conversation_id!r}"
            )
        now = self._now()
        conversation = await self._store.get_conversation(conversation_id)
        self.require_routed(conversation_id, conversation, node.node_id)
        if conversation is None:
            conversation = Conversation(conversation_id)
        lease = Lease(
            lease_id=new_lease_id(now),
            conversation_id=conversation.conversation_id,
            node_id=codec.intern(node.node_id),
            node_incarnation=codec.intern(node.spec.incarnation),
            epoch=next_epoch(conversation.epoch, self._term),
            handle=handle,
            checkpoints=codec.checkpoints(checkpoints.hashes),
            block_hash_stride=checkpoints.stride,
            token_count=token_count,
            state=ACTIVE,
            grant_time=now,
            renew_time=now,
            expire_time=now + ttl,
        )
        await self._supersede(conversation, lease)
        await self._put(lease)
        self._nodes.account(lease.node_id, handle.block_count, +1)
        self._turns.finished(conversation_id, lease.node_id)
        self._metrics.lease_event("grant").inc()
        await self._end_if_draining(lease)
        await self._end_held_sessionless(lease)
        self._log.debug(
            "lease_granted",
            lease=lease.lease_id,
            conversation=conversation_id,
            node=node.node_id,
            epoch=lease.epoch,
            tokens=token_count,
        )
        return lease

    async def _end_held_sessionless(self, lease: Lease) -> None:
        """A sessionless turn's new lease supersedes the older sessionless leases of its
        tenant whose whole readable content it holds (``sessionless.holds_all_of``): the
        previous turn of the same client's conversation, kept under the id the router named it
        by. One lease per sessionless conversation, not a chain of ever longer copies of its
        history. The ends go the way every early end goes: a command to free after the grace,
        which covers a claim or a fork's pin still reading (``grace_for``). A lease the new one
        shares only part of is another conversation's, and is left alone."""
        if lease.state not in LIVE_LEASE_STATES or not is_sessionless(lease.conversation_id):
            return
        scope = self._tracking.scope(lease)
        if scope is None:
            return
        self._tracking.flush()  # the index is read: a batch's leases are in it first
        block_size = scope.block_size
        held = retained(lease)
        for other_id in self.prefix_index.sharing_all(scope, indexed(lease, block_size)):
            other = await self._store.get_lease(other_id)
            if (
                other is None
                or other.state not in LIVE_LEASE_STATES
                or not may_take_over(other.conversation_id, lease.conversation_id)
                or not holds_all_of(held, retained(other), block_size)
            ):
                continue
            await self.end(
                other,
                REVOKED,
                SUPERSEDED,
                f"superseded by lease {lease.lease_id} of sessionless conversation "
                f"{lease.conversation_id!r}, which holds all of its content",
                command_ttl=self.grace_for(other),
            )

    def require_routed(
        self, conversation_id: str, conversation: Conversation | None, node_id: str
    ) -> None:
        """Who may lease a conversation: a decode node one of its turns in flight was routed
        to, or, with none in flight, the node that held it last (a turn it served without a
        hint) or any node for a conversation the registry does not know (a registry rebuilding
        from its holders' replays); any node for a claim's time after a takeover, whose
        registry does not know the turns its predecessor routed. Anything else would let one
        node's credential pull another's conversation, prompt and all, to itself."""
        routed = self._turns.routed_to(conversation_id)
        holder = conversation.decode_node_id if conversation is not None else ""
        if node_id in routed or (not routed and holder in ("", node_id)):
            return
        if self._turns.inherited():
            return  # the previous leader may have routed it here
        elsewhere = ", ".join(sorted(routed)) if routed else holder
        raise NotRoutedHere(
            f"conversation {conversation_id!r} was routed to node {elsewhere!r}, not "
            f"{node_id!r}: only that node may lease it"
        )

    @contextmanager
    def tracking_deferred(self) -> Iterator[None]:
        """A batch of changes (a node's replay): live leases' index entries and deadlines wait
        for ``flush_tracking`` or the batch's end (``LeaseTracking.defer``)."""
        self._tracking.defer()
        try:
            yield
        finally:
            self._tracking.stop_deferring()

    def flush_tracking(self) -> None:
        """Brings the index and the deadlines up to the records: call before yielding to the
        event loop within ``tracking_deferred``."""
        self._tracking.flush()

    async def revive(
        self,
        lease: Lease,
        incarnation: str,
        ttl: float,
        conversation: Conversation | None,
    ) -> None:
        """Makes a replayed lease live again under the holder's ``incarnation``, as its
        conversation's current lease (its epoch is not behind: the caller checked)."""
        now = self._now()
        lease.node_incarnation = codec.intern(incarnation)
        lease.state = ACTIVE
        lease.end_cause = NO_CAUSE
        lease.end_reason = ""
        lease.end_time = None
        lease.renew_time = now
        lease.expire_time = now + ttl
        await self._put(lease)
        self._nodes.account(lease.node_id, lease.handle.block_count, +1)
        if conversation is None:
            conversation = Conversation(lease.conversation_id)
        await self._supersede(conversation, lease)
        self._metrics.lease_event("restore").inc()
        await self._end_if_draining(lease)

    async def _put(self, lease: Lease, durable: bool = True) -> None:
        """Stores the lease and derives its deadlines from it: the record's times are the one
        truth, and the heap follows them here and nowhere else."""
        await self._store.put_lease(lease, durable)
        self._tracking.track(lease)

    async def _supersede(self, conversation: Conversation, lease: Lease) -> None:
        """Makes ``lease`` the conversation's current one; ends the previous live lease."""
        previous_id = conversation.lease_id
        conversation.epoch = max(conversation.epoch, lease.epoch)
        conversation.lease_id = lease.lease_id
        conversation.decode_node_id = lease.node_id
        conversation.last_active_time = self._now()
        if previous_id and previous_id != lease.lease_id:
            previous = await self._store.get_lease(previous_id)
            if previous is not None and previous.state in LIVE_LEASE_STATES:
                await self.end(
                    previous,
                    REVOKED,
                    SUPERSEDED,
                    f"superseded by lease {lease.lease_id} (epoch {lease.epoch})",
                    command_ttl=self.grace_for(previous),
                    conversation=conversation,
                )
        await self._store.put_conversation(conversation)
        self._deadlines.cancel((FORGET_CONVERSATION, conversation.conversation_id))

    async def renew(self, lease: Lease, ttl: float) -> None:
        if lease.state not in LIVE_LEASE_STATES:
            raise LeaseEnded(
                f"lease {lease.lease_id} is {label(lease_pb2.LeaseState, lease.state)} "
                f"({lease.end_reason}); it cannot be renewed"
            )
        now = self._now()
        expires = max(now + ttl, self.reads_protected_until(lease))
        lease.renew_time = now
        lease.expire_time = expires
        await self._put(lease)
        await self._touch_conversation(lease.conversation_id)
        self._metrics.lease_event("renew").inc()
        self._outbox.send(lease, expires - now, "renewed")

    async def release(self, lease: Lease, node_id: str, incarnation: str, reason: str) -> None:
        """The holder freed the blocks; only the holder may say so."""
        if lease.node_id != node_id or lease.node_incarnation != incarnation:
            raise NotHolder(
                f"lease {lease.lease_id} is held by node {lease.node_id!r} "
                f"(incarnation {lease.node_incarnation!r}); only its holder may release it"
            )
        if lease.state in LIVE_LEASE_STATES:
            await self.end(lease, RELEASED, ENGINE, reason or "released by holder", None)

    async def revoke(self, lease: Lease, reason: str) -> None:
        if lease.state in LIVE_LEASE_STATES:
            await self.end(
                lease,
                REVOKED,
                REVOKED_BY_CALLER,
                reason or "revoked",
                command_ttl=self.grace_for(lease),
            )

    async def drain(self, node_id: str) -> int:
        """The holder is draining: ends its unclaimed live leases now, each with a command to
        free the blocks after the grace (as a revoke); a CLAIMED lease is left to its read,
        and ends when the read frees it or its claim ends (``on_claim_end``). Returns how many
        ended."""
        ended = 0
        for lease in await self._store.live_leases_of_node(node_id):
            if lease.state == ACTIVE:
                await self._end_drained(lease)
                ended += 1
        return ended

    async def _end_if_draining(self, lease: Lease) -> None:
        """A lease that became live on a draining holder (a turn that was already running
        there retained its KV, or a replay) is not offered: it ends at once."""
        if lease.state == ACTIVE and self._nodes.draining(lease.node_id):
            await self._end_drained(lease)

    async def _end_drained(self, lease: Lease) -> None:
        await self.end(
            lease,
            REVOKED,
            DRAINED,
            f"holder node {lease.node_id!r} is draining",
            command_ttl=self.grace_for(lease),
        )

    async def withdraw(self, node_id: str, reason: str) -> None:
        """Ends a node's live leases without commands: the node is not there to receive them."""
        for lease in await self._store.live_leases_of_node(node_id):
            await self.end(lease, REVOKED, NODE_LOST, reason, command_ttl=None)

    async def _touch_conversation(self, conversation_id: str) -> None:
        conversation = await self._store.get_conversation(conversation_id)
        if conversation is not None:
            conversation.last_active_time = self._now()
            await self._store.put_conversation(conversation)

    async def end(
        self,
        lease: Lease,
        state: LeaseState,
        cause: LeaseEndCause,
        reason: str,
        command_ttl: float | None,
        conversation: Conversation | None = None,
    ) -> None:
        """Moves a live lease to an end state for ``cause``; ``command_ttl`` tells the holder
        when to free. ``conversation``: the lease's, when the caller holds it (saves a read)."""
        now = self._now()
        was_live = lease.state in LIVE_LEASE_STATES
        lease.state = state
        lease.end_cause = cause
        lease.end_reason = reason
        lease.end_time = now
        lease.claim_expire_time = None
        await self._put(lease)
        if was_live:
            self._nodes.account(lease.node_id, lease.handle.block_count, -1)
        if conversation is None:
            conversation = await self._store.get_conversation(lease.conversation_id)
        if conversation is not None and conversation.lease_id == lease.lease_id:
            self._deadlines.schedule(
                (FORGET_CONVERSATION, lease.conversation_id),
                now + self._config.conversation_retention_s,
            )
        self._metrics.lease_event(label(lease_pb2.LeaseState, state).lower()).inc()
        self._metrics.lease_end(label(lease_pb2.LeaseEndCause, cause).lower()).inc()
        if command_ttl is not None:
            self._outbox.send(lease, command_ttl, reason)
        self._log.debug(
            "lease_ended",
            lease=lease.lease_id,
            state=label(lease_pb2.LeaseState, state),
            reason=reason,
        )

    async def expire_if_due(self, lease: Lease) -> None:
        """Expires a live lease whose time is up (reads check, so an expired lease is never
        offered even while the deadline task is behind)."""
        if lease.state in LIVE_LEASE_STATES and self.expires(lease) <= self._now():
            await self.end(lease, EXPIRED, IDLE, "not renewed in time", command_ttl=0.0)

    async def claim(self, lease: Lease) -> None:
        """A hint offered the lease: a read may be in flight until the claim ends."""
        now = self._now()
        # Within the holder's hard cap too: the engine frees at one cap after the command
        # that moves its deadline, so no claim may outlast it.
        claim_s = min(self._config.claim_timeout_s, self.hard_cap_s(lease.node_id))
        claim_end = now + claim_s
        lease.state = CLAIMED
        lease.claim_expire_time = claim_end
        extends = self.expires(lease) < claim_end
        if extends:
            lease.expire_time = claim_end
            # The holder must keep the blocks for the whole claim.
            self._outbox.send(lease, claim_end - now, "claimed by a read")
        # A claim is soft state (a successor grants inherited claims a grace instead), unless
        # it moved the expiry: the holder was told the later time, so a store that writes
        # leases must know it (the registry's does not: ``store.REPLAYED``; the holder's replay
        # carries that time instead).
        await self._put(lease, durable=extends)
        self._metrics.lease_event("claim").inc()

    async def pin(self, lease: Lease, reader: str) -> str:
        """A fork on node ``reader`` reads the live lease by content: a read pin until a
        claim's time from now, the lease's state unchanged. Moves the expiry past the pin (and
        tells the holder) as a claim does; returns the pin's id."""
        now = self._now()
        pin_end = now + min(self._config.claim_timeout_s, self.hard_cap_s(lease.node_id))
        pin_id = self.pins.pin(lease.lease_id, pin_end, reader)
        if self.expires(lease) < pin_end:
            lease.expire_time = pin_end
            self._outbox.send(lease, pin_end - now, "pinned by a read")
            await self._put(lease)
        self._metrics.lease_event("pin").inc()
        return pin_id

    # ----------------------------------------------------------------- takeover

    async def restore(self) -> int:
        """Rebuilds the lease deadlines and the holders' figures from the store (a takeover);
        returns the number of live leases."""
        now = self._now()
        config = self._config
        self.inherited_claims_until = now + config.claim_timeout_s
        self._turns.inherited_turns_until = self.inherited_claims_until
        live = 0
        live_conversations: set[str] = set()
        self._tracking.clear()
        for lease in await self._store.list_leases():
            self._tracking.track(lease)
            if lease.state in LIVE_LEASE_STATES:
                self._nodes.account(lease.node_id, lease.handle.block_count, +1)
                live_conversations.add(lease.conversation_id)
                live += 1
        for conversation in await self._store.list_conversations():
            if conversation.conversation_id not in live_conversations:
                self._deadlines.schedule(
                    (FORGET_CONVERSATION, conversation.conversation_id),
                    (conversation.last_active_time or 0.0) + config.conversation_retention_s,
                )
        return live

    # ----------------------------------------------------------------- deadlines

    async def on_expiry(self, lease_id: str) -> None:
        lease = await self._store.get_lease(lease_id)
        if lease is not None and lease.state in LIVE_LEASE_STATES:
            await self.end(lease, EXPIRED, IDLE, "not renewed in time", 0.0)

    async def on_claim_end(self, lease_id: str) -> None:
        lease = await self._store.get_lease(lease_id)
        if lease is not None and lease.state == CLAIMED:
            lease.state = ACTIVE
            lease.claim_expire_time = None
            await self._put(lease, durable=False)
            # No read came while the holder drained: nothing more will.
            await self._end_if_draining(lease)

    async def forget_lease(self, lease_id: str) -> None:
        await self._store.delete_lease(lease_id)

    async def forget_conversation(self, conversation_id: str) -> None:
        conversation = await self._store.get_conversation(conversation_id)
        if conversation is None:
            return
        lease = (
            await self._store.get_lease(conversation.lease_id) if conversation.lease_id else None
        )
        if lease is None or lease.state not in LIVE_LEASE_STATES:
            await self._store.delete_conversation(conversation_id)
