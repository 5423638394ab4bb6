"""The registry's state machine: node sessions, leases with epochs and claims, routing hints.

Every mutation runs under one asyncio lock, so a store with real awaits (etcd) sees the same
ordering as the memory store; its writes are then committed (group commit: the next mutation
may already run while they are in flight), and only after that does it answer or send its lease
commands to holders. Time comes from
the registry's own clock; deadlines live in one heap (``DeadlineQueue``) and are also checked on
read, so an expired lease is never offered even if the expiry task is momentarily behind.

A registry over etcd can take over from another replica: ``restore()`` rebuilds deadlines and
the routing view from the store, and until a holder has replayed to it (its sidecar reconnects
with a full snapshot) hints do not offer that holder's leases and say DEGRADED.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import secrets
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass, field

import structlog

from controlplane.config import RegistryConfig
from controlplane.deadlines import DeadlineQueue
from controlplane.errors import (
    ConversationNotFound,
    InvalidArgument,
    LeaseEnded,
    LeaseNotFound,
    NodeDown,
    NodeNotRegistered,
    NoLeader,
    NoLiveLease,
    NoReadyNode,
    NotADecodeNode,
    NotHolder,
    RegistryError,
    SessionLost,
    StoreUnavailable,
    hint_error,
)
from controlplane.idle_ttl import IdleTtl
from controlplane.metrics import NodeFigures, RegistryMetrics
from controlplane.store import LIVE_STATES, Store
from kvbroker.common import routing
from kvbroker.common.clock import (
    MonotonicClock,
    from_duration,
    from_timestamp,
    stamp_duration,
    stamp_time,
    to_duration,
    to_timestamp,
)
from kvbroker.common.routing import DECODE_ROLES, RoutedNode, cause_name, node_state_name
from kvbroker.v1 import lease_pb2, node_pb2, registry_pb2

log = structlog.get_logger("kvbroker.registry")

ACTIVE = lease_pb2.LEASE_STATE_ACTIVE
CLAIMED = lease_pb2.LEASE_STATE_CLAIMED
RELEASED = lease_pb2.LEASE_STATE_RELEASED
EXPIRED = lease_pb2.LEASE_STATE_EXPIRED
REVOKED = lease_pb2.LEASE_STATE_REVOKED

READY = node_pb2.NODE_STATE_READY
NOT_READY = node_pb2.NODE_STATE_NOT_READY
DRAINING = node_pb2.NODE_STATE_DRAINING
DOWN = node_pb2.NODE_STATE_DOWN

# Why leases end (the cause is what code decides on; the reason is the sentence for people).
READ = lease_pb2.LEASE_END_CAUSE_READ
PRESSURE = lease_pb2.LEASE_END_CAUSE_PRESSURE
BUDGET = lease_pb2.LEASE_END_CAUSE_BUDGET
IDLE = lease_pb2.LEASE_END_CAUSE_IDLE
SUPERSEDED = lease_pb2.LEASE_END_CAUSE_SUPERSEDED
REVOKED_BY_CALLER = lease_pb2.LEASE_END_CAUSE_REVOKED
NODE_LOST = lease_pb2.LEASE_END_CAUSE_NODE_LOST
ENGINE = lease_pb2.LEASE_END_CAUSE_ENGINE
FENCED = lease_pb2.LEASE_END_CAUSE_FENCED
RECLAIM_CAUSES = frozenset({PRESSURE, BUDGET})

# Deadline kinds in the one heap.
LEASE_EXPIRY = "lease"
CLAIM_END = "claim"
NODE_SESSION = "node"
FORGET_LEASE = "forget-lease"
FORGET_CONVERSATION = "forget-conversation"
DeadlineKey = tuple[str, str]
MAX_HINT_BATCH = 1000


_DECISION_LABELS = {
    value: name.removeprefix("HINT_DECISION_") for name, value in registry_pb2.HintDecision.items()
}


def state_name(state: int) -> str:
    return lease_pb2.LeaseState.Name(state).removeprefix("LEASE_STATE_")


def new_lease_id(now: float) -> str:
    """Milliseconds then randomness: unique, and sorts in grant order for listings and paging."""
    return f"{int(now * 1000):011x}{secrets.token_hex(5)}"


def block_count(handle: lease_pb2.KvHandle) -> int:
    return sum(len(group.block_ids) for group in handle.remote_block_groups)


@dataclass
class _CommandQueue:
    """Commands for one node incarnation, kept while no sidecar is watching."""

    incarnation: str
    pending: asyncio.Queue[registry_pb2.LeaseCommand] = field(default_factory=asyncio.Queue)


@dataclass(slots=True, eq=False)
class _NodeRuntime(RoutedNode):
    """One node as this registry runs it: the routing view, kept in step with the stored record
    by every node transition, plus what only the leader knows."""

    # Live leases held there, derived from the leases by every lease transition.
    live_leases: int = 0
    # The last retention event applied from its sidecar.
    applied_sequence: int = 0
    # False for a node known only from the store (after a takeover) until its sidecar replays:
    # its engine may hold deadlines this registry never sent, so its leases are not offered.
    synced: bool = True

    @classmethod
    def of_stored(cls, node: node_pb2.Node, synced: bool) -> _NodeRuntime:
        """The view of a node known from the store (a takeover)."""
        runtime = cls(node.spec, state=node.state, synced=synced)
        runtime.note_load(node.load)
        return runtime


class _Mutation:
    """``async with registry._mutation():`` — a class rather than a generator-based context
    manager, which costs several microseconds more on every hint."""

    __slots__ = ("_registry",)

    def __init__(self, registry: Registry) -> None:
        self._registry = registry

    async def __aenter__(self) -> None:
        await self._registry._lock.acquire()

    async def __aexit__(self, *exc: object) -> None:
        registry = self._registry
        unsent, registry._unsent = registry._unsent, []
        # The next mutation may start on the changed view while this one's writes are being
        # committed (group commit); this one answers, and its commands go out, only after.
        registry._lock.release()
        await registry._commit(unsent)


class Registry:
    def __init__(
        self,
        store: Store,
        config: RegistryConfig | None = None,
        metrics: RegistryMetrics | None = None,
        clock: Callable[[], float] | None = None,
        on_store_failure: Callable[[StoreUnavailable], None] | None = None,
    ) -> None:
        self.store = store
        self.config = config or RegistryConfig()
        self.metrics = metrics or RegistryMetrics()
        self.now = clock or MonotonicClock().now
        self.idle_ttl = IdleTtl(self.config.idle_ttl())
        self.metrics.idle_ttl.set(self.idle_ttl.ttl())
        # Conversations whose turn was hinted and whose retention has not been reported yet:
        # when the turn started, and an event set once it is.
        self._turns: dict[str, tuple[float, asyncio.Event]] = {}
        self._turns_sweep_at = 1024
        self._lock = asyncio.Lock()
        self._deadlines: DeadlineQueue[DeadlineKey] = DeadlineQueue(self.now)
        self._commands: dict[str, _CommandQueue] = {}
        self._runtime: dict[str, _NodeRuntime] = {}
        # model -> ready prefill and decode nodes, until a node's state changes
        self._routes: dict[str, routing.Routes[_NodeRuntime]] = {}
        self._round_robin = itertools.count()
        self._expiry_task: asyncio.Task[None] | None = None
        # Commands of the mutation in progress, sent once it is committed.
        self._unsent: list[tuple[_CommandQueue, registry_pb2.LeaseCommand]] = []
        self._on_store_failure = on_store_failure
        # Until then, early ends give the holder a full claim's grace: claims made by a
        # previous leader were not written down (they are soft state) and may still be reading.
        self._inherited_claims_until = 0.0
        self.metrics.watch_nodes(self._node_figures)
        # Bound once, after logging is configured: through the module's lazy proxy every call
        # (debug ones too, filtered out) costs ~2 µs, and a grant or hint makes several.
        self._log = log.bind()

    # ----------------------------------------------------------------- lifecycle

    def start(self) -> None:
        self._expiry_task = asyncio.create_task(
            self._deadlines.run(self._on_deadlines, self.config.max_expiries_per_batch),
            name="kvbroker-registry-deadlines",
        )

    async def stop(self) -> None:
        if self._expiry_task is not None:
            self._expiry_task.cancel()
            await asyncio.gather(self._expiry_task, return_exceptions=True)
        # End every command stream: their sidecars reconnect to whichever replica leads next.
        queues, self._commands = list(self._commands.values()), {}
        for queue in queues:
            queue.pending.put_nowait(registry_pb2.LeaseCommand())

    def _mutation(self) -> _Mutation:
        """The lock, then the store's commit, then the commands the change implies."""
        return _Mutation(self)

    async def _commit(self, unsent: list[tuple[_CommandQueue, registry_pb2.LeaseCommand]]) -> None:
        """A change that failed half-way is committed as far as it got, as the memory store
        keeps it; commands go out only once their change is durable."""
        try:
            await self.store.commit()
        except StoreUnavailable as error:
            self._log.error("store_commit_failed", error=error.message)
            if self._on_store_failure is not None:
                self._on_store_failure(error)
            raise
        for queue, command in unsent:
            self._enqueue(queue, command)

    async def restore(self) -> None:
        """Rebuilds deadlines and the routing view from the store (a takeover)."""
        now = self.now()
        config = self.config
        self._inherited_claims_until = now + config.claim_timeout_s
        for node in await self.store.list_nodes():
            self._runtime[node.spec.node_id] = _NodeRuntime.of_stored(node, synced=False)
            self._commands[node.spec.node_id] = _CommandQueue(node.spec.incarnation)
            if node.state != DOWN:
                # Sessions restart: heartbeats could not reach a leader during the election.
                self._deadlines.schedule(
                    (NODE_SESSION, node.spec.node_id), now + config.session_ttl_s
                )
        live_conversations: set[str] = set()
        for lease in await self.store.list_leases():
            if lease.state in LIVE_STATES:
                self._deadlines.schedule(
                    (LEASE_EXPIRY, lease.lease_id), from_timestamp(lease.expire_time)
                )
                if lease.state == CLAIMED:
                    self._deadlines.schedule(
                        (CLAIM_END, lease.lease_id), from_timestamp(lease.claim_expire_time)
                    )
                self._account(lease.node_id, block_count(lease.handle), +1)
                live_conversations.add(lease.conversation_id)
            else:
                self._deadlines.schedule(
                    (FORGET_LEASE, lease.lease_id),
                    from_timestamp(lease.end_time) + config.ended_lease_retention_s,
                )
        for conversation in await self.store.list_conversations():
            if conversation.conversation_id not in live_conversations:
                self._deadlines.schedule(
                    (FORGET_CONVERSATION, conversation.conversation_id),
                    from_timestamp(conversation.last_active_time) + config.conversation_retention_s,
                )
        self._log.info(
            "registry_restored",
            nodes=len(self._runtime),
            live_leases=sum(r.live_leases for r in self._runtime.values()),
        )

    # ----------------------------------------------------------------- validation

    def _require_id(self, value: str, what: str) -> str:
        if not value:
            raise InvalidArgument(f"{what} is required")
        if len(value) > self.config.max_id_length:
            raise InvalidArgument(
                f"{what} is {len(value)} characters long; the limit is {self.config.max_id_length}"
            )
        return value

    def _ttl(self, requested: float | None) -> float:
        if requested is None or requested == 0:
            return self.idle_ttl.ttl()
        if requested < 0:
            raise InvalidArgument("time_to_live must not be negative")
        return min(requested, self.config.max_lease_ttl_s)

    async def _node(self, node_id: str) -> node_pb2.Node:
        node = await self.store.get_node(self._require_id(node_id, "node_id"))
        if node is None:
            raise NodeNotRegistered(f"node {node_id!r} is not registered")
        return node

    async def _session(self, node_id: str, incarnation: str) -> node_pb2.Node:
        """The node, if ``incarnation`` is its live session; the caller speaks for the node."""
        node = await self._node(node_id)
        self._require_id(incarnation, "incarnation")
        if node.spec.incarnation != incarnation:
            raise SessionLost(
                f"node {node_id!r} is now incarnation {node.spec.incarnation!r}, "
                f"not {incarnation!r}; register again"
            )
        if node.state == DOWN:
            raise SessionLost(
                f"node {node_id!r} lost its session (missed heartbeats); register again"
            )
        return node

    async def _lease(self, lease_id: str) -> lease_pb2.Lease:
        lease = await self.store.get_lease(self._require_id(lease_id, "lease_id"))
        if lease is None:
            raise LeaseNotFound(f"lease {lease_id!r} does not exist (or ended long ago)")
        return lease

    async def _current_live_lease(self, conversation_id: str) -> lease_pb2.Lease:
        conversation = await self.store.get_conversation(
            self._require_id(conversation_id, "conversation_id")
        )
        if conversation is None:
            raise ConversationNotFound(f"conversation {conversation_id!r} is unknown")
        lease = await self.store.get_lease(conversation.lease_id) if conversation.lease_id else None
        if lease is None or lease.state not in LIVE_STATES:
            raise NoLiveLease(f"conversation {conversation_id!r} has no live lease")
        return lease

    # ----------------------------------------------------------------- views

    def lease_view(
        self, lease: lease_pb2.Lease, into: lease_pb2.Lease | None = None
    ) -> lease_pb2.Lease:
        """A copy for a response, with the time left as of now; written into ``into`` (a
        field of the response) when given, which saves copying a lease twice."""
        view = into if into is not None else lease_pb2.Lease()
        view.CopyFrom(lease)
        if lease.state in LIVE_STATES:
            expires = self._deadlines.deadline((LEASE_EXPIRY, lease.lease_id))
            stamp_duration(view.time_to_live, (expires or 0.0) - self.now())
        return view

    def _lease_ack(self, lease: lease_pb2.Lease, ack: lease_pb2.Lease) -> None:
        """Fills ``ack``, a retention report's answer for one lease, with what the reporter
        lacks, no more (it has the handle and hashes; a replay of 100k leases would otherwise
        echo them all back)."""
        ack.lease_id = lease.lease_id
        ack.conversation_id = lease.conversation_id
        ack.node_id = lease.node_id
        ack.epoch = lease.epoch
        ack.state = lease.state
        ack.end_reason = lease.end_reason
        ack.handle.remote_request_id = lease.handle.remote_request_id
        if lease.state in LIVE_STATES:
            expires = self._deadlines.deadline((LEASE_EXPIRY, lease.lease_id))
            stamp_duration(ack.time_to_live, (expires or 0.0) - self.now())

    def node_view(self, node: node_pb2.Node) -> node_pb2.Node:
        view = node_pb2.Node()
        view.CopyFrom(node)
        runtime = self._runtime.get(node.spec.node_id)
        if runtime is not None:
            view.live_leases = runtime.live_leases
            view.retained_blocks = runtime.retained_blocks
        return view

    def _node_figures(self) -> list[NodeFigures]:
        return [
            NodeFigures(
                node_id=r.node_id,
                state=node_state_name(r.state),
                live_leases=r.live_leases,
                retained_blocks=r.retained_blocks,
                retained_bytes=r.retained_blocks * r.spec.bytes_per_block,
                retained_fraction=r.retained_fraction,
            )
            for r in list(self._runtime.values())
        ]

    # ----------------------------------------------------------------- nodes

    async def register_node(self, spec: node_pb2.NodeSpec) -> node_pb2.Node:
        self._require_id(spec.node_id, "spec.node_id")
        self._require_id(spec.incarnation, "spec.incarnation")
        if spec.role == node_pb2.NODE_ROLE_UNSPECIFIED:
            raise InvalidArgument("spec.role is required (prefill, decode or both)")
        if not spec.model:
            raise InvalidArgument("spec.model is required")
        if spec.block_size == 0:
            raise InvalidArgument("spec.block_size must be positive")
        async with self._mutation():
            now = self.now()
            old = await self.store.get_node(spec.node_id)
            if old is not None and old.spec.incarnation != spec.incarnation:
                await self._withdraw_leases(old, "holder node lost its session: new incarnation")
            node = node_pb2.Node(
                spec=spec,
                state=READY,
                registered_time=to_timestamp(now),
                last_heartbeat_time=to_timestamp(now),
            )
            if old is not None and old.spec.incarnation == spec.incarnation:
                node.registered_time.CopyFrom(old.registered_time)
                node.state = DRAINING if old.state == DRAINING else READY
            new_incarnation = old is None or old.spec.incarnation != spec.incarnation
            if new_incarnation:
                self._commands[spec.node_id] = _CommandQueue(spec.incarnation)
            self._node_runtime(spec, node.state, fresh=new_incarnation)
            await self.store.put_node(node)
            self._deadlines.schedule((NODE_SESSION, spec.node_id), now + self.config.session_ttl_s)
            self._log.info(
                "node_registered",
                node=spec.node_id,
                role=node_pb2.NodeRole.Name(spec.role),
                incarnation=spec.incarnation,
            )
            return self.node_view(node)

    async def heartbeat(
        self, node_id: str, incarnation: str, engine_ready: bool, load: node_pb2.NodeLoad
    ) -> node_pb2.Node:
        async with self._mutation():
            node = await self._session(node_id, incarnation)
            now = self.now()
            stamp_time(node.last_heartbeat_time, now)
            node.load.CopyFrom(load)
            changed = False
            if node.state != DRAINING:
                new_state = READY if engine_ready else NOT_READY
                if new_state != node.state:
                    self._log.info("node_readiness", node=node_id, state=node_state_name(new_state))
                    changed = True
                node.state = new_state
            # Load and heartbeat times are soft state; only a change of readiness is written.
            await self.store.put_node(node, durable=changed)
            runtime = self._node_runtime(node.spec, node.state)
            runtime.note_load(load)
            runtime.assigned_since_heartbeat = 0
            self._deadlines.schedule((NODE_SESSION, node_id), now + self.config.session_ttl_s)
            return self.node_view(node)

    async def deregister_node(self, node_id: str, incarnation: str) -> node_pb2.Node:
        async with self._mutation():
            node = await self._session(node_id, incarnation)
            await self._mark_down(node, "deregistered")
            return self.node_view(node)

    async def drain_node(self, node_id: str) -> node_pb2.Node:
        async with self._mutation():
            node = await self._node(node_id)
            if node.state == DOWN:
                raise NodeDown(f"node {node_id!r} is down; there is nothing to drain")
            node.state = DRAINING
            self._node_runtime(node.spec, DRAINING)
            await self.store.put_node(node)
            self._log.info("node_draining", node=node_id)
            return self.node_view(node)

    async def get_node(self, node_id: str) -> node_pb2.Node:
        return self.node_view(await self._node(node_id))

    async def list_nodes(self, role: int = 0, model: str = "") -> list[node_pb2.Node]:
        return [
            self.node_view(n)
            for n in await self.store.list_nodes()
            if (not role or n.spec.role == role) and (not model or n.spec.model == model)
        ]

    async def _mark_down(self, node: node_pb2.Node, why: str) -> None:
        node.state = DOWN
        self._node_runtime(node.spec, DOWN)
        self._deadlines.cancel((NODE_SESSION, node.spec.node_id))
        await self._withdraw_leases(node, f"holder node lost its session: {why}")
        await self.store.put_node(node)
        self._log.warning("node_down", node=node.spec.node_id, why=why)

    async def _withdraw_leases(self, node: node_pb2.Node, reason: str) -> None:
        """Ends a node's live leases without commands: the node is not there to receive them."""
        for lease in await self.store.live_leases_of_node(node.spec.node_id):
            await self._end_lease(lease, REVOKED, NODE_LOST, reason, command_ttl=None)

    def _node_runtime(
        self, spec: node_pb2.NodeSpec, state: int, fresh: bool = False
    ) -> _NodeRuntime:
        """The node's routing view, now in ``state``; a new one for a new incarnation. Any
        change of who can be routed to drops the cached candidate lists."""
        runtime = None if fresh else self._runtime.get(spec.node_id)
        if runtime is None:
            runtime = self._runtime[spec.node_id] = _NodeRuntime(spec, state=state)
            self._routes.clear()
        elif runtime.state != state:
            runtime.state = state
            self._routes.clear()
        return runtime

    def _account(self, node_id: str, blocks: int, sign: int) -> None:
        """Counts a lease of ``blocks`` in (+1) or out (-1) of its holder's figures."""
        runtime = self._runtime.get(node_id)
        if runtime is not None:
            runtime.live_leases += sign
            runtime.retained_blocks += sign * blocks

    # ----------------------------------------------------------------- leases

    def _validate_retention(
        self, handle: lease_pb2.KvHandle, block_hashes: Sequence[bytes], token_count: int
    ) -> int:
        """Refuses what no engine could have retained; returns the number of blocks (counted
        once: walking a handle's groups costs microseconds, and a replay has 100k)."""
        self._require_id(handle.remote_request_id, "handle.remote_request_id")
        if len(block_hashes) > self.config.max_block_hashes:
            raise InvalidArgument(
                f"{len(block_hashes)} block hashes exceed the limit of "
                f"{self.config.max_block_hashes}"
            )
        blocks = block_count(handle)
        if blocks > self.config.max_block_hashes:
            raise InvalidArgument(
                f"{blocks} block ids exceed the limit of {self.config.max_block_hashes}"
            )
        if token_count == 0:
            raise InvalidArgument("token_count must be positive")
        return blocks

    @staticmethod
    def _require_holder_role(node: node_pb2.Node) -> None:
        if node.spec.role not in DECODE_ROLES:
            raise NotADecodeNode(
                f"node {node.spec.node_id!r} is a prefill node; only decode nodes retain KV "
                "under leases"
            )

    async def grant_lease(
        self,
        conversation_id: str,
        node_id: str,
        incarnation: str,
        handle: lease_pb2.KvHandle,
        block_hashes: Sequence[bytes],
        token_count: int,
        ttl: float | None = None,
    ) -> lease_pb2.Lease:
        self._require_id(conversation_id, "conversation_id")
        blocks = self._validate_retention(handle, block_hashes, token_count)
        lease_ttl = self._ttl(ttl)
        async with self._mutation():
            node = await self._session(node_id, incarnation)
            self._require_holder_role(node)
            return self.lease_view(
                await self._grant(
                    node, conversation_id, handle, block_hashes, token_count, lease_ttl, blocks
                )
            )

    async def _grant(
        self,
        node: node_pb2.Node,
        conversation_id: str,
        handle: lease_pb2.KvHandle,
        block_hashes: Sequence[bytes],
        token_count: int,
        ttl: float,
        blocks: int,
    ) -> lease_pb2.Lease:
        existing = await self.store.find_lease(node.spec.node_id, handle.remote_request_id)
        if existing is not None and existing.conversation_id == conversation_id:
            return existing  # a duplicate report of the same retention
        now = self.now()
        conversation = await self.store.get_conversation(conversation_id)
        if conversation is None:
            conversation = lease_pb2.Conversation(conversation_id=conversation_id)
        lease = lease_pb2.Lease(
            lease_id=new_lease_id(now),
            conversation_id=conversation_id,
            node_id=node.spec.node_id,
            node_incarnation=node.spec.incarnation,
            epoch=conversation.epoch + 1,
            handle=handle,
            block_hashes=block_hashes,
            token_count=token_count,
            state=ACTIVE,
        )
        stamp_time(lease.grant_time, now)
        stamp_time(lease.renew_time, now)
        stamp_time(lease.expire_time, now + ttl)
        await self._supersede(conversation, lease)
        await self.store.put_lease(lease)
        self._account(lease.node_id, blocks, +1)
        self._deadlines.schedule((LEASE_EXPIRY, lease.lease_id), now + ttl)
        self._settle_turn(conversation_id)
        self.metrics.lease_event("grant").inc()
        self._log.debug(
            "lease_granted",
            lease=lease.lease_id,
            conversation=conversation_id,
            node=node.spec.node_id,
            epoch=lease.epoch,
            tokens=token_count,
        )
        return lease

    async def _supersede(
        self, conversation: lease_pb2.Conversation, lease: lease_pb2.Lease
    ) -> None:
        """Makes ``lease`` the conversation's current one; ends the previous live lease."""
        previous_id = conversation.lease_id
        conversation.epoch = max(conversation.epoch, lease.epoch)
        conversation.lease_id = lease.lease_id
        conversation.decode_node_id = lease.node_id
        stamp_time(conversation.last_active_time, self.now())
        if previous_id and previous_id != lease.lease_id:
            previous = await self.store.get_lease(previous_id)
            if previous is not None and previous.state in LIVE_STATES:
                await self._end_lease(
                    previous,
                    REVOKED,
                    SUPERSEDED,
                    f"superseded by lease {lease.lease_id} (epoch {lease.epoch})",
                    command_ttl=self._grace_for(previous),
                    conversation=conversation,
                )
        await self.store.put_conversation(conversation)
        self._deadlines.cancel((FORGET_CONVERSATION, conversation.conversation_id))

    def _grace_for(self, lease: lease_pb2.Lease) -> float:
        """How long the holder must keep blocks after an early end: covers in-flight reads."""
        grace = max(self.config.revoke_grace_s, self._inherited_claims_until - self.now())
        if lease.state == CLAIMED:
            claim_end = self._deadlines.deadline((CLAIM_END, lease.lease_id)) or 0.0
            grace = max(grace, claim_end - self.now())
        return grace

    async def renew_lease(
        self, lease_id: str = "", conversation_id: str = "", ttl: float | None = None
    ) -> lease_pb2.Lease:
        lease_ttl = self._ttl(ttl)
        async with self._mutation():
            if conversation_id:
                lease = await self._current_live_lease(conversation_id)
            else:
                lease = await self._lease(lease_id)
            if lease.state not in LIVE_STATES:
                raise LeaseEnded(
                    f"lease {lease.lease_id} is {state_name(lease.state)} "
                    f"({lease.end_reason}); it cannot be renewed"
                )
            now = self.now()
            expires = now + lease_ttl
            if lease.state == CLAIMED:
                expires = max(expires, self._deadlines.deadline((CLAIM_END, lease.lease_id)) or 0)
            stamp_time(lease.renew_time, now)
            stamp_time(lease.expire_time, expires)
            await self.store.put_lease(lease)
            self._deadlines.schedule((LEASE_EXPIRY, lease.lease_id), expires)
            await self._touch_conversation(lease.conversation_id)
            self.metrics.lease_event("renew").inc()
            self._send_command(lease, expires - now, "renewed")
            return self.lease_view(lease)

    async def release_lease(
        self, lease_id: str, node_id: str, incarnation: str, reason: str
    ) -> lease_pb2.Lease:
        async with self._mutation():
            lease = await self._lease(lease_id)
            self._require_id(node_id, "node_id")
            if lease.node_id != node_id or lease.node_incarnation != incarnation:
                raise NotHolder(
                    f"lease {lease_id} is held by node {lease.node_id!r} "
                    f"(incarnation {lease.node_incarnation!r}); only its holder may release it"
                )
            if lease.state in LIVE_STATES:
                await self._end_lease(lease, RELEASED, ENGINE, reason or "released by holder", None)
            return self.lease_view(lease)

    async def revoke_lease(
        self, lease_id: str = "", conversation_id: str = "", reason: str = ""
    ) -> lease_pb2.Lease:
        async with self._mutation():
            if conversation_id:
                lease = await self._current_live_lease(conversation_id)
            else:
                lease = await self._lease(lease_id)
            if lease.state in LIVE_STATES:
                await self._end_lease(
                    lease,
                    REVOKED,
                    REVOKED_BY_CALLER,
                    reason or "revoked",
                    command_ttl=self._grace_for(lease),
                )
            return self.lease_view(lease)

    async def get_lease(self, lease_id: str) -> lease_pb2.Lease:
        lease = await self._lease(lease_id)
        async with self._mutation():
            await self._expire_if_due(lease)
        return self.lease_view(lease)

    async def list_leases(
        self,
        node_id: str = "",
        conversation_id: str = "",
        states: Sequence[int] = (),
        page_size: int = 0,
        page_token: str = "",
    ) -> tuple[list[lease_pb2.Lease], str]:
        if page_size > 1000:
            raise InvalidArgument(f"page_size {page_size} exceeds the limit of 1000")
        wanted = set(states) or LIVE_STATES
        limit = page_size or 100
        page: list[lease_pb2.Lease] = []
        leases: Iterable[lease_pb2.Lease]
        if conversation_id and wanted <= LIVE_STATES:
            # A conversation has at most one live lease, its current one: no scan.
            leases = await self._current_leases(conversation_id, node_id, page_token)
        else:
            leases = await self.store.list_leases(node_id, conversation_id, after=page_token)
        for lease in leases:
            if lease.state not in wanted:
                continue
            if len(page) == limit:
                return page, page[-1].lease_id
            page.append(self.lease_view(lease))
        return page, ""

    async def _current_leases(
        self, conversation_id: str, node_id: str, after: str
    ) -> list[lease_pb2.Lease]:
        conversation = await self.store.get_conversation(conversation_id)
        if conversation is None or conversation.lease_id <= after:
            return []
        lease = await self.store.get_lease(conversation.lease_id)
        return [lease] if lease is not None and node_id in ("", lease.node_id) else []

    async def get_conversation(self, conversation_id: str) -> lease_pb2.Conversation:
        conversation = await self.store.get_conversation(
            self._require_id(conversation_id, "conversation_id")
        )
        if conversation is None:
            raise ConversationNotFound(f"conversation {conversation_id!r} is unknown")
        view = lease_pb2.Conversation()
        view.CopyFrom(conversation)
        return view

    async def _touch_conversation(self, conversation_id: str) -> None:
        conversation = await self.store.get_conversation(conversation_id)
        if conversation is not None:
            stamp_time(conversation.last_active_time, self.now())
            await self.store.put_conversation(conversation)

    async def _end_lease(
        self,
        lease: lease_pb2.Lease,
        state: int,
        cause: int,
        reason: str,
        command_ttl: float | None,
        conversation: lease_pb2.Conversation | None = None,
    ) -> None:
        """Moves a live lease to an end state for ``cause``; ``command_ttl`` tells the holder
        when to free. ``conversation``: the lease's, when the caller holds it (saves a read)."""
        now = self.now()
        was_live = lease.state in LIVE_STATES
        lease.state = state  # type: ignore[assignment]
        lease.end_cause = cause  # type: ignore[assignment]
        lease.end_reason = reason
        stamp_time(lease.end_time, now)
        lease.ClearField("claim_expire_time")
        await self.store.put_lease(lease)
        self._deadlines.cancel((LEASE_EXPIRY, lease.lease_id))
        self._deadlines.cancel((CLAIM_END, lease.lease_id))
        self._deadlines.schedule(
            (FORGET_LEASE, lease.lease_id), now + self.config.ended_lease_retention_s
        )
        if was_live:
            self._account(lease.node_id, block_count(lease.handle), -1)
        if conversation is None:
            conversation = await self.store.get_conversation(lease.conversation_id)
        if conversation is not None and conversation.lease_id == lease.lease_id:
            self._deadlines.schedule(
                (FORGET_CONVERSATION, lease.conversation_id),
                now + self.config.conversation_retention_s,
            )
        self.metrics.lease_event(state_name(state).lower()).inc()
        self.metrics.lease_end(cause_name(cause).lower()).inc()
        if command_ttl is not None:
            self._send_command(lease, command_ttl, reason)
        self._log.debug("lease_ended", lease=lease.lease_id, state=state_name(state), reason=reason)

    async def _expire_if_due(self, lease: lease_pb2.Lease) -> bool:
        """Expires a live lease whose deadline has passed; True if it is (now) not live."""
        if lease.state not in LIVE_STATES:
            return True
        expires = self._deadlines.deadline((LEASE_EXPIRY, lease.lease_id))
        if expires is not None and expires <= self.now():
            await self._end_lease(lease, EXPIRED, IDLE, "not renewed in time", command_ttl=0.0)
            return True
        return False

    # ----------------------------------------------------------------- retention reports

    async def report_retention(
        self,
        node_id: str,
        incarnation: str,
        events: Sequence[registry_pb2.RetentionEvent],
        full_snapshot: bool,
    ) -> registry_pb2.ReportRetentionResponse:
        checked: list[tuple[registry_pb2.RetentionEvent, int]] = []  # with block counts
        for event in events:
            blocks = 0
            if event.HasField("retained"):
                r = event.retained
                self._require_id(r.conversation_id, "retained.conversation_id")
                blocks = self._validate_retention(r.handle, r.block_hashes, r.token_count)
            elif event.HasField("released"):
                self._require_id(event.released.remote_request_id, "released.remote_request_id")
            elif event.HasField("reclaim"):
                self._require_id(event.reclaim.remote_request_id, "reclaim.remote_request_id")
                if event.reclaim.cause not in RECLAIM_CAUSES:
                    raise InvalidArgument(
                        f"event {event.sequence}: a reclaim's cause must be PRESSURE or BUDGET"
                    )
            else:
                raise InvalidArgument(
                    f"event {event.sequence} is neither retained, released nor a reclaim"
                )
            checked.append((event, blocks))
        checked.sort(key=lambda item: item[0].sequence)
        async with self._mutation():
            node = await self._session(node_id, incarnation)
            runtime = self._node_runtime(node.spec, node.state)
            # Acks are built in the response itself: copying 100k of them into it afterwards
            # costs a replay as much as building them.
            response = registry_pb2.ReportRetentionResponse()
            snapshot_ids: set[str] = set()
            for event, blocks in checked:
                stale = event.sequence <= runtime.applied_sequence and not full_snapshot
                if event.HasField("retained"):
                    self._require_holder_role(node)
                    lease = await self._apply_retained(node, event.retained, blocks, stale)
                    snapshot_ids.add(lease.lease_id)
                    self._lease_ack(lease, response.leases.add())
                elif stale:
                    pass
                elif event.HasField("released"):
                    await self._apply_released(node, event.released)
                else:
                    await self._apply_reclaim(node, event.reclaim)
                runtime.applied_sequence = max(runtime.applied_sequence, event.sequence)
            if full_snapshot:
                runtime.synced = True
                for lease_id in self.store.live_lease_ids(node_id) - snapshot_ids:
                    lease = await self._lease(lease_id)
                    await self._end_lease(
                        lease, REVOKED, FENCED, "not retained by the engine after reconnect", None
                    )
            response.applied_sequence = runtime.applied_sequence
            return response

    async def _apply_retained(
        self, node: node_pb2.Node, retained: registry_pb2.RetainedBlocks, blocks: int, replay: bool
    ) -> lease_pb2.Lease:
        ttl = self._ttl(from_duration(retained.time_to_live) or None)
        if not retained.lease_id:
            if replay:
                existing = await self.store.find_lease(
                    node.spec.node_id, retained.handle.remote_request_id
                )
                if existing is not None:
                    return existing
            return await self._grant(
                node,
                retained.conversation_id,
                retained.handle,
                retained.block_hashes,
                retained.token_count,
                ttl,
                blocks,
            )
        return await self._restore(node, retained, ttl, blocks)

    async def _restore(
        self, node: node_pb2.Node, retained: registry_pb2.RetainedBlocks, ttl: float, blocks: int
    ) -> lease_pb2.Lease:
        """A replayed lease: kept, revived or recreated, unless a newer epoch fences it."""
        now = self.now()
        lease = await self.store.get_lease(retained.lease_id)
        conversation = await self.store.get_conversation(retained.conversation_id)
        current_epoch = conversation.epoch if conversation is not None else 0
        fenced = current_epoch > retained.epoch
        if lease is not None and lease.node_id != node.spec.node_id:
            raise NotHolder(
                f"lease {lease.lease_id} is held by node {lease.node_id!r}, "
                f"not {node.spec.node_id!r}"
            )
        if lease is not None and lease.state in LIVE_STATES:
            if lease.node_incarnation != node.spec.incarnation:
                lease.node_incarnation = node.spec.incarnation
                await self.store.put_lease(lease)
            return lease
        revivable = lease is None or (lease.state == REVOKED and lease.end_cause == NODE_LOST)
        if fenced or not revivable:
            if lease is None:
                lease = lease_pb2.Lease(
                    lease_id=retained.lease_id,
                    conversation_id=retained.conversation_id,
                    node_id=node.spec.node_id,
                    node_incarnation=node.spec.incarnation,
                    epoch=retained.epoch,
                    handle=retained.handle,
                    state=REVOKED,
                    end_cause=FENCED,
                    end_reason=f"fenced: conversation is at epoch {current_epoch}",
                    end_time=to_timestamp(now),
                )
            # The engine still holds blocks the registry no longer stands behind: free them.
            self._send_command(lease, 0.0, lease.end_reason)
            return lease
        if lease is None:
            lease = lease_pb2.Lease(
                lease_id=retained.lease_id,
                conversation_id=retained.conversation_id,
                node_id=node.spec.node_id,
                epoch=retained.epoch,
                handle=retained.handle,
                block_hashes=retained.block_hashes,
                token_count=retained.token_count,
            )
            stamp_time(lease.grant_time, now)
        lease.node_incarnation = node.spec.incarnation
        lease.state = ACTIVE
        lease.ClearField("end_cause")
        lease.end_reason = ""
        lease.ClearField("end_time")
        stamp_time(lease.renew_time, now)
        stamp_time(lease.expire_time, now + ttl)
        self._deadlines.cancel((FORGET_LEASE, lease.lease_id))
        self._deadlines.schedule((LEASE_EXPIRY, lease.lease_id), now + ttl)
        await self.store.put_lease(lease)
        self._account(lease.node_id, blocks, +1)
        if conversation is None:
            conversation = lease_pb2.Conversation(conversation_id=retained.conversation_id)
        await self._supersede(conversation, lease)
        self.metrics.lease_event("restore").inc()
        self._log.debug(
            "lease_restored", lease=lease.lease_id, node=node.spec.node_id, epoch=lease.epoch
        )
        return lease

    async def _apply_released(
        self, node: node_pb2.Node, released: registry_pb2.ReleasedBlocks
    ) -> None:
        lease = await self.store.find_lease(node.spec.node_id, released.remote_request_id)
        if lease is not None and lease.state in LIVE_STATES:
            await self._end_lease(
                lease,
                RELEASED,
                released.cause or ENGINE,
                released.reason or "freed by engine",
                None,
            )

    async def _apply_reclaim(
        self, node: node_pb2.Node, reclaim: registry_pb2.ReclaimRequest
    ) -> None:
        """The holder's engine wants blocks back. Ended here first, freed by the command after:
        from this moment no hint offers the lease and a prefill node's lease check declines it,
        so the only reads that can still touch the blocks are claimed ones, which are kept."""
        lease = await self.store.find_lease(node.spec.node_id, reclaim.remote_request_id)
        if lease is None or lease.state not in LIVE_STATES:
            # Nothing the registry stands behind: the engine may free at once.
            self._unsent_command(
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
        if lease.state == CLAIMED or self._inherited_claims_until > self.now():
            # A read may be in flight (a claim of this registry's, or one a previous leader
            # made and did not write down): the holder keeps the blocks for it.
            self._send_command(lease, self._grace_for(lease), "claimed by a read: keep for it")
            return
        why = "memory pressure" if reclaim.cause == PRESSURE else "over its retention budget"
        await self._end_lease(
            lease, RELEASED, reclaim.cause, f"released by {node.spec.node_id}: {why}", 0.0
        )

    # ----------------------------------------------------------------- commands

    def _send_command(self, lease: lease_pb2.Lease, ttl: float, reason: str) -> None:
        """Queues a command for the holder, sent once the current mutation is committed."""
        queue = self._commands.get(lease.node_id)
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

    def _unsent_command(self, node_id: str, command: registry_pb2.LeaseCommand) -> None:
        """Queues a command for a node's current incarnation (no lease to name it by)."""
        queue = self._commands.get(node_id)
        if queue is not None:
            self._unsent.append((queue, command))

    def _enqueue(self, queue: _CommandQueue, command: registry_pb2.LeaseCommand) -> None:
        if queue.pending.qsize() >= self.config.max_pending_commands:
            queue.pending.get_nowait()
            self.metrics.commands_dropped.inc()
        queue.pending.put_nowait(command)

    async def watch_commands(
        self, node_id: str, incarnation: str
    ) -> AsyncIterator[registry_pb2.LeaseCommand]:
        await self._session(node_id, incarnation)
        queue = self._commands.setdefault(node_id, _CommandQueue(incarnation))
        while True:
            command = await queue.pending.get()
            if queue is not self._commands.get(node_id):
                return  # a new incarnation took over, or this registry stopped leading
            yield command

    # ----------------------------------------------------------------- hints

    async def routing_hint(
        self, conversation_id: str, model: str, dry_run: bool = False
    ) -> registry_pb2.RoutingHint:
        if conversation_id:
            self._require_id(conversation_id, "conversation_id")
            if not dry_run:
                await self._settled((conversation_id,))
        hint = registry_pb2.RoutingHint()
        async with self._mutation():
            await self._hint(conversation_id, model, dry_run, hint)
        return hint

    async def routing_hints(
        self, requests: Sequence[registry_pb2.GetRoutingHintRequest]
    ) -> registry_pb2.BatchGetRoutingHintsResponse:
        """Each request's hint, or the error it alone would have failed with, under one lock
        and one commit; written straight into the response (at saturation a copy of each hint
        cost a tenth of the registry's time)."""
        if len(requests) > MAX_HINT_BATCH:
            raise InvalidArgument(
                f"{len(requests)} hint requests exceed the batch limit of {MAX_HINT_BATCH}"
            )
        response = registry_pb2.BatchGetRoutingHintsResponse()
        if self._turns:
            await self._settled(
                r.conversation_id
                for r in requests
                if r.conversation_id
                and not r.dry_run
                and len(r.conversation_id) <= self.config.max_id_length
            )
        async with self._mutation():
            for request in requests:
                result = response.results.add()
                try:
                    if request.conversation_id:
                        self._require_id(request.conversation_id, "conversation_id")
                    await self._hint(
                        request.conversation_id, request.model, request.dry_run, result.hint
                    )
                except RegistryError as error:
                    result.error.CopyFrom(hint_error(error))  # replaces a half-made hint
        return response

    async def _hint(
        self, conversation_id: str, model: str, dry_run: bool, hint: registry_pb2.RoutingHint
    ) -> None:
        """Writes one hint into ``hint`` (call under the lock); unless ``dry_run``, claims the
        lease it offers and counts the choice."""
        started = self.now()
        routes = self._routes.get(model)
        if routes is None:
            try:
                routes = self._routes[model] = routing.candidates(self._runtime.values(), model)
            except routing.NoReadyNode as error:
                raise NoReadyNode(error.message) from error
        conversation = (
            await self.store.get_conversation(conversation_id) if conversation_id else None
        )
        lease = await self._current_lease(conversation, claim=not dry_run)
        holder = self._runtime.get(lease.node_id) if lease is not None else None
        reuse = routing.reuse_decision(
            conversation_id, conversation, lease, holder, holder is not None and holder.synced
        )
        if reuse.reuses and lease is not None and not dry_run:
            await self._claim(lease)
        holder_id = conversation.decode_node_id if conversation is not None else ""
        prefill, decode = routing.choose(routes, next(self._round_robin), holder=holder_id)
        if not dry_run:
            prefill.assigned_since_heartbeat += 1
            decode.assigned_since_heartbeat += 1
            if conversation_id:
                self._turn_started(conversation_id)
        consistency = (
            registry_pb2.HINT_CONSISTENCY_EXACT
            if reuse.exact
            else registry_pb2.HINT_CONSISTENCY_DEGRADED
        )
        hint.decision = reuse.decision
        hint.reason = reuse.reason
        hint.consistency = consistency
        hint.prefill.CopyFrom(prefill.spec)
        hint.decode.CopyFrom(decode.spec)
        if reuse.reuses and lease is not None:
            self.lease_view(lease, into=hint.lease)
        label = "EXACT" if reuse.exact else "DEGRADED"
        self.metrics.hint(_DECISION_LABELS[reuse.decision], label).inc()
        self.metrics.hint_latency.observe(self.now() - started)

    async def _current_lease(
        self, conversation: lease_pb2.Conversation | None, claim: bool
    ) -> lease_pb2.Lease | None:
        """The conversation's current lease as of now (expired if its time is up); a turn that
        starts (``claim``) teaches the idle TTL the gap since the conversation was active."""
        if conversation is None:
            return None
        if claim:
            self._observe_gap(conversation)
        if not conversation.lease_id:
            return None
        lease = await self.store.get_lease(conversation.lease_id)
        if lease is not None:
            await self._expire_if_due(lease)
        return lease

    def _observe_gap(self, conversation: lease_pb2.Conversation) -> None:
        if conversation.HasField("last_active_time"):
            self.idle_ttl.observe_gap(self.now() - from_timestamp(conversation.last_active_time))
            self.metrics.idle_ttl.set(self.idle_ttl.ttl())

    # ------------------------------------------------------------- turns still finishing

    def _turn_started(self, conversation_id: str) -> None:
        """A hint sent a turn of this conversation to a decode node, which will report its
        retention when the turn ends (call under the lock)."""
        if conversation_id not in self._turns:
            if len(self._turns) >= self._turns_sweep_at:
                self._sweep_turns()
            self._turns[conversation_id] = (self.now(), asyncio.Event())

    def _settle_turn(self, conversation_id: str) -> None:
        turn = self._turns.pop(conversation_id, None)
        if turn is not None:
            turn[1].set()

    def _sweep_turns(self) -> None:
        """Forgets turns that never reported retention (aborted, failed, not retained)."""
        horizon = self.now() - self.config.claim_timeout_s - self.config.turn_settle_timeout_s
        for conversation_id, (started, _) in list(self._turns.items()):
            if started < horizon:
                self._settle_turn(conversation_id)
        self._turns_sweep_at = max(2 * len(self._turns), 1024)

    async def _settled(self, conversation_ids: Iterable[str]) -> None:
        """Waits, up to the settle timeout, for the retention of previous turns still
        finishing: a conversation whose current lease is not ACTIVE (consumed by the read
        that started its last turn, or claimed by it) but whose last turn's retention has not
        been reported yet. Without the wait such a turn recomputes what its decode node is
        about to report."""
        waits: dict[str, asyncio.Event] = {}
        for conversation_id in conversation_ids:
            turn = self._turns.get(conversation_id)
            if turn is None or conversation_id in waits:
                continue
            conversation = await self.store.get_conversation(conversation_id)
            lease_id = conversation.lease_id if conversation is not None else ""
            lease = await self.store.get_lease(lease_id) if lease_id else None
            if lease is None or lease.state != ACTIVE:
                waits[conversation_id] = turn[1]
        if not waits:
            return
        done, _ = await asyncio.wait(
            [asyncio.ensure_future(event.wait()) for event in waits.values()],
            timeout=self.config.turn_settle_timeout_s,
        )
        settled = len(done)
        self.metrics.settle_waits.labels("settled").inc(settled)
        if settled < len(waits):
            self.metrics.settle_waits.labels("timeout").inc(len(waits) - settled)
            for conversation_id, event in waits.items():
                if not event.is_set():
                    event.set()  # wakes the waiter task created above
                    # That turn will not report (or is a parallel request still running):
                    # later hints need not wait for it again.
                    self._turns.pop(conversation_id, None)

    async def _claim(self, lease: lease_pb2.Lease) -> None:
        now = self.now()
        claim_end = now + self.config.claim_timeout_s
        lease.state = CLAIMED
        stamp_time(lease.claim_expire_time, claim_end)
        expires = self._deadlines.deadline((LEASE_EXPIRY, lease.lease_id)) or now
        extends = expires < claim_end
        if extends:
            stamp_time(lease.expire_time, claim_end)
            self._deadlines.schedule((LEASE_EXPIRY, lease.lease_id), claim_end)
            # The holder must keep the blocks for the whole claim.
            self._send_command(lease, claim_end - now, "claimed by a read")
        self._deadlines.schedule((CLAIM_END, lease.lease_id), claim_end)
        # A claim is soft state (a successor grants inherited claims a grace instead), unless
        # it moved the expiry: the holder was told the later time, so the store must know it.
        await self.store.put_lease(lease, durable=extends)
        self.metrics.lease_event("claim").inc()

    # ----------------------------------------------------------------- deadlines

    async def _on_deadlines(self, keys: list[DeadlineKey]) -> None:
        with contextlib.suppress(StoreUnavailable):  # the replica steps down and reloads
            await self._apply_deadlines(keys)

    async def _apply_deadlines(self, keys: list[DeadlineKey]) -> None:
        async with self._mutation():
            for kind, key in keys:
                if kind == LEASE_EXPIRY:
                    lease = await self.store.get_lease(key)
                    if lease is not None and lease.state in LIVE_STATES:
                        await self._end_lease(lease, EXPIRED, IDLE, "not renewed in time", 0.0)
                elif kind == CLAIM_END:
                    lease = await self.store.get_lease(key)
                    if lease is not None and lease.state == CLAIMED:
                        lease.state = ACTIVE
                        lease.ClearField("claim_expire_time")
                        await self.store.put_lease(lease, durable=False)
                elif kind == NODE_SESSION:
                    node = await self.store.get_node(key)
                    if node is not None and node.state != DOWN:
                        await self._mark_down(node, "missed heartbeats")
                elif kind == FORGET_LEASE:
                    await self.store.delete_lease(key)
                elif kind == FORGET_CONVERSATION:
                    await self._forget_conversation(key)

    async def _forget_conversation(self, conversation_id: str) -> None:
        conversation = await self.store.get_conversation(conversation_id)
        if conversation is None:
            return
        lease = await self.store.get_lease(conversation.lease_id) if conversation.lease_id else None
        if lease is None or lease.state not in LIVE_STATES:
            await self.store.delete_conversation(conversation_id)


async def cached_hint(
    store: Store, conversation_id: str, model: str, why: str, turn: int
) -> registry_pb2.RoutingHint:
    """A follower's answer while no leader can be reached: nodes from its watch-fed cache, no
    reuse (only a leader can claim a lease), the conversation's last decode node kept."""
    nodes = [RoutedNode.of_node(node) for node in await store.list_nodes()]
    try:
        routes = routing.candidates(nodes, model)
    except routing.NoReadyNode as error:
        # Not the leader's word on the nodes: a router then routes from its own node list.
        raise NoLeader(
            f"no registry leader reachable ({why}) and this replica's cache cannot route: "
            + error.message
        ) from error
    conversation = await store.get_conversation(conversation_id) if conversation_id else None
    holder = conversation.decode_node_id if conversation is not None else ""
    prefill, decode = routing.choose(routes, turn, holder=holder)
    reuse = routing.leaderless_decision(conversation is not None, why)
    return registry_pb2.RoutingHint(
        decision=reuse.decision,
        reason=reuse.reason,
        consistency=registry_pb2.HINT_CONSISTENCY_DEGRADED,
        prefill=prefill.spec,
        decode=decode.spec,
    )
