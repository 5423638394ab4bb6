"""A leader over a real etcd keeps leading through a record the store refuses (etcd's own
request limit, or the store's precheck against it), a replica's election loop outlives any
failure in it, and a successor rebuilds leases from the holders' replays, fenced by epochs
that carry the leader's term."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import aetcd
import pytest

from kvbroker.common.process.local_etcd import LocalEtcd
from kvbroker.controlplane.api import convert
from kvbroker.controlplane.config import RegistryConfig
from kvbroker.controlplane.deadlines import DeadlineKind
from kvbroker.controlplane.errors import InvalidArgument
from kvbroker.controlplane.records.answers import LeaseAnswer
from kvbroker.controlplane.records.lease_ids import TERM_SHIFT
from kvbroker.controlplane.records.requests import LeaseGrant, RetentionReport
from kvbroker.controlplane.registry import Registry
from kvbroker.controlplane.replication.replica import Replica, ReplicaOptions
from kvbroker.controlplane.storage.etcd_store import EtcdEndpoints, EtcdStore
from kvbroker.controlplane.storage.store import WriteLimits
from kvbroker.v1 import lease_pb2, node_pb2
from kvbroker_tools.harness.factories import block_hashes, handle, node_spec, replayed
from tests.conftest import eventually

pytestmark = pytest.mark.etcd

CONFIG = RegistryConfig(learn_idle_ttl=False)


class SmallRequestsEtcd(LocalEtcd):
    """An etcd that takes requests of at most 64 KiB (its default is 1.5 MiB)."""

    def _argv(self, data_dir: Path) -> list[str]:
        return [*super()._argv(data_dir), "--max-request-bytes=65536"]


async def leading(replica: Replica) -> Registry:
    registry = await eventually(lambda: replica.registry, what="leading")
    assert registry is not None
    return registry


@pytest.fixture
async def small_etcd(tmp_path: Path) -> AsyncIterator[LocalEtcd]:
    server = SmallRequestsEtcd(tmp_path)
    await server.start()
    yield server
    await server.stop()


async def _stays_leader_through_a_refused_record(store: EtcdStore, blocks: int) -> None:
    """``store`` writes leases (``soft`` empty): the registry's own writes only nodes, which are
    never this large, so a large lease is what makes a record etcd refuses."""
    replica = Replica(store, ReplicaOptions("127.0.0.1:1"), CONFIG)
    running = asyncio.create_task(replica.run())
    try:
        registry = await leading(replica)
        fence = store.fence
        decode = node_spec("decode-0")
        await registry.register_node(decode)

        async def grant(conversation: str, request: str, blocks: int) -> LeaseAnswer:
            # Block ids make the record large (prefix hashes are thinned to checkpoints).
            tokens = blocks * decode.block_size
            return await registry.grant_lease(
                LeaseGrant(
                    conversation,
                    decode.node_id,
                    decode.incarnation,
                    handle(request, tokens, decode),
                    block_hashes(tokens),
                    tokens,
                )
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
    store = EtcdStore(EtcdEndpoints.parse(small_etcd.url), soft=frozenset())
    await _stays_leader_through_a_refused_record(store, blocks=40_000)


async def test_a_record_over_the_store_s_limits_does_not_depose_the_leader(
    etcd: LocalEtcd,
) -> None:
    store = EtcdStore(
        EtcdEndpoints.parse(etcd.url),
        limits=WriteLimits(operations=128, size_bytes=16_384),
        soft=frozenset(),
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
            # The loop met the key: following it is what failed.
            await eventually(lambda: replica.leader_address == "not an address")
            assert not running.done()
            await client.delete(store.leader_key)
            await leading(replica)
        finally:
            running.cancel()
            await asyncio.gather(running, return_exceptions=True)
            await store.close()


async def test_a_takeover_rebuilds_leases_from_replays_and_fences_older_epochs(
    etcd: LocalEtcd,
) -> None:
    """Leases are not in etcd: the successor knows the nodes only, and the holders' replays
    bring the leases back under their ids and epochs. A replay older than its conversation's
    epoch is fenced, and the successor's first grant outranks every epoch granted before."""
    decodes = [node_spec("decode-0"), node_spec("decode-1", port=5601)]
    stores = [EtcdStore(EtcdEndpoints.parse(etcd.url)) for _ in range(2)]
    replicas = [
        Replica(store, ReplicaOptions(f"127.0.0.1:{1 + i}"), CONFIG)
        for i, store in enumerate(stores)
    ]

    async def grant(registry: Registry, spec: node_pb2.NodeSpec, request: str) -> LeaseAnswer:
        tokens = 4 * spec.block_size
        return await registry.grant_lease(
            LeaseGrant(
                "c",
                spec.node_id,
                spec.incarnation,
                handle(request, tokens, spec),
                block_hashes(tokens),
                tokens,
            )
        )

    async def replay(registry: Registry, spec: node_pb2.NodeSpec, lease: LeaseAnswer) -> int:
        event = replayed(convert.lease_message(lease))
        answer = await registry.report_retention(
            RetentionReport(spec.node_id, spec.incarnation, [event], full_snapshot=True)
        )
        return answer.leases[0].state

    first = asyncio.create_task(replicas[0].run())
    second: asyncio.Task[None] | None = None
    try:
        old_leader = await leading(replicas[0])
        for spec in decodes:
            await old_leader.register_node(spec)
        older = await grant(old_leader, decodes[0], "r1")
        # The conversation's next turn went to decode-1 (only a node a turn was routed to may
        # lease it), whose retention supersedes ``older``.
        old_leader.turns.started("c", old_leader.nodes.runtime["decode-1"], None)
        newer = await grant(old_leader, decodes[1], "r2")
        assert stores[0].fence is not None
        old_term = stores[0].fence

        second = asyncio.create_task(replicas[1].run())
        await eventually(lambda: replicas[1].leader_address == replicas[0].options.advertise)
        first.cancel()  # steps down and resigns: the follower takes over
        await asyncio.gather(first, return_exceptions=True)
        successor = await leading(replicas[1])
        assert stores[1].fence is not None and stores[1].fence > old_term
        assert await successor.store.get_lease(newer.lease_id) is None  # nothing in etcd
        assert len(await successor.list_nodes()) == 2

        awaiting = replicas[1].metrics.registry.get_sample_value
        assert awaiting("kvbroker_nodes_awaiting_replay") == 2

        assert await replay(successor, decodes[1], newer) == lease_pb2.LEASE_STATE_ACTIVE
        assert awaiting("kvbroker_nodes_awaiting_replay") == 1
        assert await replay(successor, decodes[0], older) == lease_pb2.LEASE_STATE_REVOKED
        assert awaiting("kvbroker_nodes_awaiting_replay") == 0
        conversation = await successor.get_conversation("c")
        assert (conversation.lease_id, conversation.epoch) == (newer.lease_id, newer.epoch)

        successor.turns.started("c", successor.nodes.runtime["decode-0"], None)
        latest = await grant(successor, decodes[0], "r3")
        assert latest.epoch >= stores[1].fence << TERM_SHIFT > newer.epoch > older.epoch
        superseded = await successor.get_lease(newer.lease_id)
        assert superseded.end_cause == lease_pb2.LEASE_END_CAUSE_SUPERSEDED
    finally:
        for task in (first, second):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        for store in stores:
            await store.close()
