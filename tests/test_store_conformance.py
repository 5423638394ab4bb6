"""One suite for every store backend, as llm-d runs its KV-cache index suite against each: the
same test functions, parametrised over the memory backend and a real etcd.

The memory backend keeps nothing by design, so the tests of durability (what a reload sees,
one transaction per commit, fences, watches) run on etcd only (``DURABLE``).
"""

from __future__ import annotations

import asyncio
import subprocess
import uuid
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import aetcd
import pytest

from kvbroker.common.process.local_etcd import LocalEtcd
from kvbroker.common.process.tasks import poll_until
from kvbroker.controlplane.records import codec
from kvbroker.controlplane.records.model import Conversation, KvHandle, Lease, Node, NodeLoad
from kvbroker.controlplane.replication.election import Election
from kvbroker.controlplane.storage.cached_store import CachedStore, MemoryStore
from kvbroker.controlplane.storage.etcd_store import ETCD_DEFAULT_LIMITS, EtcdEndpoints, EtcdStore
from kvbroker.controlplane.storage.store import CommitTooLarge, Deposed, WriteLimits
from kvbroker.v1 import lease_pb2, node_pb2
from kvbroker_tools.harness.factories import block_hashes, node_spec

pytestmark = pytest.mark.etcd

ACTIVE, CLAIMED, EXPIRED = (
    lease_pb2.LEASE_STATE_ACTIVE,
    lease_pb2.LEASE_STATE_CLAIMED,
    lease_pb2.LEASE_STATE_EXPIRED,
)


def start_etcd(data_dir: Path, *flags: str) -> tuple[LocalEtcd, subprocess.Popen[bytes]]:
    """A plain process rather than LocalEtcd.start(): a module-scoped fixture outlives the
    event loop of any one test, and an asyncio child is bound to the loop that started it."""
    local = LocalEtcd(data_dir)
    process = subprocess.Popen(
        [*local.child.argv, *flags], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )

    async def answers() -> bool:
        await local.leader()
        return True

    # In a thread of its own: the fixture may be set up from within a running event loop.
    with ThreadPoolExecutor(1) as thread:
        thread.submit(asyncio.run, poll_until(answers, 30, "etcd answering")).result()
    return local, process


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalEtcd]:
    local, process = start_etcd(tmp_path_factory.mktemp("etcd"))
    yield local
    process.terminate()
    process.wait()


@dataclass
class Backing:
    """Stores over one backend: ``leader`` may write, ``reader`` loads what was written."""

    etcd: LocalEtcd | None
    prefix: str = field(default_factory=lambda: f"/test-{uuid.uuid4().hex}")
    stores: list[CachedStore] = field(default_factory=list)

    def store(self, limits: WriteLimits = ETCD_DEFAULT_LIMITS) -> CachedStore:
        store: CachedStore
        if self.etcd is None:
            store = MemoryStore()
        else:
            # Every kind written, leases too: the store's rules hold for any record it writes.
            store = EtcdStore(
                EtcdEndpoints.parse(self.etcd.url), self.prefix, limits=limits, soft=frozenset()
            )
        self.stores.append(store)
        return store

    async def leader(self, limits: WriteLimits = ETCD_DEFAULT_LIMITS) -> CachedStore:
        store = self.store(limits)
        if isinstance(store, EtcdStore):
            term = await election_of(store).campaign("test-leader")
            assert term is not None
            store.fence = term.revision
        return store

    async def reader(self) -> CachedStore:
        store = self.store()
        await store.load()
        return store


def election_of(store: EtcdStore) -> Election:
    return Election(store.connection, store.leader_key, ttl_s=10)


# The backends that keep what they write: the durability tests are parametrised over these.
DURABLE = pytest.mark.parametrize("backing", ["etcd"], indirect=True)


@pytest.fixture(params=["memory", "etcd"])
async def backing(request: pytest.FixtureRequest) -> AsyncIterator[Backing]:
    backing = Backing(request.getfixturevalue("etcd") if request.param == "etcd" else None)
    yield backing
    for store in backing.stores:
        await store.close()


