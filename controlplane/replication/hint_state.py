"""The leader's hint state, streamed to its followers, so that every replica answers hints.

A follower's etcd watch carries the nodes only: leases, conversations and the nodes' load are
the leader's soft state, never written (docs/design.md, "Durable and soft state"). So the
leader streams what hints read to each follower (``WatchHintState``): every record of its
cache once, then every record that changed since the last message, or an empty message as a
keepalive. ``HintFeed`` is the leader's side; ``HintView`` a follower's copy, which knows how
far behind the leader it is (its ``FeedClock``), kept current by
``kvbroker.common.client.hint_watch.FollowedHints``; ``HintRelay`` re-serves a follower's copy
to routers that keep one of their own (docs/design.md, "Hints in the router").

Changes are coalesced: ``CachedStore`` tells the feed which records it put (``changed``), and
every ``FLUSH_S`` the feed sends the current bytes of each. So a record that changed ten times
in a flush is encoded once, and nothing is tracked while no follower listens. A follower that
cannot keep up (its queue of ``QUEUE_MESSAGES`` is full) is cut off and starts over with a new
snapshot; so is every follower when the leader steps down (``close``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field

import structlog

from kvbroker.common.client.hint_watch import FedView
from kvbroker.common.rules import routing
from kvbroker.common.rules.clock import from_timestamp, stamp_time
from kvbroker.common.rules.fed_hints import FeedClock
from kvbroker.controlplane.errors import NoLeader
from kvbroker.controlplane.records import codec
from kvbroker.controlplane.records.codec import record_bytes
from kvbroker.controlplane.records.model import Conversation, Lease, Node
from kvbroker.controlplane.storage.cached_store import CachedStore
from kvbroker.controlplane.storage.state_cache import RecordKind, StateCache
from kvbroker.v1 import lease_pb2, registry_pb2

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
        return _snapshot(cache, keys, self._now())

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        sent_at = loop.time()
        while True:
            await asyncio.sleep(FLUSH_S)
            if not self._followers or (not self._dirty and loop.time() - sent_at < KEEPALIVE_S):
                continue
            keys, self._dirty = list(self._dirty), set()
            message = _message(self._store.cache, keys, self._now())
            sent_at = loop.time()
            for follower in list(self._followers):
                _offer(self._followers, follower, message)


def _snapshot(
    cache: StateCache, keys: list[tuple[RecordKind, str]], leader_time: float
) -> Iterator[registry_pb2.WatchHintStateResponse]:
    """The records of ``keys`` in messages of ``SNAPSHOT_CHUNK``, the last saying so."""
    for start in range(0, max(len(keys), 1), SNAPSHOT_CHUNK):
        message = _message(cache, keys[start : start + SNAPSHOT_CHUNK], leader_time)
        message.snapshot_complete = start + SNAPSHOT_CHUNK >= len(keys)
        yield message


def _message(
    cache: StateCache, keys: list[tuple[RecordKind, str]], leader_time: float
) -> registry_pb2.WatchHintStateResponse:
    """The records' bytes as the cache holds them now (a record gone: empty)."""
    message = registry_pb2.WatchHintStateResponse()
    for kind, ident in keys:
        record = cache.record(kind, ident)
        raw = record_bytes(record) if record is not None else b""
        message.records.add(kind=KINDS[kind], id=ident, record=raw)
    stamp_time(message.leader_time, leader_time)
    return message


def _offer(
    followers: set[_Follower], follower: _Follower, message: registry_pb2.WatchHintStateResponse
) -> None:
    """Queues a message for a follower; one that cannot keep up is cut off (it starts over)."""
    try:
        follower.queue.put_nowait(message)
    except asyncio.QueueFull:
        log.warning("hint_feed_follower_behind", queued=QUEUE_MESSAGES)
        followers.discard(follower)
        _end(follower)


def _end(follower: _Follower) -> None:
    """Ends a follower's stream: its queue's next message says so (room is made if full)."""
    while follower.queue.full():
        follower.queue.get_nowait()
    follower.queue.put_nowait(None)


