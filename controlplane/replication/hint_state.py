"""The leader's hint state, streamed to its followers, so that every replica answers hints.

A follower's etcd watch carries the nodes only: leases, conversations and the nodes' load are
the leader's soft state, never written (docs/design.md, "Durable and soft state"). So the
leader streams what hints read to each follower (``WatchHintState``): every record of its
cache once, then every record that changed since the last message, or an empty message as a
keepalive. ``HintFeed`` is the leader's side; ``HintView`` a follower's copy, which knows how
far behind the leader it is (``behind_s``); ``FollowedHints`` keeps one current.

Changes are coalesced: ``CachedStore`` tells the feed which records it put (``changed``), and
every ``FLUSH_S`` the feed sends the current bytes of each. So a record that changed ten times
in a flush is encoded once, and nothing is tracked while no follower listens. A follower that
cannot keep up (its queue of ``QUEUE_MESSAGES`` is full) is cut off and starts over with a new
snapshot; so is every follower when the leader steps down (``close``).

How far behind the leader a copy is: the time since the last message, plus how much later
than the least delayed message so far that message arrived (leader and follower clocks may
differ by any constant: only differences of one side's times are used, as the clock rules
say). A backlog in the stream or in the follower's own loop shows as delay.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field

import grpc
import structlog

from kvbroker.common.rules import routing
from kvbroker.common.rules.clock import from_timestamp, stamp_time
from kvbroker.controlplane.records.codec import record_bytes
from kvbroker.controlplane.records.model import Node
from kvbroker.controlplane.storage.cached_store import CachedStore
from kvbroker.controlplane.storage.state_cache import RecordKind, StateCache
from kvbroker.v1 import registry_pb2
from kvbroker.v1.registry_pb2_grpc import RegistryServiceStub

log = structlog.get_logger("kvbroker.registry")

# How often changed records go out, and how often an empty message says none did.
FLUSH_S = 0.02
KEEPALIVE_S = 0.1
# Records per snapshot message (a lease is ~1 KB: well under gRPC's 4 MiB message limit).
SNAPSHOT_CHUNK = 500
# Messages a follower may fall behind by before the leader cuts its stream off.
QUEUE_MESSAGES = 1000

KINDS = {
    RecordKind.NODE: registry_pb2.HINT_RECORD_KIND_NODE,
    RecordKind.CONVERSATION: registry_pb2.HINT_RECORD_KIND_CONVERSATION,
    RecordKind.LEASE: registry_pb2.HINT_RECORD_KIND_LEASE,
}
RECORD_KINDS = {number: kind for kind, number in KINDS.items()}


@dataclass(eq=False)
class _Follower:
    queue: asyncio.Queue[registry_pb2.WatchHintStateResponse | None] = field(
        default_factory=lambda: asyncio.Queue(QUEUE_MESSAGES)
    )


class HintFeed:
    """The leader's side: its cache's records to each follower that asks, as they change."""

    def __init__(self, store: CachedStore, now: Callable[[], float]) -> None:
        self._store = store
        self._now = now
        self._dirty: set[tuple[RecordKind, str]] = set()
        self._followers: set[_Follower] = set()
        self._task: asyncio.Task[None] | None = None

    def changed(self, kind: RecordKind, ident: str) -> None:
        """``CachedStore`` put this record: it goes out with the next flush."""
        if self._followers:
            self._dirty.add((kind, ident))

    def undone(self) -> None:
        """The store undid records it does not name: every follower starts over."""
        self._dirty.clear()
        for follower in self._followers:
            _end(follower)
        self._followers.clear()

    def start(self) -> None:
        self._store.feed = self
        self._task = asyncio.create_task(self._run(), name="kvbroker-hint-feed")

    async def close(self) -> None:
        """The leader steps down: every follower's stream ends."""
        if self._store.feed is self:
            self._store.feed = None
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self.undone()

    async def subscribe(self) -> AsyncIterator[registry_pb2.WatchHintStateResponse]:
        """A snapshot, then the changes, until the follower falls behind or the leader steps
        down. Changes are tracked from before the snapshot is read, so a record that changes
        while the snapshot goes out is sent again."""
        follower = _Follower()
        self._followers.add(follower)
        try:
            for message in self._snapshot():
                yield message
            while True:
                change = await follower.queue.get()
                if change is None:
                    return
                yield change
        finally:
            self._followers.discard(follower)

    def _snapshot(self) -> Iterator[registry_pb2.WatchHintStateResponse]:
        cache = self._store.cache
        keys = [(RecordKind.NODE, node.spec.node_id) for node in cache.nodes()]
        keys += [(RecordKind.CONVERSATION, c.conversation_id) for c in cache.conversations()]
        keys += [(RecordKind.LEASE, lease.lease_id) for lease in cache.leases()]
        for start in range(0, max(len(keys), 1), SNAPSHOT_CHUNK):
            chunk = keys[start : start + SNAPSHOT_CHUNK]
            message = self._message(chunk)
            message.snapshot_complete = start + SNAPSHOT_CHUNK >= len(keys)
            yield message

    def _message(self, keys: list[tuple[RecordKind, str]]) -> registry_pb2.WatchHintStateResponse:
        """The records' bytes as the cache holds them now (a record gone: empty)."""
        message = registry_pb2.WatchHintStateResponse()
        cache = self._store.cache
        for kind, ident in keys:
            record = cache.record(kind, ident)
            raw = record_bytes(record) if record is not None else b""
            message.records.add(kind=KINDS[kind], id=ident, record=raw)
        stamp_time(message.leader_time, self._now())
        return message

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        sent_at = loop.time()
        while True:
            await asyncio.sleep(FLUSH_S)
            if not self._followers or (not self._dirty and loop.time() - sent_at < KEEPALIVE_S):
                continue
            keys, self._dirty = list(self._dirty), set()
            message = self._message(keys)
            sent_at = loop.time()
            for follower in list(self._followers):
                try:
                    follower.queue.put_nowait(message)
                except asyncio.QueueFull:
                    log.warning("hint_feed_follower_behind", queued=QUEUE_MESSAGES)
                    self._followers.discard(follower)
                    _end(follower)


