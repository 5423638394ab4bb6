"""How a ``CachedStore``'s commits become backend writes, and how a refused one is undone.

This is apart from the store because it is the one part of it with rules of its own: what
one write holds, which commit a refusal fails, and what the cache goes back to. The store
around it keeps the cache, loads it and follows the backend's watch; everything a commit's
outcome depends on is here.

The writes since the previous commit are one unit of work, sealed at once and written in
order. Units share a write while one is in flight (group commit) but are never split to fill
one, so a unit that fits one write of the backend is durable all or none. A unit larger than
one write (a batch of expiries or many independent records, where leases are written) goes in
several, in order, each fenced: a leader lost between them leaves a written prefix of
independent records, which its successor takes over like any other state (sessions restart,
holders replay). A write refused undoes the cache to what is durable, so each unit keeps what
the cache held before its first write of each record.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import structlog

from kvbroker.controlplane.errors import CommitUndone, RegistryError, StoreRefused, StoreUnavailable
from kvbroker.controlplane.records.model import Record
from kvbroker.controlplane.storage.state_cache import RecordKind, StateCache
from kvbroker.controlplane.storage.store import Backend, Change, CommitTooLarge, Deposed

log = structlog.get_logger("kvbroker.registry")


class CommitTarget(Protocol):
    """The store a group commit writes for: it writes to the store's backend under its fence,
    advances its revision, undoes its cache and tells it to resync."""

    backend: Backend
    cache: StateCache
    fence: int | None
    revision: int
    resync_due: bool


@dataclass
class _Unit:
    """One commit's writes, and what the cache held before each (to undo a refused unit)."""

    changes: dict[tuple[RecordKind, str], Change] = field(default_factory=dict)
    before: dict[tuple[RecordKind, str], Record | None] = field(default_factory=dict)
    sequence: int = 0
    # Writes that took part of it, when it does not fit one.
    parts_written: int = 0


class GroupCommit:
    """The units of one store: the one being built, those sealed and not yet durable, and the
    refusals their commits are still to raise."""

    def __init__(self, store: CommitTarget) -> None:
        self._store = store
        self._open = _Unit()
        self._sealed: list[_Unit] = []
        self._sequence = 0
        self._durable_sequence = 0
        self._flushing: asyncio.Task[None] | None = None
        self._broken: StoreUnavailable | None = None
        # Sequences of units refused (a record the store will not take), with their error.
        self._refused: dict[int, RegistryError] = {}
        self._loads = 0

    def note(self, kind: RecordKind, ident: str) -> None:
        """Remembers what the cache held before this unit's first write of a record (the
        object itself: the cache never changes a record it holds, it replaces it)."""
        before = self._open.before
        if (kind, ident) not in before:
            before[kind, ident] = self._store.cache.record(kind, ident)

    def queue(self, change: Change) -> None:
        """Adds a record's bytes to this unit; a later change of the same record replaces it."""
        self._open.changes[change.kind, change.ident] = change

    async def commit(self) -> None:
        """Returns once this unit and every unit before it are durable. The unit is sealed at
        once (the caller's mutation has ended), so later mutations' writes never join it;
        while one write is in flight, the units sealed meanwhile share the next."""
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

    def forget(self) -> None:
        """The store was loaded: its unwritten units went with the cache they were in, their
        commits fail, and the store writes again."""
        self._open = _Unit()
        self._sealed.clear()
        self._durable_sequence = self._sequence
        self._loads += 1
        self._broken = None
        self._refused.clear()

    async def _flush(self) -> None:
        """One write of the sealed units from the first: as many whole ones as fit, or, where
        the first alone does not, as much of it as fits (the rest goes in the next)."""
        store = self._store
        backend = store.backend
        count = _units_per_write(self._sealed, backend)
        if count:
            merged: dict[tuple[RecordKind, str], Change] = {}
            for unit in self._sealed[:count]:
                merged.update(unit.changes)  # a record written by several units: the last
            changes = list(merged.values())
        else:
            unit = self._sealed[0]
            if not unit.parts_written:
                if not all(_fits_alone(change, backend) for change in unit.changes.values()):
                    self._refuse_records(
                        CommitTooLarge(
                            f"a record exceeds one write of the store ({backend.limits}); "
                            "nothing of its commit was written"
                        ),
                        culprit=unit.sequence,
                    )
                    return
                log.warning("store_commit_split", writes=len(unit.changes))
            changes = _part_that_fits(unit, backend)
        try:
            revision = await backend.write(changes, store.fence)
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
        store.revision = max(store.revision, revision)
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
        self._store.resync_due = True
        log.error("store_records_refused", error=error.message)

    def _undo(self) -> None:
        cache = self._store.cache
        for unit in [*self._sealed, self._open][::-1]:
            # As the cache held them: it never changes a record it holds, so no copy.
            for (kind, ident), record in unit.before.items():
                cache.put(kind, ident, record)
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
