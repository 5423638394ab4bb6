"""The election on a real etcd: one leader at a time, hand-over on a lost keep-alive or a
resignation, and a deposed leader's fence refusing its writes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aetcd
import pytest

from kvbroker.common.process.local_etcd import LocalEtcd
from kvbroker.controlplane.errors import StoreUnavailable
from kvbroker.controlplane.records.model import Node
from kvbroker.controlplane.replication.election import Election, Term
from kvbroker.controlplane.storage.etcd_store import EtcdConnection, EtcdEndpoints, EtcdStore
from kvbroker.controlplane.storage.state_cache import StateCache
from kvbroker.controlplane.storage.store import Deposed
from kvbroker_tools.harness.factories import node_spec
from tests.conftest import eventually

pytestmark = pytest.mark.etcd

KEY = b"/kvbroker/leader"
TTL_S = 2


@pytest.fixture
async def candidates(etcd: LocalEtcd) -> AsyncIterator[list[Election]]:
    connections = [EtcdConnection(EtcdEndpoints.parse(etcd.url)) for _ in range(2)]
    yield [Election(connection, KEY, TTL_S) for connection in connections]
    for connection in connections:
        await connection.close()


async def win_within(election: Election, value: str, within_s: float) -> Term:
    # Each campaign grants (and, lost, revokes) an etcd lease: not too often.
    term = await eventually(lambda: election.campaign(value), within_s, "a won campaign", 0.1)
    assert term is not None
    return term


async def test_of_two_candidates_one_leads(candidates: list[Election]) -> None:
    first, second = candidates
    assert await first.observe() is None
    won, lost = await asyncio.gather(first.campaign("a:1"), second.campaign("b:1"))
    assert (won is None) != (lost is None)
    leader = "a:1" if won is not None else "b:1"
    assert await first.observe() == await second.observe() == leader
    # While the term is kept, nobody else wins.
    assert await first.campaign("a:1") is None and await second.campaign("b:1") is None


async def test_a_lost_keep_alive_hands_over(candidates: list[Election], etcd: LocalEtcd) -> None:
    """A leader whose lease is gone stops (keep_alive returns) and the other candidate wins
    with a later revision: the new fence."""
    first, second = candidates
    term = await first.campaign("a:1")
    assert term is not None
    keeping = asyncio.create_task(first.keep_alive(term, asyncio.Event()))
    await asyncio.sleep(TTL_S)  # the term's TTL passes: what keep_alive is for
    assert not keeping.done()  # kept: nobody else wins meanwhile
    assert await second.campaign("b:1") is None

    async with aetcd.Client(port=etcd.client_port, timeout=5) as client:
        await client.revoke_lease(term.lease_id)  # as etcd does when the TTL runs out
    await asyncio.wait_for(keeping, TTL_S)
    successor = await win_within(second, "b:1", TTL_S)
    assert successor.revision > term.revision
    assert await first.observe() == "b:1"


async def test_an_unrefreshed_term_expires_and_hands_over(candidates: list[Election]) -> None:
    first, second = candidates
    term = await first.campaign("a:1")
    assert term is not None
    successor = await win_within(second, "b:1", 4 * TTL_S)
    assert successor.revision > term.revision


async def test_a_resignation_hands_over_at_once(candidates: list[Election]) -> None:
    first, second = candidates
    term = await first.campaign("a:1")
    assert term is not None
    stop = asyncio.Event()
    keeping = asyncio.create_task(first.keep_alive(term, stop))
    stop.set()
    await asyncio.wait_for(keeping, TTL_S)
    await first.resign(term)
    assert await second.observe() is None
    assert await second.campaign("b:1") is not None


async def test_a_deposed_leaders_fence_refuses_its_writes(etcd: LocalEtcd) -> None:
    stores = [EtcdStore(EtcdEndpoints.parse(etcd.url)) for _ in range(2)]
    first, second = (Election(s.connection, s.leader_key, TTL_S) for s in stores)
    try:
        term = await first.campaign("a:1")
        assert term is not None
        stores[0].fence = term.revision
        await stores[0].put_node(Node(spec=node_spec("decode-0")))
        await stores[0].commit()

        await first.resign(term)
        successor = await second.campaign("b:1")
        assert successor is not None
        stores[1].fence = successor.revision
        await stores[0].put_node(Node(spec=node_spec("decode-1")))
        with pytest.raises(Deposed):
            await stores[0].commit()

        await stores[1].load()
        await stores[1].put_node(Node(spec=node_spec("decode-1")))
        await stores[1].commit()
        reader = EtcdStore(EtcdEndpoints.parse(etcd.url))
        stores.append(reader)
        await reader.load()
        assert [n.spec.node_id for n in await reader.list_nodes()] == ["decode-0", "decode-1"]
    finally:
        for store in stores:
            await store.close()


async def test_a_call_cut_off_by_another_s_reconnect_is_a_store_failure(etcd: LocalEtcd) -> None:
    """The store and the election share one etcd client. While etcd hangs, a store call that
    times out reconnects, which closes the client under the election's call: grpc.aio ends
    that call with CancelledError, which ended the replica's election loop for good. It is a
    failed call like any other (StoreUnavailable); only the task's own cancellation ends it."""
    connection = EtcdConnection(EtcdEndpoints.parse(etcd.url))
    election = Election(connection, KEY, TTL_S)
    await election.observe()  # connected
    await etcd.hang()
    try:
        observing = asyncio.create_task(election.observe())
        await asyncio.sleep(0.2)  # the call is in flight (etcd answers nothing now)
        assert not observing.done()
        await connection.reconnect()  # as the store's timed-out call does
        with pytest.raises(StoreUnavailable, match="cut off"):
            await asyncio.wait_for(observing, 1)

        cancelled = asyncio.create_task(election.observe())
        await asyncio.sleep(0.2)
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
    finally:
        etcd.resume()
        await connection.close()