def node(node_id: str, state: node_pb2.NodeState = node_pb2.NODE_STATE_READY) -> Node:
    return Node(spec=node_spec(node_id), state=state)


def lease(
    lease_id: str,
    node_id: str = "decode-0",
    request_id: str = "",
    conversation_id: str = "conv-0",
    state: lease_pb2.LeaseState = ACTIVE,
) -> Lease:
    return Lease(
        lease_id=lease_id,
        node_id=node_id,
        conversation_id=conversation_id,
        handle=KvHandle(remote_request_id=request_id or f"req-{lease_id}"),
        checkpoints=codec.checkpoints(block_hashes(64, salt=lease_id)),
        state=state,
    )


async def lease_ids(store: CachedStore, **where: str) -> list[str]:
    return [found.lease_id for found in await store.list_leases(**where)]


async def etcd_revisions(backing: Backing) -> dict[str, int]:
    """Each record's key (relative to the prefix) and the revision it was last written at."""
    assert backing.etcd is not None
    async with aetcd.Client(port=backing.etcd.client_port, timeout=5) as client:
        found = await client.get_prefix(f"{backing.prefix}/v1/".encode())
        return {
            kv.key.decode().removeprefix(f"{backing.prefix}/v1/"): kv.mod_revision for kv in found
        }


# ---------------------------------------------------------------- every backend


async def test_reads_are_copies(backing: Backing) -> None:
    """A record read or put is the caller's own: changing it changes nothing stored."""
    store = await backing.leader()
    put = node("decode-0")
    await store.put_node(put)
    put.state = node_pb2.NODE_STATE_DOWN
    read = await store.get_node("decode-0")
    assert read is not None and read.state == node_pb2.NODE_STATE_READY
    read.state = node_pb2.NODE_STATE_DRAINING
    listed = await store.list_nodes()
    assert [n.state for n in listed] == [node_pb2.NODE_STATE_READY]
    listed[0].state = node_pb2.NODE_STATE_DOWN
    assert (await store.list_nodes())[0].state == node_pb2.NODE_STATE_READY

    granted = lease("lease-1")
    await store.put_lease(granted)
    granted.state = EXPIRED
    for reading in (
        await store.get_lease("lease-1"),
        await store.find_lease("decode-0", "req-lease-1"),
        *(await store.live_leases_of_node("decode-0")),
        *(await store.list_leases()),
    ):
        assert reading is not None and reading.state == ACTIVE
        reading.state = EXPIRED
    assert store.live_lease_ids("decode-0") == {"lease-1"}

    conversation = Conversation(conversation_id="conv-0", lease_id="lease-1")
    await store.put_conversation(conversation)
    conversation.lease_id = "lease-2"
    stored = await store.get_conversation("conv-0")
    assert stored is not None and stored.lease_id == "lease-1"
    await store.commit()


async def test_records_are_put_and_deleted(backing: Backing) -> None:
    store = await backing.leader()
    for node_id in ("decode-1", "decode-0", "prefill-0"):
        await store.put_node(node(node_id))
    await store.put_conversation(Conversation(conversation_id="conv-0", epoch=3))
    await store.put_lease(lease("lease-1"))
    await store.commit()
    assert [n.spec.node_id for n in await store.list_nodes()] == [
        "decode-0",
        "decode-1",
        "prefill-0",
    ]
    assert [c.epoch for c in await store.list_conversations()] == [3]

    await store.delete_conversation("conv-0")
    await store.delete_lease("lease-1")
    await store.delete_lease("never-granted")
    await store.commit()
    assert await store.get_conversation("conv-0") is None
    assert await store.get_lease("lease-1") is None
    assert await store.find_lease("decode-0", "req-lease-1") is None
    assert await lease_ids(store) == []
    assert store.live_lease_ids("decode-0") == set()


