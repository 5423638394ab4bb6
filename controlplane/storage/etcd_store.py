"""The registry's state in etcd, for registries that span machines (``--store etcd://…``).

``EtcdStore`` is the registry's ``CachedStore`` with ``EtcdBackend`` behind it: reads come from
the cache, so a hint never waits on etcd; each commit is one etcd transaction guarded by a
fence. The fence is the leader key's create revision that this replica won
(``controlplane.replication.election``): a transaction succeeds only while the key still has it, and
a successor's key always has a later one, so once deposed a replica can never overwrite its
successor, however late its writes arrive (etcd's election recipe). A follower keeps its cache
fed by a watch from the revision it loaded at; the watch covers the leader key too, so a new
leader knows when its cache has seen its own election (``CachedStore.catch_up``).

Every call of the store and of the election goes through ``EtcdConnection.call``, the one rule
for how an etcd call fails (``StoreUnavailable``), including one cut off by another's reconnect.

A transaction holds at most ``--max-txn-ops`` operations and ``--max-request-bytes`` bytes, both
settings of the etcd deployment; ``ETCD_DEFAULT_LIMITS`` are etcd's defaults, and a store told
of raised ones (``limits``) takes larger commits in one transaction. A commit beyond them goes
in several, in order (``controlplane.storage.group_commit`` says why that is safe).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import aetcd
import aetcd.exceptions
import aetcd.rtypes
import aetcd.utils
import grpc
from aetcd import rpc

from kvbroker.common.process.tasks import own_cancellation
from kvbroker.controlplane.errors import StoreRefused, StoreUnavailable
from kvbroker.controlplane.storage.cached_store import CachedStore
from kvbroker.controlplane.storage.state_cache import RecordKind, StateCache
from kvbroker.controlplane.storage.store import REPLAYED, Change, Deposed, WatchEvent, WriteLimits

# etcd's defaults: --max-txn-ops 128 and --max-request-bytes 1.5 MiB, of which 0.5 MiB is left
# for the request's own framing (``EtcdBackend.size`` counts keys and values).
ETCD_DEFAULT_LIMITS = WriteLimits(operations=128, size_bytes=1 << 20)
# Framing of one operation in a transaction beyond its key and value, rounded up.
_OPERATION_BYTES = 16
# Keys per range request when loading (leases are ~1 KB: well under gRPC's 4 MiB limit).
LOAD_PAGE = 1000
# What etcd answers a request it will not take as it stands ("request is too large", "too many
# operations in txn request", or past its gRPC message limit): nothing of it was applied.
_REFUSED_CODES = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED)
ETCD_ERRORS = (aetcd.exceptions.ClientError, grpc.aio.AioRpcError, OSError, TimeoutError)


@dataclass(frozen=True)
class EtcdEndpoints:
    """``etcd://HOST:PORT[,HOST:PORT...]``: the members to try, in order."""

    members: Sequence[tuple[str, int]]

    @classmethod
    def parse(cls, url: str) -> EtcdEndpoints:
        if not url.startswith("etcd://"):
            raise ValueError(f"store {url!r} is neither 'memory' nor etcd://HOST:PORT[,…]")
        members = []
        for member in url.removeprefix("etcd://").rstrip("/").split(","):
            host, sep, port = member.strip().rpartition(":")
            if not sep or not host or not port.isdigit():
                raise ValueError(f"etcd member {member!r} is not HOST:PORT")
            members.append((host, int(port)))
        return cls(members)


class EtcdConnection:
    """One client to one member at a time; after a failure the next call connects to the next
    member. The backend and the election share it, so a call that fails and reconnects closes
    the client under every other call waiting on it (``call`` says what those see)."""

    def __init__(self, endpoints: EtcdEndpoints, timeout_s: float = 2.0) -> None:
        self.endpoints = endpoints
        self.timeout_s = timeout_s
        self._client: aetcd.Client | None = None
        self._member = 0

    async def _connected(self) -> aetcd.Client:
        if self._client is None:
            host, port = self.endpoints.members[self._member % len(self.endpoints.members)]
            client = aetcd.Client(host=host, port=port, timeout=self.timeout_s)
            await client.connect()
            self._client = client
        return self._client

    @contextlib.asynccontextmanager
    async def call(self, what: str) -> AsyncIterator[aetcd.Client]:
        """The client, for one call (or one watch) made in the ``async with`` body; any failure
        of it becomes ``StoreUnavailable``, ``what`` saying what was being done, and the next
        call connects to the next member. A call's outcome is then unknown, so a write's caller
        must not write again before a reload (``GroupCommit``).

        A call cut off by another call's reconnect ends with the ``CancelledError`` of grpc.aio
        (its channel was closed), though its task was not cancelled: it too has failed, but the
        client is being replaced already, and reconnecting again would close the next one under
        others. The task's own cancellation stays a ``CancelledError``."""
        try:
            yield await self._connected()
        except ETCD_ERRORS as error:
            await self.reconnect()
            raise StoreUnavailable(f"etcd unreachable while {what}: {error}") from error
        except asyncio.CancelledError as error:
            if own_cancellation():
                raise
            raise StoreUnavailable(
                f"etcd call cut off while {what}: another call's failure closed the client"
            ) from error

    async def reconnect(self) -> None:
        client, self._client = self._client, None
        self._member += 1
        if client is not None:
            with contextlib.suppress(*ETCD_ERRORS):
                await client.close()

    async def close(self) -> None:
        if self._client is not None:
            with contextlib.suppress(*ETCD_ERRORS):
                await self._client.close()
            self._client = None


