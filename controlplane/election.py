"""Which registry replica leads: etcd's election recipe, on the store's connection.

A candidate creates the leader key in a transaction that succeeds only while the key does not
exist, attached to an etcd lease it keeps alive; the key's value says where the leader serves.
The create revision of that key is the leader's ``Term`` and the fence of all its writes
(``EtcdBackend.write``): revisions only grow, so a successor's key always has a later one and a
deposed leader's fenced writes are refused, however late they arrive. A leader that cannot
refresh its lease for half the TTL stops serving on its own (``keep_alive`` returns) before
etcd lets anyone else win.

The connection is shared with the store (its commits, loads and watch): a call of either that
fails reconnects, which closes the client under every other call waiting on it, and grpc.aio
ends those with ``CancelledError``. Every call here goes through ``Election._call``, which
makes that a ``StoreUnavailable`` like any other failed call (unless the task itself is being
cancelled), so the replica's election goes on rather than end with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import aetcd
import structlog
from aetcd import rpc

from kvbroker.common.tasks import own_cancellation
from kvbroker.controlplane.errors import StoreUnavailable
from kvbroker.controlplane.etcd_store import ETCD_ERRORS, EtcdConnection, key_created_at

log = structlog.get_logger("kvbroker.registry")
T = TypeVar("T")


@dataclass(frozen=True)
class Term:
    """One won election."""

    # The leader key's create revision: the fence of this leader's writes.
    revision: int
    # The etcd lease that keeps the key.
    lease_id: int


class Election:
    def __init__(self, connection: EtcdConnection, key: bytes, ttl_s: int) -> None:
        self.connection = connection
        self.key = key
        # etcd raises TTLs below its own minimum (2 s with default timing).
        self.ttl_s = ttl_s

    async def observe(self) -> str | None:
        """Where the current leader serves; None while nobody leads."""
        current = await self._call("observing", lambda client: client.get(self.key))
        return current.value.decode() if current is not None else None

    async def campaign(self, value: str) -> Term | None:
        """Leads from now on, serving at ``value``, if nobody does; None if another candidate
        got there first."""

        async def create(client: aetcd.Client) -> Term | None:
            lease = await client.lease(self.ttl_s)
            response = await client.kvstub.Txn(
                rpc.TxnRequest(
                    compare=[key_created_at(self.key, 0)],
                    success=[
                        rpc.RequestOp(
                            request_put=rpc.PutRequest(
                                key=self.key, value=value.encode(), lease=lease.id
                            )
                        )
                    ],
                ),
                timeout=self.connection.timeout_s,
            )
            if not response.succeeded:
                await client.revoke_lease(lease.id)
                return None
            return Term(revision=int(response.header.revision), lease_id=lease.id)

        return await self._call("campaigning", create)

    async def keep_alive(self, term: Term, stop: asyncio.Event) -> None:
        """Refreshes the term's lease until ``stop`` is set or the term is lost or may be: a
        leader that has not refreshed for half the TTL returns before anyone else can win."""
        last_refresh = time.monotonic()
        while time.monotonic() - last_refresh < self.ttl_s / 2:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.ttl_s / 6)
            if stop.is_set():
                return
            try:
                reply = await self._call(
                    "refreshing the leader's lease",
                    lambda client: asyncio.wait_for(
                        client.refresh_lease(term.lease_id), self.ttl_s / 4
                    ),
                )
            except StoreUnavailable as error:
                log.warning("leader_keepalive_failed", error=error.message)
                continue
            if reply is None or reply.TTL <= 0:
                return  # the lease is gone: someone else may lead already
            last_refresh = time.monotonic()

    async def resign(self, term: Term) -> None:
        """Gives the key up, so another candidate wins at once rather than after the TTL;
        best effort (unreachable, the lease expires anyway)."""
        with contextlib.suppress(StoreUnavailable):
            await self._call(
                "resigning",
                lambda client: asyncio.wait_for(
                    client.revoke_lease(term.lease_id), self.connection.timeout_s
                ),
            )

    async def _call(self, what: str, call: Callable[[aetcd.Client], Awaitable[T]]) -> T:
        """``call`` on the shared client; ``StoreUnavailable`` when it fails, ``what`` saying
        what was being done."""
        try:
            client = await self.connection.client()
            return await call(client)
        except ETCD_ERRORS as error:
            await self.connection.reconnect()
            raise StoreUnavailable(f"etcd unreachable while {what}: {error}") from error
        except asyncio.CancelledError as error:
            if own_cancellation():
                raise
            # Another call failed and closed the shared client under this one. It is being
            # replaced already: reconnecting again would close the next client under others.
            raise StoreUnavailable(
                f"etcd call cut off while {what}: another call's failure closed the client"
            ) from error
