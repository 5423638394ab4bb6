"""Where the registry keeps nodes, conversations and leases.

The registry talks to one interface, ``Store``. Its one implementation, ``CachedStore``, is
composed of a ``StateCache`` (every record in memory, with indexes, so no read waits on I/O)
and a ``Backend`` that makes the cache durable: it loads a cache, takes fenced writes, and
watches for the writes of others. The memory backend keeps nothing (one process, nothing else
to start); the etcd backend (``controlplane.etcd_store``) spans machines.

Records are plain objects (``controlplane.model``) and every read returns a copy: a change
exists once it is put back. The backend sees only bytes, the stored form of each record
(``controlplane.codec``), encoded when a durable write is queued. The registry serialises its
mutations and ends each with ``commit()``: the writes
since the previous commit are one unit of work, sealed at once and written in order. Units
share a write while one is in flight (group commit) but are never split to fill one, so a unit
that fits one write of the backend is durable all or none. A unit larger than one write (a
batch of expiries or many independent records, where leases are written) goes in several, in
order, each fenced: a leader lost between them leaves a written prefix of independent records,
which its successor takes over like any other state (sessions restart, holders replay).
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
from dataclasses import dataclass, field
from typing import Protocol

import structlog

from kvbroker.controlplane.codec import record_bytes
from kvbroker.controlplane.errors import CommitUndone, RegistryError, StoreRefused, StoreUnavailable
from kvbroker.controlplane.model import Conversation, Lease, Node, Record
from kvbroker.controlplane.state_cache import RecordKind, StateCache

__all__ = [
    "REPLAYED",
    "Backend",
    "CachedStore",
    "Change",
    "CommitTooLarge",
    "Deposed",
    "MemoryBackend",
    "MemoryStore",
    "RecordKind",
    "Store",
    "WatchEvent",
    "WriteLimits",
]

log = structlog.get_logger("kvbroker.registry")

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
        write of the backend, in order otherwise (see the module docstring); raises
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


# ---------------------------------------------------------------- the store


@dataclass
class _Unit:
    """One commit's writes, and what the cache held before each (to undo a refused unit)."""

    changes: dict[tuple[RecordKind, str], Change] = field(default_factory=dict)
    before: dict[tuple[RecordKind, str], Record | None] = field(default_factory=dict)
    sequence: int = 0
    # Writes that took part of it, when it does not fit one.
    parts_written: int = 0


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
        self._open = _Unit()
        self._sealed: list[_Unit] = []
        self._sequence = 0
        self._durable_sequence = 0
        self._flushing: asyncio.Task[None] | None = None
        self._broken: StoreUnavailable | None = None
        # Sequences of units refused (a record the store will not take), with their error.
        self._refused: dict[int, RegistryError] = {}
        self.resync_due = False
        self._loads = 0

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
        """Sets a copy of the record in the cache (the caller's stays its own); with a durable
        backend, remembers what it replaces (for an undo) and, unless soft, queues its bytes
        as of now for the commit."""
        if self.backend.durable:
            self._note(kind, ident)
            if durable and kind not in self.soft:
                raw = record_bytes(record) if record is not None else None
                self._open.changes[kind, ident] = Change(kind, ident, raw)
        self.cache.put(kind, ident, record.copy() if record is not None else None)

    def _note(self, kind: RecordKind, ident: str) -> None:
        """Remembers what the cache held before this unit's first write of a record (the
        object itself: the cache never changes a record it holds, it replaces it)."""
        before = self._open.before
        if (kind, ident) not in before:
            before[kind, ident] = self.cache.record(kind, ident)

    # ------------------------------------------------------------ commit

    async def commit(self) -> None:
        """Group commit: returns once this unit and every unit before it are durable. The unit
        is sealed at once (the caller's mutation has ended), so later mutations' writes never
        join it; while one write is in flight, the units sealed meanwhile share the next."""
        if not self.backend.durable:
            return
        if self._broken is not None:
            raise self._broken
        unit, self._open = self._open, _Unit()
        own = None
        if unit.changes:  # a unit of soft writes only has nothing to write or undo
            self._sequence += 1
            own = unit.sequence = self._sequence
            self._sealed.append(unit)
        awaited, loads = self._sequence, self._loads
        while True:
            if own is not None and own in self._refused:
                raise self._refused.pop(own)
            if self._durable_sequence >= awaited:
                return
            if self._broken is not None:
                raise self._broken
            if self._loads != loads:
                raise StoreUnavailable("the store was reloaded before this commit was written")
            if self._flushing is None or self._flushing.done():
                self._flushing = asyncio.create_task(self._flush(), name="kvbroker-store-flush")
            await asyncio.shield(self._flushing)

    async def _flush(self) -> None:
        """One write of the sealed units from the first: as many whole ones as fit, or, where
        the first alone does not, as much of it as fits (the rest goes in the next)."""
        count = _units_per_write(self._sealed, self.backend)
        if count:
            merged: dict[tuple[RecordKind, str], Change] = {}
            for unit in self._sealed[:count]:
                merged.update(unit.changes)  # a record written by several units: the last
            changes = list(merged.values())
        else:
            unit = self._sealed[0]
            if not unit.parts_written:
                if not all(_fits_alone(change, self.backend) for change in unit.changes.values()):
                    self._refuse_records(
                        CommitTooLarge(
                            f"a record exceeds one write of the store ({self.backend.limits}); "
                            "nothing of its commit was written"
                        ),
                        culprit=unit.sequence,
                    )
                    return
                log.warning("store_commit_split", writes=len(unit.changes))
            changes = _part_that_fits(unit, self.backend)
        try:
            revision = await self.backend.write(changes, self.fence)
        except Deposed as error:
            self._refuse(error)
            return
        except StoreRefused as error:
            # Which record it was is known only when the write held one unit.
            alone = count <= 1
            self._refuse_records(error, culprit=self._sealed[0].sequence if alone else None)
            return
        except StoreUnavailable as error:
            # Whether it was written is unknown: the cache may be ahead of the backend, so no
            # write may follow until a reload.
            self._broken = error
            log.error("store_commit_failed", error=error.message)
            return
        self.revision = max(self.revision, revision)
        if count:
            self._durable_sequence = self._sealed[count - 1].sequence
            del self._sealed[:count]
            return
        unit.parts_written += 1
        for change in changes:  # durable now: nothing of it to write or undo
            del unit.changes[change.kind, change.ident]
            unit.before.pop((change.kind, change.ident), None)

    def _refuse_records(self, error: StoreRefused, culprit: int | None) -> None:
        """The store refused a record (of unit ``culprit``, when known): the sealed units are
        undone as ``_refuse`` does, but the store is not broken and goes on writing; the
        culprit's caller gets ``error``, the others ``CommitUndone``, and the owner is told to
        rebuild what it derived from the undone records."""
        for unit in self._sealed:
            self._refused[unit.sequence] = (
                error
                if unit.sequence == culprit
                else CommitUndone(
                    f"written together with a record the store refused ({error.message}); "
                    "nothing of it was written: retry"
                )
            )
        if self._sealed:
            self._durable_sequence = max(self._durable_sequence, self._sealed[-1].sequence)
        self._undo()
        self.resync_due = True
        log.error("store_records_refused", error=error.message)

    def _undo(self) -> None:
        for unit in [*self._sealed, self._open][::-1]:
            # As the cache held them: it never changes a record it holds, so no copy.
            for (kind, ident), record in unit.before.items():
                self.cache.put(kind, ident, record)
        self._sealed.clear()
        self._open = _Unit()

    def _refuse(self, error: StoreUnavailable) -> None:
        """The sealed units' writes were refused (of a unit written in parts, the parts before
        stay: they are durable and no longer in it): the cache goes back to the last durable
        state (undoing the unit being built too, which may have read theirs), and the store
        takes no write until a reload, since its caller's own state has moved on with them."""
        self._undo()
        self._broken = error
        log.error("store_commit_refused", error=error.message)

    # ------------------------------------------------------------ load and follow

    async def load(self) -> int:
        """Replaces the cache with the backend's contents at one revision (the cache in use
        stays whole until the load has succeeded) and forgets unwritten changes."""
        fresh = StateCache()
        revision = await self.backend.load(fresh)
        self.cache = fresh
        self._open = _Unit()
        self._sealed.clear()
        self._durable_sequence = self._sequence
        self._loads += 1
        self._broken = None
        self._refused.clear()
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