async def test_leases_list_in_id_order_and_page(backing: Backing) -> None:
    store = await backing.leader()
    for index in (5, 1, 4, 2, 3):
        await store.put_lease(
            lease(f"lease-{index}", node_id=f"decode-{index % 2}", conversation_id=f"conv-{index}")
        )
    await store.commit()
    assert await lease_ids(store) == [f"lease-{i}" for i in range(1, 6)]
    assert await lease_ids(store, after="lease-2") == ["lease-3", "lease-4", "lease-5"]
    assert await lease_ids(store, node_id="decode-1") == ["lease-1", "lease-3", "lease-5"]
    assert await lease_ids(store, node_id="decode-1", after="lease-3") == ["lease-5"]
    assert await lease_ids(store, conversation_id="conv-4") == ["lease-4"]
    assert await lease_ids(store, node_id="decode-0", conversation_id="conv-3") == []


async def test_live_indexes_follow_lease_state(backing: Backing) -> None:
    store = await backing.leader()
    await store.put_lease(lease("lease-1"))
    await store.put_lease(lease("lease-2", state=CLAIMED))
    await store.put_lease(lease("lease-3", node_id="decode-1"))
    assert store.live_lease_ids("decode-0") == {"lease-1", "lease-2"}

    await store.put_lease(lease("lease-1", state=EXPIRED))
    assert store.live_lease_ids("decode-0") == {"lease-2"}
    assert [x.lease_id for x in await store.live_leases_of_node("decode-0")] == ["lease-2"]
    ended = await store.find_lease("decode-0", "req-lease-1")
    assert ended is not None and ended.state == EXPIRED  # ended leases are still found
    await store.delete_lease("lease-2")
    assert store.live_lease_ids("decode-0") == set()
    assert store.live_lease_ids("decode-1") == {"lease-3"}
    assert store.live_lease_ids("decode-9") == set()
    await store.commit()


# ---------------------------------------------------------------- durable backends


@DURABLE
async def test_a_reload_sees_commits_but_not_soft_puts(backing: Backing) -> None:
    store = await backing.leader()
    await store.put_node(node("decode-0"))
    await store.put_lease(lease("lease-1"))
    await store.commit()
    loaded = node("decode-0")
    loaded.load = NodeLoad(running_requests=7)
    await store.put_node(loaded, durable=False)
    await store.put_lease(lease("lease-1", state=CLAIMED), durable=False)
    await store.commit()
    claimed = await store.get_lease("lease-1")
    assert claimed is not None and claimed.state == CLAIMED  # the writer sees its soft state

    reader = await backing.reader()
    reloaded = await reader.get_lease("lease-1")
    assert reloaded is not None and reloaded.state == ACTIVE
    stored = await reader.get_node("decode-0")
    assert stored is not None and stored.load.running_requests == 0
    assert reader.live_lease_ids("decode-0") == {"lease-1"}
    assert reader.revision >= store.revision > 0


@DURABLE
async def test_the_registry_s_store_writes_nodes_and_keeps_replayed_records_soft(
    backing: Backing,
) -> None:
    """Over etcd the registry writes nodes only: leases and conversations (``REPLAYED``) are
    in the leader's cache, and a successor rebuilds them from the holders' replays."""
    assert backing.etcd is not None
    store = EtcdStore(EtcdEndpoints.parse(backing.etcd.url), backing.prefix)
    backing.stores.append(store)
    term = await election_of(store).campaign("test-leader")
    assert term is not None
    store.fence = term.revision
    await store.put_node(node("decode-0"))
    await store.put_lease(lease("lease-1"))
    await store.put_conversation(Conversation(conversation_id="conv-0"))
    await store.commit()
    assert await store.get_lease("lease-1") is not None  # the leader sees its soft state
    assert set(await etcd_revisions(backing)) == {"node/decode-0"}
    await store.delete_lease("lease-1")
    await store.delete_conversation("conv-0")
    await store.commit()
    assert set(await etcd_revisions(backing)) == {"node/decode-0"}


