"""The registry's unit of work: the one lock, then the store's commit, then the commands the
change implies (docs/design.md, "Commit, then send").

Every mutation of the registry runs as ``async with registry._mutation:``, so a store with real
awaits (etcd) sees the same ordering as the memory store. It lives here, beside the store and
the outbox it orders, rather than in the registry's facade: the rule is about storage (when a
change is durable and may be told), and no part's logic is in it.

A class with ``__aenter__``/``__aexit__`` rather than a generator-based context manager, which
costs several microseconds more on every hint; one instance serves every mutation, since
nothing of one mutation is kept on it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import structlog

from kvbroker.controlplane.errors import CommitUndone, StoreRefused, StoreUnavailable
from kvbroker.controlplane.storage.outbox import Outbox, Unsent
from kvbroker.controlplane.storage.store import Store


class Mutation:
    __slots__ = ("_lock", "_log", "_on_store_failure", "_outbox", "_resync", "_store")

    def __init__(
        self,
        store: Store,
        outbox: Outbox,
        resync: Callable[[], Awaitable[None]],
        on_store_failure: Callable[[StoreUnavailable], None] | None,
        log: structlog.typing.FilteringBoundLogger,
    ) -> None:
        """``resync``: rebuilds what was derived from the records after the store refused one
        (run under the lock, before the next mutation); ``on_store_failure``: told when the
        store is unavailable (the replica steps down)."""
        self._lock = asyncio.Lock()
        self._store = store
        self._outbox = outbox
        self._resync = resync
        self._on_store_failure = on_store_failure
        self._log = log

    async def __aenter__(self) -> None:
        await self._lock.acquire()
        if self._store.resync_due:
            try:
                await self._resync()
            except BaseException:
                self._lock.release()
                raise

    async def __aexit__(self, *exc: object) -> None:
        unsent = self._outbox.take()
        # The next mutation may start on the changed view while this one's writes are being
        # committed (group commit); this one answers, and its commands go out, only after.
        self._lock.release()
        await self._commit(unsent)

    async def _commit(self, unsent: Unsent) -> None:
        """A change that failed half-way is committed as far as it got, as the memory store
        keeps it; commands go out only once their change is durable."""
        try:
            await self._store.commit()
        except (StoreRefused, CommitUndone) as error:
            # The store refused a record, not this leader: nothing was written, the cache is
            # undone, and the next mutation rebuilds what was derived from it (``resync``).
            self._log.error("store_commit_refused", error=error.message)
            raise
        except StoreUnavailable as error:
            self._log.error("store_commit_failed", error=error.message)
            if self._on_store_failure is not None:
                self._on_store_failure(error)
            raise
        self._outbox.deliver(unsent)
