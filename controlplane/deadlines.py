"""A deadline notifier built on a heap, after etcd's lessor: no scan of all records per tick.

Each key has at most one current deadline; rescheduling leaves the old heap entry behind and
it is skipped when popped (lazy deletion), so schedule and cancel are O(log n) and O(1). Left
alone, the entries left behind would pile up for as long as their times lie ahead (every turn
cancels its previous lease's expiry, hours away), so once they outnumber the live ones the heap
is rebuilt from the live deadlines: O(n) once per n cancellations.

The registry keeps all its deadlines in one queue, keyed by ``(DeadlineKind, id)``; each kind
has one handler, owned by the part of the registry the deadline belongs to.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import heapq
from collections.abc import Awaitable, Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)

# Rebuilding a small heap would cost more than the entries left behind.
_MIN_REBUILD = 1024


class DeadlineKind(enum.IntEnum):
    """What falls due (an int, so keys stay orderable and small)."""

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


class DeadlineQueue(Generic[K]):
    """Keys must be orderable: equal deadlines fall back to comparing keys (a tie-break
    counter would cost ~40 bytes an entry, and a registry holds millions)."""

    def __init__(self, now: Callable[[], float]) -> None:
        self._now = now
        self._heap: list[tuple[float, K]] = []
        self._current: dict[K, float] = {}
        self._changed = asyncio.Event()

    def __len__(self) -> int:
        return len(self._current)

    def schedule(self, key: K, when: float) -> None:
        earliest = self._heap[0][0] if self._heap else None
        self._current[key] = when
        heapq.heappush(self._heap, (when, key))
        if earliest is None or when < earliest:
            self._changed.set()
        self._compact()

    def cancel(self, key: K) -> None:
        if self._current.pop(key, None) is not None:
            self._compact()

    def _compact(self) -> None:
        if len(self._heap) > max(2 * len(self._current), _MIN_REBUILD):
            self._heap = [(when, key) for key, when in self._current.items()]
            heapq.heapify(self._heap)

    def clear(self) -> None:
        """Forgets every deadline (the owner rebuilds them)."""
        self._heap.clear()
        self._current.clear()
        self._changed.set()

    def deadline(self, key: K) -> float | None:
        return self._current.get(key)

    def pop_due(self, limit: int) -> list[K]:
        """Keys whose current deadline has passed, earliest first, at most ``limit``."""
        now = self._now()
        due: list[K] = []
        while self._heap and len(due) < limit:
            when, key = self._heap[0]
            if self._current.get(key) != when:
                heapq.heappop(self._heap)  # superseded or cancelled
                continue
            if when > now:
                break
            heapq.heappop(self._heap)
            del self._current[key]
            due.append(key)
        return due

    async def run(self, on_due: Callable[[list[K]], Awaitable[None]], batch: int) -> None:
        """Calls ``on_due`` with due keys, in batches, until cancelled."""
        while True:
            due = self.pop_due(batch)
            if due:
                await on_due(due)
                await asyncio.sleep(0)  # let RPCs in between batches of a mass expiry
                continue
            self._changed.clear()
            timeout = self._heap[0][0] - self._now() if self._heap else None
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), timeout)