def _end(follower: _Follower) -> None:
    """Ends a follower's stream: its queue's next message says so (room is made if full)."""
    while follower.queue.full():
        follower.queue.get_nowait()
    follower.queue.put_nowait(None)


class HintView:
    """A follower's copy of its leader's hint state (one subscription's), and how current it
    is."""

    def __init__(self, now: Callable[[], float]) -> None:
        self.cache = StateCache()
        # Whole once the snapshot has arrived.
        self.complete = False
        self._now = now
        self._leader_time = 0.0
        self._received = -math.inf
        # The least (arrival - leader_time) seen: the clocks' offset plus the least delay.
        self._offset = math.inf
        self._delay = 0.0
        self._routes: dict[str, routing.Routes[routing.RoutedNode[Node]]] = {}

    def apply(self, message: registry_pb2.WatchHintStateResponse) -> None:
        nodes_changed = False
        for record in message.records:
            kind = RECORD_KINDS[record.kind]
            self.cache.apply(kind, record.id, record.record or None)
            nodes_changed = nodes_changed or kind is RecordKind.NODE
        if nodes_changed:
            self._routes.clear()
        self.complete = self.complete or message.snapshot_complete
        received = self._now()
        self._leader_time = from_timestamp(message.leader_time)
        gap = received - self._leader_time
        self._offset = min(self._offset, gap)
        self._delay = gap - self._offset
        self._received = received

    def behind_s(self) -> float:
        """How long ago the leader's state was last known to be as this copy has it
        (infinite until the snapshot is whole)."""
        if not self.complete:
            return math.inf
        return self._delay + (self._now() - self._received)

    def leader_now(self) -> float:
        """The leader's clock now, as far as this copy can tell (for leases' time left)."""
        return self._leader_time + (self._now() - self._received)

    def routes(self, model: str) -> routing.Routes[routing.RoutedNode[Node]]:
        """The ready nodes for ``model`` as the leader last said them (raises
        ``routing.NoReadyNode``); kept until a node record changes."""
        routes = self._routes.get(model)
        if routes is None:
            nodes = [routing.RoutedNode.of_record(node) for node in self.cache.nodes()]
            routes = self._routes[model] = routing.candidates(nodes, model)
        return routes

    def node(self, node_id: str) -> routing.RoutedNode[Node] | None:
        node = self.cache.record(RecordKind.NODE, node_id)
        return routing.RoutedNode.of_record(node) if isinstance(node, Node) else None


class FollowedHints:
    """A follower's current ``HintView`` of its leader's feed, kept by ``run``."""

    def __init__(self, now: Callable[[], float], retry_s: float) -> None:
        self.view: HintView | None = None
        self._now = now
        self.retry_s = retry_s

    async def run(self, stub: RegistryServiceStub) -> None:
        """Subscribes to the leader behind ``stub``, again after each break, until cancelled;
        a broken stream drops the copy (the next one starts from a snapshot)."""
        try:
            while True:
                view = HintView(self._now)
                try:
                    async for message in stub.WatchHintState(registry_pb2.WatchHintStateRequest()):
                        view.apply(message)
                        if view.complete:
                            self.view = view
                except grpc.aio.AioRpcError as error:
                    log.info("hint_feed_broken", code=error.code().name, why=error.details())
                self.view = None
                await asyncio.sleep(self.retry_s)
        finally:
            self.view = None
