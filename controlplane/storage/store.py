"""Where the registry keeps nodes, conversations and leases: the interface it talks to.

The registry talks to one interface, ``Store``. Its one implementation, ``CachedStore``
(``controlplane.storage.cached_store``), is composed of a ``StateCache`` (every record in memory,
with indexes, so no read waits on I/O) and a ``Backend`` that makes the cache durable: it loads a
cache, takes fenced writes, and watches for the writes of others. The memory backend keeps
nothing (one process, nothing else to start); the etcd backend (``controlplane.storage.etcd_store``)
spans machines.

Records are plain objects (``controlplane.records.model``) and every read returns a copy: a change
exists once it is put back. The backend sees only bytes, the stored form of each record
(``controlplane.records.codec``), encoded when a durable write is queued. The registry serialises
its mutations and ends each with ``commit()``: the writes since the previous commit are one unit
of work, durable all or none when it fits one write of the backend, in order otherwise
(``controlplane.storage.group_commit`` says how units share and split writes, and why that is safe).
Nothing is dropped silently: a write refused undoes the cache to what is durable. Two kinds of
refusal differ in what follows. Fenced off (``Deposed``) or of unknown outcome
(``StoreUnavailable``): the replica no longer leads, or cannot know what is durable, so it
steps down. A record the store will not take (``StoreRefused``: larger than any write, or
refused by etcd as too large): nothing was written, the leader still leads, and the store
goes on writing; it raises ``resync_due`` so its owner rebuilds what it derived from the
undone records (``Registry``), and the units written with the refused one fail with
``CommitUndone`` (retry).

Only nodes are written by default. Leases and conversations (``REPLAYED``) stay in the
leader's cache: after a takeover, as after a standalone registry's restart, the holders'
replays rebuild them (docs/design.md, Durable and soft state, says why that is enough).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from kvbroker.controlplane.errors import StoreRefused, StoreUnavailable
from kvbroker.controlplane.records.model import Conversation, Lease, Node
from kvbroker.controlplane.storage.state_cache import RecordKind, StateCache

__all__ = [
    "REPLAYED",
    "Backend",
    "Change",
    "CommitTooLarge",
    "Deposed",
    "MemoryBackend",
    "RecordKind",
    "Store",
    "WatchEvent",
    "WriteLimits",
]

# What holders' replays rebuild after a takeover or restart: soft state of the leader, never
# written (writing every turn's changes cost three in four turns over etcd, and a successor
# could not use them before the holder replayed anyway).
REPLAYED = frozenset({RecordKind.LEASE, RecordKind.CONVERSATION})


class Deposed(StoreUnavailable):
    """The write's fence no longer holds: another replica leads, and nothing was written."""


class CommitTooLarge(StoreRefused):
    """A unit holds a record larger than the backend takes in one write; nothing of the unit
    was written and the cache was undone to the last durable state."""


class Store(Protocol):
    """Reads hand out copies; a change exists once put back and is durable after ``commit``."""

    async def get_node(self, node_id: str) -> Node | None: ...
    async def put_node(self, node: Node, durable: bool = True) -> None:
        """``durable=False``: soft state (load, heartbeat times) a successor may lose."""
        ...

    async def list_nodes(self) -> list[Node]: ...
    async def delete_node(self, node_id: str) -> None: ...

    async def get_conversation(self, conversation_id: str) -> Conversation | None: ...
    async def put_conversation(self, conversation: Conversation) -> None: ...
    async def delete_conversation(self, conversation_id: str) -> None: ...
    async def list_conversations(self) -> Iterable[Conversation]: ...

    async def get_lease(self, lease_id: str) -> Lease | None: ...
    async def put_lease(self, lease: Lease, durable: bool = True) -> None:
        """``durable=False``: soft state (a claim) that a successor may lose; not written out."""
        ...

    async def delete_lease(self, lease_id: str) -> None: ...
    async def find_lease(self, node_id: str, remote_request_id: str) -> Lease | None:
        """The lease a node holds for one of its engine's requests, if any."""
        ...

    async def live_leases_of_node(self, node_id: str) -> list[Lease]: ...
    def live_lease_ids(self, node_id: str) -> set[str]:
        """Ids of the node's live leases, from memory (a replay compares 100k of them)."""
        ...

    def live_lease_count(self, node_id: str) -> int:
        """How many live leases the node holds (the size of the same index)."""
        ...

    async def list_leases(
        self, node_id: str = "", conversation_id: str = "", after: str = ""
    ) -> Iterable[Lease]:
        """Leases in lease id order after ``after``, optionally of one node or one
        conversation; copied as the caller reads on."""
        ...

    async def commit(self) -> None:
        """Makes the changes since the last commit durable: all or none when they fit one
        write of the backend, in order otherwise (``controlplane.storage.group_commit``); raises
        ``StoreUnavailable`` when it cannot (the caller's view is then ahead of the store),
        ``StoreRefused`` or ``CommitUndone`` when a record was refused and the cache undone
        (then ``resync_due`` is set)."""
        ...

    # Set when a refused write undid records in the cache: whatever the owner derived from
    # them must be rebuilt (cleared by the owner).
    resync_due: bool


# ---------------------------------------------------------------- backends


@dataclass(frozen=True, slots=True)
class Change:
    """One record's new bytes, or None where it was deleted."""

    kind: RecordKind
    ident: str
    raw: bytes | None


@dataclass(frozen=True, slots=True)
class WatchEvent:
    """The backend reached ``revision``; ``change`` is None for writes that are not records
    (an election), which still advance the revision a follower has seen."""

    revision: int
    change: Change | None


@dataclass(frozen=True)
class WriteLimits:
    """The most one write of a backend takes: operations, and bytes as ``Backend.size``
    counts them."""

    operations: int
    size_bytes: int


class Backend(Protocol):
    @property
    def durable(self) -> bool:
        """False: nothing is kept, so there is nothing to load, write or watch."""
        ...

    @property
    def limits(self) -> WriteLimits | None:
        """The most one write takes; None: any write fits."""
        ...

    async def load(self, into: StateCache) -> int:
        """Fills an empty cache with every record at one revision, which it returns."""
        ...

    def size(self, change: Change) -> int:
        """What one change counts against ``limits.size_bytes``."""
        ...

    async def write(self, changes: Sequence[Change], fence: int | None) -> int:
        """Writes all of the changes or none, only while ``fence`` (the election's revision)
        still holds; returns the revision written at. Raises ``Deposed`` when the fence has
        moved or is None (nothing written), ``StoreRefused`` when the backend refused the
        changes themselves (nothing written: too large), ``StoreUnavailable`` when the outcome
        is unknown. A backend reconnects by itself after a failure."""
        ...

    def watch(self, after: int) -> AsyncIterator[WatchEvent]:
        """Every write after revision ``after``, in order, until the watch breaks (raises)."""
        ...

    async def close(self) -> None: ...


class MemoryBackend:
    """No durability: the cache is all there is, and its one process is the only writer."""

    durable = False
    limits = None

    async def load(self, into: StateCache) -> int:
        return 0

    def size(self, change: Change) -> int:
        return 0

    async def write(self, changes: Sequence[Change], fence: int | None) -> int:
        return 0

    async def watch(self, after: int) -> AsyncIterator[WatchEvent]:
        # Nobody else writes: the watch never breaks and nothing ever arrives.
        await asyncio.Event().wait()
        yield WatchEvent(after, None)

    async def close(self) -> None:
        return None