def key_created_at(key: bytes, revision: int) -> rpc.Compare:
    """The election's compare: ``key`` was created at ``revision`` (0: it does not exist).
    Campaigns use it with 0; every write of a leader with its fence."""
    return rpc.Compare(
        key=key, result=rpc.Compare.EQUAL, target=rpc.Compare.CREATE, create_revision=revision
    )


class EtcdBackend:
    """Records under ``PREFIX/v1/KIND/ID``; the leader key is ``PREFIX/leader``.

    Records of the ``unwritten`` kinds (the replayed ones) are never written here, but
    earlier registries wrote leases and conversations: load and watch pass over those keys,
    since a record no leader updates any more would come back as a lease its holder may have
    freed long ago. They are harmless left there; ``etcdctl del --prefix PREFIX/v1/lease/``
    (and ``.../conversation/``) removes them."""

    durable = True

    def __init__(
        self,
        connection: EtcdConnection,
        prefix: str = "/kvbroker",
        limits: WriteLimits = ETCD_DEFAULT_LIMITS,
        unwritten: frozenset[RecordKind] = REPLAYED,
    ) -> None:
        self.connection = connection
        self.limits = limits
        self.unwritten = unwritten
        self.root_prefix = f"{prefix.rstrip('/')}/".encode()
        self.data_prefix = self.root_prefix + b"v1/"
        self.leader_key = self.root_prefix + b"leader"

    def record_key(self, kind: RecordKind, ident: str) -> bytes:
        return self.data_prefix + f"{kind.value}/{ident}".encode()

    def _change(self, key: bytes, value: bytes | None) -> Change | None:
        """The record change at ``key``; None for a kind this store does not write."""
        kind, _, ident = key.removeprefix(self.data_prefix).decode().partition("/")
        record_kind = RecordKind(kind)
        return None if record_kind in self.unwritten else Change(record_kind, ident, value)

    def size(self, change: Change) -> int:
        key = self.record_key(change.kind, change.ident)
        return len(key) + len(change.raw or b"") + _OPERATION_BYTES

    async def load(self, into: StateCache) -> int:
        """Every record, read in pages at one revision (a single range would pass gRPC's
        message limit beyond a few thousand leases)."""
        start, end = self.data_prefix, aetcd.utils.prefix_range_end(self.data_prefix)
        revision = 0
        async with self.connection.call("loading") as client:
            while True:
                response = await client.kvstub.Range(
                    rpc.RangeRequest(key=start, range_end=end, limit=LOAD_PAGE, revision=revision),
                    timeout=self.connection.timeout_s,
                )
                revision = revision or response.header.revision
                for kv in response.kvs:
                    if (change := self._change(kv.key, kv.value)) is not None:
                        into.apply(change.kind, change.ident, change.raw)
                if not response.more:
                    return revision
                start = response.kvs[-1].key + b"\0"

    async def write(self, changes: Sequence[Change], fence: int | None) -> int:
        if fence is None:
            raise Deposed("this registry replica does not lead; it cannot write")
        ops = [
            rpc.RequestOp(
                request_put=rpc.PutRequest(key=self.record_key(c.kind, c.ident), value=c.raw)
            )
            if c.raw is not None
            else rpc.RequestOp(
                request_delete_range=rpc.DeleteRangeRequest(key=self.record_key(c.kind, c.ident))
            )
            for c in changes
        ]
        async with self.connection.call("writing") as client:
            try:
                response = await client.kvstub.Txn(
                    rpc.TxnRequest(compare=[key_created_at(self.leader_key, fence)], success=ops),
                    timeout=self.connection.timeout_s,
                )
            except grpc.aio.AioRpcError as error:
                if error.code() not in _REFUSED_CODES:
                    raise
                # etcd checked the request and took none of it (too large, too many
                # operations): the record is at fault, not the leader or the connection.
                raise StoreRefused(f"etcd refused the write: {error.details()}") from error
        if not response.succeeded:
            raise Deposed(
                "this registry replica was deposed (the leader key changed); "
                "its writes are fenced off"
            )
        return int(response.header.revision)

    async def watch(self, after: int) -> AsyncIterator[WatchEvent]:
        """Records and the leader key: an election advances the revision too. aetcd ends a
        watch quietly when its client is closed (another call's reconnect): that is a broken
        watch too, since etcd's own never ends."""
        async with self.connection.call("watching") as client:
            events = await client.watch_prefix(self.root_prefix, start_revision=after + 1)
            async for event in events:
                kv = event.kv
                change = None
                if kv.key.startswith(self.data_prefix):
                    deleted = event.kind == aetcd.rtypes.EventKind.DELETE
                    change = self._change(kv.key, None if deleted else kv.value)
                yield WatchEvent(kv.mod_revision, change)
        raise StoreUnavailable("etcd watch ended: its client was closed by another call's failure")

    async def close(self) -> None:
        await self.connection.close()


class EtcdStore(CachedStore):
    def __init__(
        self,
        endpoints: EtcdEndpoints,
        prefix: str = "/kvbroker",
        timeout_s: float = 2.0,
        limits: WriteLimits = ETCD_DEFAULT_LIMITS,
        soft: frozenset[RecordKind] = REPLAYED,
    ) -> None:
        self.connection = EtcdConnection(endpoints, timeout_s)
        self.etcd = EtcdBackend(self.connection, prefix, limits, soft)
        super().__init__(self.etcd, soft)
        self.leader_key = self.etcd.leader_key

    def _key(self, kind: str, ident: str) -> bytes:
        """Where a record lives in etcd (tests read it there)."""
        return self.etcd.record_key(RecordKind(kind), ident)