def _fits_alone(change: Change, backend: Backend) -> bool:
    limits = backend.limits
    return limits is None or backend.size(change) <= limits.size_bytes


def _part_that_fits(unit: _Unit, backend: Backend) -> list[Change]:
    """The first of a unit's changes that fit one write together (at least one, when each
    fits alone)."""
    limits = backend.limits
    assert limits is not None  # without limits every unit fits whole
    part: list[Change] = []
    size = 0
    for change in unit.changes.values():
        size += backend.size(change)
        if len(part) == limits.operations or size > limits.size_bytes:
            break
        part.append(change)
    return part


def _units_per_write(units: Sequence[_Unit], backend: Backend) -> int:
    """How many units from the first go in one write within the backend's limits (0: not even
    the first). Exact for one unit; for several, a record they share is counted once as an
    operation but its bytes each time (a little under the limit, never over it)."""
    limits = backend.limits
    if limits is None:
        return len(units)
    records: set[tuple[RecordKind, str]] = set()
    size = 0
    for count, unit in enumerate(units):
        operations = len(records) + sum(1 for key in unit.changes if key not in records)
        size += sum(backend.size(change) for change in unit.changes.values())
        if operations > limits.operations or size > limits.size_bytes:
            return count
        records.update(unit.changes)
    return len(units)
