"""Which registry replica leads: etcd's election recipe, on the store's connection.

A candidate creates the leader key in a transaction that succeeds only while the key does not
exist, attached to an etcd lease it keeps alive; the key's value says where the leader serves.
The create revision of that key is the leader's ``Term`` and the fence of all its writes
(``EtcdBackend.write``): revisions only grow, so a successor's key always has a later one and a
deposed leader's fenced writes are refused, however late they arrive. A leader that cannot
refresh its lease for half the TTL stops serving on its own (``keep_alive`` returns) before
etcd lets anyone else win.

The connection is shared with the store (its commits, loads and watch): a call of either that
fails reconnects, which closes the client under every other call waiting on it. Every call here
goes through ``EtcdConnection.call``, as the store's do, which makes such a cut-off call a
``StoreUnavailable`` like any other failed call (unless the task itself is being cancelled), so
the replica's election goes on rather than end with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass

import structlog
from aetcd import rpc

from kvbroker.controlplane.errors import StoreUnavailable
from kvbroker.controlplane.storage.etcd_store import EtcdConnection, key_created_at

log = structlog.get_logger("kvbroker.registry")


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
        async with self.connection.call("observing") as client:
            current = await client.get(self.key)
        return current.value.decode() if current is not None else None

    async def campaign(self, value: str) -> Term | None:
        """Leads from now on, serving at ``value``, if nobody does; None if another candidate
        got there first."""
        async with self.connection.call("campaigning") as client:
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
                async with self.connection.call("refreshing the leader's lease") as client:
                    reply = await asyncio.wait_for(
                        client.refresh_lease(term.lease_id), self.ttl_s / 4
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
            async with self.connection.call("resigning") as client:
                await asyncio.wait_for(
                    client.revoke_lease(term.lease_id), self.connection.timeout_s
                )