@DURABLE
async def test_leases_an_earlier_registry_wrote_to_etcd_are_not_loaded(backing: Backing) -> None:
    """Earlier registries wrote leases and conversations. Nobody updates those keys now, so a
    successor that loaded them would offer blocks their holder may have freed long ago: it
    passes over them, at load and in its watch, and has leases only from replays."""
    assert backing.etcd is not None
    legacy = await backing.leader()  # writes every kind, as an earlier registry did
    await legacy.put_node(node("decode-0"))
    await legacy.put_lease(lease("lease-1"))
    await legacy.put_conversation(Conversation(conversation_id="conv-0", lease_id="lease-1"))
    await legacy.commit()
    assert {"lease/lease-1", "conversation/conv-0"} <= set(await etcd_revisions(backing))
    successor = EtcdStore(EtcdEndpoints.parse(backing.etcd.url), backing.prefix)
    backing.stores.append(successor)
    await successor.load()
    assert [n.node_id for n in await successor.list_nodes()] == ["decode-0"]
    assert await successor.get_lease("lease-1") is None
    assert await successor.get_conversation("conv-0") is None
    following = asyncio.create_task(successor.follow())
    try:

        async def watching() -> bool:
            return successor.following

        await poll_until(watching, 5, "the successor's watch", every_s=0.01)
        await legacy.put_lease(lease("lease-2"))
        await legacy.put_node(node("decode-1"))
        await legacy.commit()
        assert await successor.catch_up(legacy.revision, 5)
        assert await successor.get_node("decode-1") is not None
        assert await successor.get_lease("lease-2") is None
    finally:
        following.cancel()
        await asyncio.gather(following, return_exceptions=True)


@DURABLE
async def test_a_commit_is_one_transaction(backing: Backing) -> None:
    store = await backing.leader()
    for index in range(100):
        await store.put_lease(lease(f"lease-{index:03}"))
    await store.put_conversation(Conversation(conversation_id="conv-0"))
    await store.commit()
    revisions = await etcd_revisions(backing)
    assert len(revisions) == 101
    assert set(revisions.values()) == {store.revision}


@DURABLE
async def test_commits_share_a_transaction_but_are_never_split(backing: Backing) -> None:
    """Group commit: units sealed while a write is in flight go out together when they fit in
    one transaction, and in separate ones, each whole, when they do not (128 operations)."""
    store = await backing.leader()

    async def two_units(size: int, tag: str) -> None:
        for index in range(size):
            await store.put_lease(lease(f"{tag}-a-{index:03}"))
        first = asyncio.create_task(store.commit())
        await asyncio.sleep(0)  # the first unit is sealed, its write about to start
        for index in range(size):
            await store.put_lease(lease(f"{tag}-b-{index:03}"))
        await store.commit()
        await first

    await two_units(10, "small")
    await two_units(100, "large")
    revisions = await etcd_revisions(backing)
    small = {r for key, r in revisions.items() if key.startswith("lease/small")}
    large_a = {r for key, r in revisions.items() if key.startswith("lease/large-a")}
    large_b = {r for key, r in revisions.items() if key.startswith("lease/large-b")}
    assert len(small) == len(large_a) == len(large_b) == 1
    assert large_a != large_b


@DURABLE
async def test_a_commit_beyond_one_transaction_goes_in_order_in_several(
    backing: Backing,
) -> None:
    """A unit of 130 records where etcd takes 128 a transaction: two transactions, the first
    full, the second the rest, and everything written."""
    store = await backing.leader()
    count = ETCD_DEFAULT_LIMITS.operations + 2
    for index in range(count):
        await store.put_lease(lease(f"lease-{index:03}"))
    await store.commit()
    revisions = await etcd_revisions(backing)
    assert len(revisions) == count
    first, second = sorted(set(revisions.values()))
    assert list(revisions.values()).count(first) == ETCD_DEFAULT_LIMITS.operations
    assert second == store.revision


