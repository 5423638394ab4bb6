"""The registry's state in etcd, for registries that span machines (``--store etcd://…``).

Reads come from a local cache (the memory store's dicts and indexes), so a hint never waits on
etcd. Writes are buffered and ``commit()`` sends them as one transaction guarded by a fence:
it succeeds only while the leader key still has the create revision this replica won it at,
so a deposed leader can never overwrite its successor (etcd's election recipe). A follower
keeps its cache fed by a watch from the revision it loaded at; a new leader serves from that
cache once it has seen its own election (``catch_up``), and reloads otherwise.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass

import aetcd
import aetcd.exceptions
import aetcd.rtypes
import aetcd.utils
import grpc
import structlog
from aetcd import rpc

from controlplane.errors import StoreUnavailable
from controlplane.store import MemoryStore
from kvbroker.v1 import lease_pb2, node_pb2

log = structlog.get_logger("kvbroker.registry")

# etcd's default --max-txn-ops; larger change sets (a node's mass withdrawal) go in chunks.
MAX_TXN_OPS = 128
# etcd refuses requests over 1.5 MiB (--max-request-bytes); transactions stay under this.
MAX_TXN_BYTES = 1 << 20
# The registry's cap on block hashes per lease over etcd: a lease stays well under
# MAX_TXN_BYTES (16,384 hashes of 32 bytes is 512 KiB; 2M tokens at vLLM's CPU block size).
MAX_BLOCK_HASHES = 16_384
# Keys per range request when loading (leases are ~1 KB: well under gRPC's 4 MiB limit).
LOAD_PAGE = 1000
_NODE, _CONVERSATION, _LEASE = "node", "conversation", "lease"
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


class EtcdStore(MemoryStore):
    def __init__(self, endpoints: EtcdEndpoints, prefix: str = "/kvbroker", timeout_s: float = 2.0):
        super().__init__()
        self.endpoints = endpoints
        self.timeout_s = timeout_s
        self.root_prefix = f"{prefix.rstrip('/')}/".encode()
        self.data_prefix = self.root_prefix + b"v1/"
        self.leader_key = self.root_prefix + b"leader"
        # The leader key's create revision this replica won; None while it does not lead.
        self.fence: int | None = None
        self.revision = 0
        # True while a watch keeps the cache current (``follow``).
        self.following = False
        self._advanced = asyncio.Event()
        self._pending: dict[bytes, bytes | None] = {}
        self._flushing: asyncio.Task[None] | None = None
        self._broken: StoreUnavailable | None = None
        self._client: aetcd.Client | None = None
        self._member = 0

    # ------------------------------------------------------------ connection

    async def client(self) -> aetcd.Client:
        """A connected client; rotates to the next member after a failure (``reconnect``)."""
        if self._client is None:
            host, port = self.endpoints.members[self._member % len(self.endpoints.members)]
            client = aetcd.Client(host=host, port=port, timeout=self.timeout_s)
            await client.connect()
            self._client = client
        return self._client

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

    # ------------------------------------------------------------ keys

    def leader_key_created_at(self, revision: int) -> rpc.Compare:
        """The election's compare: the leader key was created at ``revision`` (0: it does not
        exist). Campaigns use it with 0; every write of a leader with its fence."""
        return rpc.Compare(
            key=self.leader_key,
            result=rpc.Compare.EQUAL,
            target=rpc.Compare.CREATE,
            create_revision=revision,
        )

    def _key(self, kind: str, ident: str) -> bytes:
        return self.data_prefix + f"{kind}/{ident}".encode()

    def _apply(self, key: bytes, value: bytes | None, cache: MemoryStore) -> None:
        """One record from etcd into a cache (load and watch)."""
        kind, _, ident = key.removeprefix(self.data_prefix).decode().partition("/")
        if kind == _NODE:
            if value is None:
                cache._nodes.pop(ident, None)
            else:
                node = node_pb2.Node.FromString(value)
                cache._nodes[node.spec.node_id] = node
        elif kind == _CONVERSATION:
            if value is None:
                cache._conversations.pop(ident, None)
            else:
                cache._conversations[ident] = value
        elif kind == _LEASE:
            if value is None:
                cache._forget_lease(ident)
            else:
                cache._keep_lease(lease_pb2.Lease.FromString(value), value)

    # ------------------------------------------------------------ load and follow

    async def load(self) -> int:
        """Replaces the cache with etcd's contents, read in pages at one revision (a single
        range would pass gRPC's message limit beyond a few thousand leases); returns it."""
        start, end = self.data_prefix, aetcd.utils.prefix_range_end(self.data_prefix)
        revision = 0
        fresh = MemoryStore()  # the cache in use stays whole until the load has succeeded
        try:
            client = await self.client()
            while True:
                response = await client.kvstub.Range(
                    rpc.RangeRequest(key=start, range_end=end, limit=LOAD_PAGE, revision=revision),
                    timeout=self.timeout_s,
                )
                revision = revision or response.header.revision
                for kv in response.kvs:
                    self._apply(kv.key, kv.value, fresh)
                if not response.more:
                    break
                start = response.kvs[-1].key + b"\0"
        except ETCD_ERRORS as error:
            await self.reconnect()
            raise StoreUnavailable(f"etcd unreachable while loading: {error}") from error
        self.adopt(fresh)
        self._pending.clear()
        self._broken = None
        self.revision = revision
        log.info(
            "store_loaded",
            revision=self.revision,
            nodes=len(self._nodes),
            conversations=len(self._conversations),
            leases=len(self._leases),
        )
        return self.revision

    async def follow(self) -> None:
        """Keeps the cache current from a watch, reloading when the watch breaks; until
        cancelled (the replica cancels it when it becomes the leader). The watch covers the
        leader key too, so ``revision`` also advances past elections (see ``catch_up``)."""
        try:
            while True:
                self.following = False
                try:
                    await self.load()
                    client = await self.client()
                    watch = await client.watch_prefix(
                        self.root_prefix, start_revision=self.revision + 1
                    )
                    self.following = True
                    async for event in watch:
                        kv = event.kv
                        if kv.key.startswith(self.data_prefix):
                            deleted = event.kind == aetcd.rtypes.EventKind.DELETE
                            self._apply(kv.key, None if deleted else kv.value, self)
                        self.revision = max(self.revision, kv.mod_revision)
                        self._advanced.set()
                except (StoreUnavailable, *ETCD_ERRORS) as error:
                    log.warning("store_watch_broken", error=str(error))
                    await self.reconnect()
                    await asyncio.sleep(0.5)
        finally:
            self.following = False

    async def catch_up(self, revision: int, within_s: float) -> bool:
        """True once the followed cache has applied every change up to ``revision``; False
        if the watch is not running or does not get there in time (then: ``load``)."""
        deadline = time.monotonic() + within_s
        while self.following and self.revision < revision:
            self._advanced.clear()
            try:
                await asyncio.wait_for(self._advanced.wait(), deadline - time.monotonic())
            except TimeoutError:
                return False
        return self.following and self.revision >= revision

    # ------------------------------------------------------------ writes

    async def put_node(self, node: node_pb2.Node, durable: bool = True) -> None:
        await super().put_node(node)
        if durable:
            self._pending[self._key(_NODE, node.spec.node_id)] = node.SerializeToString()

    async def put_conversation(self, conversation: lease_pb2.Conversation) -> None:
        raw = conversation.SerializeToString()
        self._conversations[conversation.conversation_id] = raw
        self._pending[self._key(_CONVERSATION, conversation.conversation_id)] = raw

    async def delete_conversation(self, conversation_id: str) -> None:
        await super().delete_conversation(conversation_id)
        self._pending[self._key(_CONVERSATION, conversation_id)] = None

    async def put_lease(self, lease: lease_pb2.Lease, durable: bool = True) -> None:
        raw = lease.SerializeToString()
        self._keep_lease(lease, raw)
        if durable:
            self._pending[self._key(_LEASE, lease.lease_id)] = raw

    async def delete_lease(self, lease_id: str) -> None:
        await super().delete_lease(lease_id)
        self._pending[self._key(_LEASE, lease_id)] = None

    async def commit(self) -> None:
        """Group commit: returns once everything written so far is in etcd. While one flush is
        in flight, the writes of later mutations gather for the next, so concurrent mutations
        share transactions instead of queueing one etcd round trip each."""
        while True:
            if self._broken is not None:
                raise self._broken
            flushing = self._flushing
            if flushing is not None and not flushing.done():
                await asyncio.shield(flushing)
                continue
            if not self._pending:
                return
            batch, self._pending = list(self._pending.items()), {}
            self._flushing = asyncio.create_task(self._flush(batch), name="kvbroker-etcd-flush")
            await asyncio.shield(self._flushing)
            return

    async def _flush(self, pending: list[tuple[bytes, bytes | None]]) -> None:
        try:
            await self._write(pending)
        except StoreUnavailable as error:
            # The cache is now ahead of etcd: no write may follow until a reload.
            self._broken = error
            raise

    async def _write(self, pending: list[tuple[bytes, bytes | None]]) -> None:
        if self.fence is None:
            raise StoreUnavailable("this registry replica does not lead; it cannot write")
        fence = self.leader_key_created_at(self.fence)
        try:
            client = await self.client()
            for chunk in _chunks(pending):
                ops = [
                    rpc.RequestOp(request_put=rpc.PutRequest(key=key, value=value))
                    if value is not None
                    else rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(key=key))
                    for key, value in chunk
                ]
                response = await client.kvstub.Txn(
                    rpc.TxnRequest(compare=[fence], success=ops), timeout=self.timeout_s
                )
                if not response.succeeded:
                    raise StoreUnavailable(
                        "this registry replica was deposed (the leader key changed); "
                        "its writes are fenced off"
                    )
                self.revision = response.header.revision
        except ETCD_ERRORS as error:
            await self.reconnect()
            raise StoreUnavailable(f"etcd did not take the write: {error}") from error


def _chunks(
    pending: list[tuple[bytes, bytes | None]],
) -> list[list[tuple[bytes, bytes | None]]]:
    """Writes split into transactions within etcd's limits on operations and bytes. One change
    set normally fits one transaction; only a mass change (a node's withdrawal) is split."""
    chunks: list[list[tuple[bytes, bytes | None]]] = [[]]
    size = 0
    for key, value in pending:
        item = len(key) + len(value or b"")
        if chunks[-1] and (len(chunks[-1]) == MAX_TXN_OPS or size + item > MAX_TXN_BYTES):
            chunks.append([])
            size = 0
        chunks[-1].append((key, value))
        size += item
    return chunks
