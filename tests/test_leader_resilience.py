"""A leader over a real etcd keeps leading through a record the store refuses (etcd's own
request limit, or the store's precheck against it), and a replica's election loop outlives
any failure in it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import aetcd
import pytest

from kvbroker.common.local_etcd import LocalEtcd
from kvbroker.controlplane.config import RegistryConfig
from kvbroker.controlplane.deadlines import DeadlineKind
from kvbroker.controlplane.errors import InvalidArgument
from kvbroker.controlplane.etcd_store import EtcdEndpoints, EtcdStore
from kvbroker.controlplane.registry import Registry
from kvbroker.controlplane.replica import Replica, ReplicaOptions
from kvbroker.controlplane.store import WriteLimits
from kvbroker.testing.factories import block_hashes, handle, node_spec
from kvbroker.v1 import lease_pb2

pytestmark = pytest.mark.etcd

CONFIG = RegistryConfig(learn_idle_ttl=False)


class SmallRequestsEtcd(LocalEtcd):
    """An etcd that takes requests of at most 64 KiB (its default is 1.5 MiB)."""

    def _argv(self, data_dir: Path) -> list[str]:
        return [*super()._argv(data_dir), "--max-request-bytes=65536"]


async def leading(replica: Replica, within_s: float = 10.0) -> Registry:
    deadline = asyncio.get_running_loop().time() + within_s
    while replica.registry is None:
        assert asyncio.get_running_loop().time() < deadline, "never led"
        await asyncio.sleep(0.05)
    return replica.registry


@pytest.fixture
async def small_etcd(tmp_path: Path) -> AsyncIterator[LocalEtcd]:
    server = SmallRequestsEtcd(tmp_path)
    await server.start()
    yield server
    await server.stop()


async def _stays_leader_through_a_refused_record(store: EtcdStore, blocks: int) -> None:
    replica = Replica(store, ReplicaOptions("127.0.0.1:1"), CONFIG)
    running = asyncio.create_task(replica.run())
    try:
        registry = await leading(replica)
        fence = store.fence
        decode = node_spec("decode-0")
        await registry.register_node(decode)

        async def grant(conversation: str, request: str, blocks: int) -> lease_pb2.Lease:
            # Block ids make the record large (prefix hashes are thinned to checkpoints).
            tokens = blocks * decode.block_size
            return await registry.grant_lease(
                conversation,
                decode.node_id,
                decode.incarnation,
                handle(request, tokens, decode),
                block_hashes(tokens),
                tokens,
            )

        first = await grant("c", "r1", 4)
        # The next turn's record is too large for the store: refused as bad input, and
        # undone (the first lease is not superseded), while this replica goes on leading.
        with pytest.raises(InvalidArgument):
            await grant("c", "r2", blocks)
        await asyncio.sleep(0.5)
        assert replica.registry is registry and store.fence == fence
        kept = await registry.get_lease(first.lease_id)
        assert kept.state == lease_pb2.LEASE_STATE_ACTIVE
        # What the registry derived from the undone records was rebuilt with the next call.
        second = await grant("d", "r3", 4)
        assert registry._deadlines.deadline((DeadlineKind.LEASE_EXPIRY, first.lease_id))
        assert registry.store.live_lease_count(decode.node_id) == 2
        assert (await registry.get_conversation("c")).lease_id == first.lease_id
        async with aetcd.Client(port=int(store.etcd.connection.endpoints.members[0][1])) as etcd:
            assert await etcd.get(store._key("lease", second.lease_id)) is not None
            assert await etcd.get(store._key("lease", first.lease_id)) is not None
    finally:
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)
        await store.close()


async def test_a_record_etcd_refuses_does_not_depose_the_leader(small_etcd: LocalEtcd) -> None:
    """etcd refuses a ~120 KB lease (its --max-request-bytes is 64 KiB here): the store tells
    that apart from being unreachable or deposed, and the leader does not step down."""
    store = EtcdStore(EtcdEndpoints.parse(small_etcd.url))
    await _stays_leader_through_a_refused_record(store, blocks=40_000)


async def test_a_record_over_the_store_s_limits_does_not_depose_the_leader(
    etcd: LocalEtcd,
) -> None:
    store = EtcdStore(
        EtcdEndpoints.parse(etcd.url), limits=WriteLimits(operations=128, size_bytes=16_384)
    )
    await _stays_leader_through_a_refused_record(store, blocks=10_000)


async def test_the_election_loop_outlives_a_failure_in_it(etcd: LocalEtcd) -> None:
    """A leader key whose address cannot be parsed made following it raise, which ended the
    election task for good; now the loop logs, starts over, and leads once it can."""
    store = EtcdStore(EtcdEndpoints.parse(etcd.url))
    replica = Replica(store, ReplicaOptions("127.0.0.1:1", election_ttl_s=2), CONFIG)
    async with aetcd.Client(port=etcd.client_port, timeout=5) as client:
        await client.put(store.leader_key, b"not an address")
        running = asyncio.create_task(replica.run())
        try:
            await asyncio.sleep(1.5)
            assert not running.done()
            await client.delete(store.leader_key)
            await leading(replica)
        finally:
            running.cancel()
            await asyncio.gather(running, return_exceptions=True)
            await store.close()