@DURABLE
async def test_a_record_beyond_any_transaction_is_refused_and_undone(backing: Backing) -> None:
    """Nothing of its commit is written and the cache is back where etcd is: changed, new and
    deleted records alike. The record is at fault, not the leader: the store goes on writing,
    and asks its owner to rebuild what it derived from the undone records."""
    store = await backing.leader(WriteLimits(operations=128, size_bytes=4096))
    await store.put_lease(lease("lease-0"))
    await store.put_lease(lease("lease-1"))
    await store.commit()
    before = await etcd_revisions(backing)

    await store.put_lease(lease("lease-0", state=EXPIRED))
    await store.delete_lease("lease-1")
    await store.put_lease(lease("lease-2"))
    huge = lease("lease-3")
    huge.checkpoints = codec.checkpoints(block_hashes(16 * 512))  # 4 KiB of hashes
    await store.put_lease(huge)
    with pytest.raises(CommitTooLarge):
        await store.commit()
    assert await etcd_revisions(backing) == before
    assert await lease_ids(store) == ["lease-0", "lease-1"]
    assert store.live_lease_ids("decode-0") == {"lease-0", "lease-1"}
    assert await store.find_lease("decode-0", "req-lease-2") is None

    assert store.resync_due
    await store.put_lease(lease("lease-9"))
    await store.commit()
    assert set(await etcd_revisions(backing)) == {"lease/lease-0", "lease/lease-1", "lease/lease-9"}


@DURABLE
async def test_a_deposed_leaders_commit_is_refused_and_undone(backing: Backing) -> None:
    first = await backing.leader()
    assert isinstance(first, EtcdStore)
    await first.put_node(node("decode-0"))
    await first.commit()
    # The first leader's term ends (its lease expires: here, revoked) and another wins.
    assert backing.etcd is not None
    async with aetcd.Client(port=backing.etcd.client_port, timeout=5) as client:
        await client.delete(first.leader_key)
    second = await backing.leader()
    assert second.fence is not None and first.fence is not None and second.fence > first.fence

    await first.put_node(node("decode-0", state=node_pb2.NODE_STATE_DOWN))
    await first.put_node(node("decode-1"))
    with pytest.raises(Deposed):
        await first.commit()
    assert [n.spec.node_id for n in await first.list_nodes()] == ["decode-0"]
    assert set(await etcd_revisions(backing)) == {"node/decode-0"}
    await second.load()
    await second.put_node(node("decode-1"))
    await second.commit()
    assert set(await etcd_revisions(backing)) == {"node/decode-0", "node/decode-1"}


@DURABLE
async def test_a_follower_catches_up_from_its_watch(backing: Backing) -> None:
    leader = await backing.leader()
    await leader.put_node(node("decode-0"))
    await leader.put_lease(lease("lease-1"))
    await leader.commit()
    follower = backing.store()
    following = asyncio.create_task(follower.follow())
    try:

        async def watching() -> bool:
            return follower.following

        await poll_until(watching, 5, "the follower's watch", every_s=0.01)
        assert await follower.catch_up(leader.revision, 5)
        assert await lease_ids(follower) == ["lease-1"]

        await leader.put_lease(lease("lease-1", state=EXPIRED))
        await leader.put_lease(lease("lease-2"))
        await leader.delete_lease("lease-1")
        await leader.put_node(node("decode-0", state=node_pb2.NODE_STATE_DRAINING))
        await leader.commit()
        assert await follower.catch_up(leader.revision, 5)
        assert await lease_ids(follower) == ["lease-2"]
        assert follower.live_lease_ids("decode-0") == {"lease-2"}
        drained = await follower.get_node("decode-0")
        assert drained is not None and drained.state == node_pb2.NODE_STATE_DRAINING
        assert not await follower.catch_up(follower.revision + 1000, 0.2)
    finally:
        following.cancel()
        await asyncio.gather(following, return_exceptions=True)
    assert not await follower.catch_up(leader.revision, 0.1)  # nothing follows any more


async def test_raised_etcd_limits_take_a_larger_commit_in_one_transaction(
    tmp_path: Path,
) -> None:
    """The limits are the etcd deployment's: run with a higher --max-txn-ops and told so, the
    store writes a commit of 300 records as one transaction."""
    local, process = start_etcd(tmp_path / "etcd", "--max-txn-ops=1024")
    backing = Backing(local)
    try:
        store = await backing.leader(WriteLimits(operations=1024, size_bytes=1 << 20))
        for index in range(300):
            await store.put_lease(lease(f"lease-{index:03}"))
        await store.commit()
        assert set((await etcd_revisions(backing)).values()) == {store.revision}
    finally:
        for store in backing.stores:
            await store.close()
        process.terminate()
        process.wait()