async def test_store_calls_cut_off_by_the_election_s_reconnect_are_store_failures(
    etcd: LocalEtcd,
) -> None:
    """While etcd hangs, the leader's keep-alive times out and reconnects the client it shares
    with the store, closing it under the store's write, load and watch in flight. A write cut
    off so has an unknown outcome: it is a StoreUnavailable (not a CancelledError out of the
    commit), and the store takes no write until a reload. A cut-off watch breaks as one too,
    rather than end as if etcd had nothing more to say."""
    store = EtcdStore(EtcdEndpoints.parse(etcd.url), timeout_s=10)
    election = Election(store.connection, store.leader_key, TTL_S)
    try:
        term = await election.campaign("a:1")
        assert term is not None
        store.fence = term.revision
        await store.load()
        seen: list[str] = []

        async def watch() -> None:
            async for event in store.etcd.watch(store.revision):
                if event.change is not None:
                    seen.append(event.change.ident)

        watching = asyncio.create_task(watch())
        await store.put_node(Node(spec=node_spec("decode-0")))
        await store.commit()
        await eventually(lambda: seen == ["decode-0"], what="the watch under way")
        await etcd.hang()
        try:
            await store.put_node(Node(spec=node_spec("decode-1")))
            committing = asyncio.create_task(store.commit())
            loading = asyncio.create_task(store.etcd.load(StateCache()))
            # Its refresh times out (a quarter of the TTL) and reconnects; without a refresh
            # for half the TTL it returns.
            await asyncio.wait_for(election.keep_alive(term, asyncio.Event()), TTL_S)
            for call in (committing, loading, watching):
                with pytest.raises(StoreUnavailable):
                    await asyncio.wait_for(call, 1)
        finally:
            etcd.resume()
        await store.put_node(Node(spec=node_spec("decode-2")))
        with pytest.raises(StoreUnavailable):
            await store.commit()  # not before a reload
        await store.load()
        await store.put_node(Node(spec=node_spec("decode-2")))
        await store.commit()
    finally:
        await store.close()


async def test_a_store_call_cancelled_on_purpose_ends_cancelled(etcd: LocalEtcd) -> None:
    """A replica cancels its follower's watch when it becomes the leader, and a session's
    calls when it ends: those stay cancellations, never store failures."""
    store = EtcdStore(EtcdEndpoints.parse(etcd.url), timeout_s=10)
    try:
        following = asyncio.create_task(store.follow())
        await eventually(lambda: store.following, what="the watch under way")
        following.cancel()
        with pytest.raises(asyncio.CancelledError):
            await following

        await etcd.hang()
        try:
            loading = asyncio.create_task(store.load())
            done, _ = await asyncio.wait({loading}, timeout=0.2)
            assert not done  # in flight: etcd answers nothing now
            loading.cancel()
            with pytest.raises(asyncio.CancelledError):
                await loading
        finally:
            etcd.resume()
    finally:
        await store.close()
