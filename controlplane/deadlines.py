"""A deadline notifier built on a heap, after etcd's lessor: no scan of all records per tick.

Each key has at most one current deadline; rescheduling leaves the old heap entry behind and
it is skipped when popped (lazy deletion), so schedule and cancel are O(log n) and O(1).
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
from collections.abc import Awaitable, Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


class DeadlineQueue(Generic[K]):
    def __init__(self, now: Callable[[], float]) -> None:
        self._now = now
        self._heap: list[tuple[float, int, K]] = []
        self._current: dict[K, float] = {}
        self._tiebreak = itertools.count()
        self._changed = asyncio.Event()

    def __len__(self) -> int:
        return len(self._current)

    def schedule(self, key: K, when: float) -> None:
        earliest = self._heap[0][0] if self._heap else None
        self._current[key] = when
        heapq.heappush(self._heap, (when, next(self._tiebreak), key))
        if earliest is None or when < earliest:
            self._changed.set()

    def cancel(self, key: K) -> None:
        self._current.pop(key, None)

    def deadline(self, key: K) -> float | None:
        return self._current.get(key)

    def pop_due(self, limit: int) -> list[K]:
        """Keys whose current deadline has passed, earliest first, at most ``limit``."""
        now = self._now()
        due: list[K] = []
        while self._heap and len(due) < limit:
            when, _, key = self._heap[0]
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
