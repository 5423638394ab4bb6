"""A deadline notifier: no scan of all records per tick, and no Python object per deadline.

The registry keeps a deadline for every live lease (its expiry), so at a million leases a
deadline's bytes matter. A heap of ``(time, (kind, id))`` tuples with a dict of current times
cost ~190 bytes a deadline (two tuples, a float, a dict slot and a heap slot); here a deadline
is an entry of typed arrays (its kind, time, and the id, the one string the records already
hold), ~35 bytes with the table that finds it.

Entries are filed by a coarse timing wheel: the bucket of ``BUCKET_S`` their time falls in, a
bucket an ``array`` of entry numbers, the bucket numbers in a heap. Nothing is ordered until a
bucket falls due: then its live entries go into a small heap by exact time, from which they are
popped earliest first. Rescheduling files the entry again and leaves the old filing behind, to
be skipped when its bucket falls due (an entry's time tells which filing is current), so
schedule and cancel are O(1). Left alone, the filings left behind would pile up for as long as
their times lie ahead (every turn cancels its previous lease's expiry, hours away), so once
they outnumber the live entries the wheel is filed again from them: O(n) once per n changes.

The registry keeps all its deadlines in one queue, keyed by ``(DeadlineKind, id)``; each kind
has one handler, owned by the part of the registry the deadline belongs to.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import heapq
from array import array
from collections.abc import Awaitable, Callable

# A bucket's span, in seconds: the registry's deadlines lie seconds to hours ahead, so a bucket
# holds a second's deadlines and the wheel a few thousand buckets.
BUCKET_S = 1.0
# Filing a small wheel again would cost more than the filings left behind.
_MIN_REFILE = 1024
# The last bucket's time: past any clock, and an int for bucket numbers.
_LAST = 2.0**62
# Mixes a deadline's kind into its id's hash (the golden ratio's 64 bits).
_MIX = 0x9E3779B97F4A7C15


class DeadlineKind(enum.IntEnum):
    """What falls due (an int, so an entry keeps it in a byte; 0 marks a free entry)."""

    # A live lease not renewed in time expires.
    LEASE_EXPIRY = 1
    # A claimed lease's read is over: it is ACTIVE again.
    CLAIM_END = 2
    # A node that missed its heartbeats is marked DOWN.
    NODE_SESSION = 3
    # An ended lease is forgotten.
    FORGET_LEASE = 4
    # A conversation without a live lease is forgotten.
    FORGET_CONVERSATION = 5
    # A node DOWN for the retention period is forgotten.
    FORGET_NODE = 6


DeadlineKey = tuple[DeadlineKind, str]
_KINDS = {kind.value: kind for kind in DeadlineKind}


def _bucket(when: float) -> int:
    """The bucket ``when`` falls in; one at infinity (no deadline at all, as a heap would keep
    it) falls in the last, which no clock reaches."""
    return int(min(when, _LAST) // BUCKET_S)


def _hash(kind: int, ident: str) -> int:
    return hash(ident) ^ (kind * _MIX)


class DeadlineQueue:
    """At most one current deadline a key; due keys come out earliest first."""

    def __init__(self, now: Callable[[], float]) -> None:
        self._now = now
        self._changed = asyncio.Event()
        self._reset()

    def _reset(self) -> None:
        # Entries, one a deadline: kind (0: a free entry), id and time.
        self._kinds = array("B")
        self._ids: list[str] = []
        self._whens = array("d")
        self._free: list[int] = []
        # The entries by key: open addressing, each slot an entry + 1 (0: empty).
        self._table = array("i", bytes(4 * 16))
        self._count = 0
        # The wheel: entries filed by bucket, and the bucket numbers in a heap.
        self._buckets: dict[int, array[int]] = {}
        self._bucket_heap: list[int] = []
        self._filed = 0  # filings in the wheel, those left behind included
        # The due buckets' entries as (time, entry), a heap; every live entry whose bucket is
        # at or before ``_ready_bucket`` is here, not in the wheel.
        self._ready: list[tuple[float, int]] = []
        self._ready_bucket: int | None = None

    def __len__(self) -> int:
        return self._count

    def schedule(self, key: DeadlineKey, when: float) -> None:
        earliest = self._earliest()
        kind, ident = key
        slot = self._slot(kind, ident)
        held = self._table[slot]
        if held:
            entry = held - 1
        else:
            entry = self._new_entry(kind, ident)
            self._table[slot] = entry + 1
            self._count += 1
            if 4 * self._count > 3 * len(self._table):
                self._resize(2 * len(self._table))
        self._whens[entry] = when
        self._file(entry, when)
        if earliest is None or when < earliest:
            self._changed.set()
        self._compact()

    def cancel(self, key: DeadlineKey) -> None:
        kind, ident = key
        slot = self._slot(kind, ident)
        if self._table[slot]:
            self._release(slot)
            self._compact()

    def clear(self) -> None:
        """Forgets every deadline (the owner rebuilds them)."""
        self._reset()
        self._changed.set()

    def deadline(self, key: DeadlineKey) -> float | None:
        kind, ident = key
        held = self._table[self._slot(kind, ident)]
        return self._whens[held - 1] if held else None

    def pop_due(self, limit: int) -> list[DeadlineKey]:
        """Keys whose current deadline has passed, earliest first, at most ``limit``."""
        now = self._now()
        due: list[DeadlineKey] = []
        ready, kinds, whens, ids = self._ready, self._kinds, self._whens, self._ids
        while len(due) < limit:
            if not ready:
                self._ready_bucket = None
                heap = self._bucket_heap
                if not heap or heap[0] * BUCKET_S > now:
                    break
                self._take(heapq.heappop(heap))
                continue
            when, entry = ready[0]
            if not kinds[entry] or whens[entry] != when:
                heapq.heappop(ready)  # cancelled or rescheduled since it was filed
                continue
            if when > now:
                break
            heapq.heappop(ready)
            due.append((_KINDS[kinds[entry]], ids[entry]))
            self._release(self._slot(kinds[entry], ids[entry]))
        return due

    async def run(self, on_due: Callable[[list[DeadlineKey]], Awaitable[None]], batch: int) -> None:
        """Calls ``on_due`` with due keys, in batches, until cancelled."""
        while True:
            due = self.pop_due(batch)
            if due:
                await on_due(due)
                await asyncio.sleep(0)  # let RPCs in between batches of a mass expiry
                continue
            self._changed.clear()
            earliest = self._earliest()
            timeout = None if earliest is None else earliest - self._now()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), timeout)

    # ------------------------------------------------------------ inside

    def _earliest(self) -> float | None:
        """No later than the earliest deadline (a bucket's start, until it falls due)."""
        if self._ready:
            return self._ready[0][0]
        return self._bucket_heap[0] * BUCKET_S if self._bucket_heap else None

    def _file(self, entry: int, when: float) -> None:
        bucket = _bucket(when)
        if self._ready_bucket is not None and bucket <= self._ready_bucket:
            heapq.heappush(self._ready, (when, entry))
            return
        filed = self._buckets.get(bucket)
        if filed is None:
            filed = self._buckets[bucket] = array("i")
            heapq.heappush(self._bucket_heap, bucket)
        filed.append(entry)
        self._filed += 1

    def _take(self, bucket: int) -> None:
        """Moves a due bucket's live entries, each once, into the ready heap."""
        filed = self._buckets.pop(bucket)
        self._filed -= len(filed)
        kinds, whens = self._kinds, self._whens
        live = {entry for entry in filed if kinds[entry] and _bucket(whens[entry]) == bucket}
        self._ready.extend((whens[entry], entry) for entry in live)
        heapq.heapify(self._ready)
        self._ready_bucket = bucket

    def _compact(self) -> None:
        if self._filed > max(2 * self._count, _MIN_REFILE):
            ready = self._ready_bucket
            buckets: dict[int, array[int]] = {}
            filed = 0
            for entry, kind in enumerate(self._kinds):
                if kind:
                    bucket = _bucket(self._whens[entry])
                    if ready is None or bucket > ready:
                        entries = buckets.get(bucket)
                        if entries is None:
                            entries = buckets[bucket] = array("i")
                        entries.append(entry)
                        filed += 1
            self._buckets = buckets
            self._bucket_heap = sorted(buckets)  # a sorted list is a heap
            self._filed = filed

    def _new_entry(self, kind: int, ident: str) -> int:
        if self._free:
            entry = self._free.pop()
            self._kinds[entry] = kind
            self._ids[entry] = ident
        else:
            entry = len(self._ids)
            self._kinds.append(kind)
            self._ids.append(ident)
            self._whens.append(0.0)
        return entry

    def _slot(self, kind: int, ident: str) -> int:
        """The slot holding the key's entry, else the empty slot that ends its run."""
        table, kinds, ids = self._table, self._kinds, self._ids
        mask = len(table) - 1
        slot = _hash(kind, ident) & mask
        while held := table[slot]:
            if kinds[held - 1] == kind and ids[held - 1] == ident:
                break
            slot = (slot + 1) & mask
        return slot

    def _release(self, slot: int) -> None:
        """Frees the entry at ``slot``; its filings are skipped from now on."""
        table, kinds, ids = self._table, self._kinds, self._ids
        entry = table[slot] - 1
        kinds[entry] = 0
        ids[entry] = ""
        self._free.append(entry)
        self._count -= 1
        # Empties the slot, moving back the entries after it in its run that probing would no
        # longer reach across the gap (so a run never has holes, and no tombstones are kept).
        mask = len(table) - 1
        table[slot] = 0
        probe = (slot + 1) & mask
        while held := table[probe]:
            home = _hash(kinds[held - 1], ids[held - 1]) & mask
            if (probe - home) & mask >= (probe - slot) & mask:
                table[slot], table[probe] = held, 0
                slot = probe
            probe = (probe + 1) & mask

    def _resize(self, size: int) -> None:
        kinds, ids = self._kinds, self._ids
        table = array("i", bytes(4 * size))
        mask = size - 1
        for held in self._table:
            if held:
                slot = _hash(kinds[held - 1], ids[held - 1]) & mask
                while table[slot]:
                    slot = (slot + 1) & mask
                table[slot] = held
        self._table = table