class HintView:
    """A follower's copy of its leader's hint state (one subscription's), as the registry's
    records (``fed_hints.HintState``), and how current it is (``clock``)."""

    def __init__(self, now: Callable[[], float]) -> None:
        self.cache = StateCache()
        self.clock = FeedClock(now)
        self._routes: dict[str, routing.Routes[routing.RoutedNode[Node]]] = {}
        # Each node as routing reads it, built once per record the leader sends (a record is
        # never changed in place: a change is a new one).
        self._routed: dict[str, routing.RoutedNode[Node]] = {}

    def apply(self, message: registry_pb2.WatchHintStateResponse) -> None:
        nodes_changed = False
        for record in message.records:
            kind = RECORD_KINDS[record.kind]
            self.cache.apply(kind, record.id, record.record or None)
            if kind is RecordKind.NODE:
                nodes_changed = True
                self._routed.pop(record.id, None)
        if nodes_changed:
            self._routes.clear()
        self.clock.heard(from_timestamp(message.leader_time), message.snapshot_complete)

    def routes(self, model: str) -> routing.Routes[routing.RoutedNode[Node]]:
        """The ready nodes for ``model`` as the leader last said them (raises
        ``routing.NoReadyNode``); kept until a node record changes."""
        routes = self._routes.get(model)
        if routes is None:
            nodes = [routing.RoutedNode.of_record(node) for node in self.cache.nodes()]
            routes = self._routes[model] = routing.candidates(nodes, model)
        return routes

    def node(self, node_id: str) -> routing.RoutedNode[Node] | None:
        routed = self._routed.get(node_id)
        if routed is None:
            node = self.cache.record(RecordKind.NODE, node_id)
            if not isinstance(node, Node):
                return None
            routed = self._routed[node_id] = routing.RoutedNode.of_record(node)
        return routed

    def conversation(self, conversation_id: str) -> Conversation | None:
        record = self.cache.record(RecordKind.CONVERSATION, conversation_id)
        return record if isinstance(record, Conversation) else None

    def lease(self, lease_id: str) -> Lease | None:
        record = self.cache.record(RecordKind.LEASE, lease_id)
        return record if isinstance(record, Lease) else None

    def leader_now(self) -> float:
        return self.clock.leader_now()

    @staticmethod
    def expire_time(lease: Lease) -> float:
        return lease.expire_time or 0.0

    @staticmethod
    def generation(lease: Lease) -> int:
        return lease.handle.registration_generation

    @staticmethod
    def lease_into(lease: Lease, into: lease_pb2.Lease) -> None:
        codec.lease_into(lease, into)


class HintRelay:
    """A follower's copy re-served to whoever watches this replica's hint state (routers that
    answer dry-run hints in process), so that they do not all load the leader: a snapshot of
    the copy, then each message from the leader as it came, with the leader's own times (so a
    watcher's ``FeedClock`` counts this follower's lag too). A break of the follower's own
    stream ends every watcher's (they start over from a new copy)."""

    def __init__(self) -> None:
        self._view: HintView | None = None
        self._followers: set[_Follower] = set()

    def relay(self, message: registry_pb2.WatchHintStateResponse, view: FedView) -> None:
        assert isinstance(view, HintView)
        if view is not self._view:
            self.broken()
            self._view = view
            return  # a new copy: its watchers come after, from its snapshot
        for follower in list(self._followers):
            _offer(self._followers, follower, message)

    def broken(self) -> None:
        self._view = None
        for follower in self._followers:
            _end(follower)
        self._followers.clear()

    async def subscribe(self) -> AsyncIterator[registry_pb2.WatchHintStateResponse]:
        """The copy's snapshot, then the leader's messages as they come; ``NoLeader`` while
        there is no whole copy to serve."""
        view = self._view
        if view is None:
            raise NoLeader("this follower has no current copy of the leader's hint state")
        follower = _Follower()
        self._followers.add(follower)
        keys = [(RecordKind.NODE, node.spec.node_id) for node in view.cache.nodes()]
        keys += [(RecordKind.CONVERSATION, c.conversation_id) for c in view.cache.conversations()]
        keys += [(RecordKind.LEASE, lease.lease_id) for lease in view.cache.leases()]
        snapshot = list(_snapshot(view.cache, keys, view.clock.leader_time))
        try:
            for message in snapshot:
                yield message
            while (change := await follower.queue.get()) is not None:
                yield change
        finally:
            self._followers.discard(follower)
