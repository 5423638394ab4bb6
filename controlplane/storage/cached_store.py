"""The one ``Store``: every record in a ``StateCache``, made durable by a ``Backend``.

It exists so that no read waits on I/O: reads come from the cache, and a write changes the
cache at once and is queued for the next commit, whose writes ``GroupCommit`` batches and, if
one is refused, undoes. A follower keeps its cache current from the backend's watch
(``follow``), so a replica that becomes the leader may use its cache as it is once it has
caught up with its own election (``catch_up``) instead of loading.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Protocol

import structlog

from kvbroker.controlplane.errors import StoreUnavailable
from kvbroker.controlplane.records.codec import record_bytes
from kvbroker.controlplane.records.model import Conversation, Lease, Node, Record
from kvbroker.controlplane.storage.group_commit import GroupCommit
from kvbroker.controlplane.storage.state_cache import RecordKind, StateCache
from kvbroker.controlplane.storage.store import REPLAYED, Backend, Change, MemoryBackend

log = structlog.get_logger("kvbroker.registry")


class ChangeListener(Protocol):
    def changed(self, kind: RecordKind, ident: str) -> None:
        """A record was put."""

    def undone(self) -> None:
        """Records were put back to what is durable (a refused commit): which, it does not
        say."""


class CachedStore:
    """A ``StateCache`` made durable by a ``Backend``; implements ``Store``. Records of the
    ``soft`` kinds are kept in the cache only, whatever their puts say."""

    def __init__(self, backend: Backend, soft: frozenset[RecordKind] = REPLAYED) -> None:
        self.backend = backend
        self.soft = soft
        self.cache = StateCache()
        # The election revision this store writes under (``Backend.write``); None: it does not
        # lead and cannot write.
        self.fence: int | None = None
        # The backend revision the cache reflects.
        self.revision = 0
        # True while a watch keeps the cache current (``follow``).
        self.following = False
        self._advanced = asyncio.Event()
        # Told of every record put while this store leads and followers copy its hint state
        # (``replication.hint_state.HintFeed``).
        self.feed: ChangeListener | None = None
        self._resync_due = False
        self._commits = GroupCommit(self)

    @property
    def resync_due(self) -> bool:
        """Set when a refused record was undone in the cache: the owner rebuilds what it
        derived from the records."""
        return self._resync_due

    @resync_due.setter
    def resync_due(self, due: bool) -> None:
        self._resync_due = due
        if due and self.feed is not None:
            self.feed.undone()

    # ------------------------------------------------------------ reads

    async def get_node(self, node_id: str) -> Node | None:
        return self.cache.node(node_id)

    async def list_nodes(self) -> list[Node]:
        return self.cache.nodes()

    async def get_conversation(self, conversation_id: str) -> Conversation | None:
        return self.cache.conversation(conversation_id)

    async def list_conversations(self) -> Iterable[Conversation]:
        return self.cache.conversations()

    async def get_lease(self, lease_id: str) -> Lease | None:
        return self.cache.lease(lease_id)

    async def find_lease(self, node_id: str, remote_request_id: str) -> Lease | None:
        return self.cache.find_lease(node_id, remote_request_id)

    async def live_leases_of_node(self, node_id: str) -> list[Lease]:
        return self.cache.live_leases_of_node(node_id)

    def live_lease_ids(self, node_id: str) -> set[str]:
        return self.cache.live_lease_ids(node_id)

    def live_lease_count(self, node_id: str) -> int:
        return self.cache.live_lease_count(node_id)

    async def list_leases(
        self, node_id: str = "", conversation_id: str = "", after: str = ""
    ) -> Iterable[Lease]:
        return self.cache.leases(node_id, conversation_id, after)

    # ------------------------------------------------------------ writes

    async def put_node(self, node: Node, durable: bool = True) -> None:
        self._write(RecordKind.NODE, node.spec.node_id, node, durable)

    async def delete_node(self, node_id: str) -> None:
        self._write(RecordKind.NODE, node_id, None, True)

    async def put_conversation(self, conversation: Conversation) -> None:
        self._write(RecordKind.CONVERSATION, conversation.conversation_id, conversation, True)

    async def delete_conversation(self, conversation_id: str) -> None:
        self._write(RecordKind.CONVERSATION, conversation_id, None, True)

    async def put_lease(self, lease: Lease, durable: bool = True) -> None:
        self._write(RecordKind.LEASE, lease.lease_id, lease, durable)

    async def delete_lease(self, lease_id: str) -> None:
        self._write(RecordKind.LEASE, lease_id, None, True)

    def _write(self, kind: RecordKind, ident: str, record: Record | None, durable: bool) -> None:
        """Sets the record in the cache (which keeps no caller's object); with a durable
        backend, remembers what it replaces (for an undo) and, unless soft, queues its bytes
        as of now for the commit."""
        if self.backend.durable:
            self._commits.note(kind, ident)
            if durable and kind not in self.soft:
                raw = record_bytes(record) if record is not None else None
                self._commits.queue(Change(kind, ident, raw))
        self.cache.put(kind, ident, record)
        if self.feed is not None:
            self.feed.changed(kind, ident)

    async def commit(self) -> None:
        """With a backend that keeps nothing, the cache is already all there is."""
        if self.backend.durable:
            await self._commits.commit()

    # ------------------------------------------------------------ load and follow

    async def load(self) -> int:
        """Replaces the cache with the backend's contents at one revision (the cache in use
        stays whole until the load has succeeded) and forgets unwritten changes."""
        fresh = StateCache()
        revision = await self.backend.load(fresh)
        self.cache = fresh
        self._commits.forget()
        self.revision = revision
        log.info("store_loaded", revision=revision, **fresh.counts())
        return revision

    async def follow(self) -> None:
        """Keeps the cache current from the backend's watch, reloading when the watch breaks;
        until cancelled (a replica cancels it when it becomes the leader)."""
        try:
            while True:
                self.following = False
                try:
                    await self.load()
                    events = self.backend.watch(self.revision)
                    self.following = True
                    async for event in events:
                        if event.change is not None:
                            change = event.change
                            self.cache.apply(change.kind, change.ident, change.raw)
                        self.revision = max(self.revision, event.revision)
                        self._advanced.set()
                except StoreUnavailable as error:
                    log.warning("store_watch_broken", error=error.message)
                    await asyncio.sleep(0.5)
        finally:
            self.following = False

    async def catch_up(self, revision: int, within_s: float) -> bool:
        """True once the followed cache has applied every write up to ``revision``; False if
        the watch is not running or does not get there in time (then: ``load``)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within_s
        while self.following and self.revision < revision:
            self._advanced.clear()
            try:
                await asyncio.wait_for(self._advanced.wait(), deadline - loop.time())
            except TimeoutError:
                return False
        return self.following and self.revision >= revision

    async def close(self) -> None:
        await self.backend.close()


class MemoryStore(CachedStore):
    """The store of a standalone registry: a cache and nothing behind it."""

    def __init__(self) -> None:
        super().__init__(MemoryBackend())
