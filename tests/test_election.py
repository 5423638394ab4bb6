"""The election on a real etcd: one leader at a time, hand-over on a lost keep-alive or a
resignation, and a deposed leader's fence refusing its writes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aetcd
import pytest

from kvbroker.common.local_etcd import LocalEtcd
from kvbroker.controlplane.election import Election, Term
from kvbroker.controlplane.errors import StoreUnavailable
from kvbroker.controlplane.etcd_store import EtcdConnection, EtcdEndpoints, EtcdStore
from kvbroker.controlplane.model import Node
from kvbroker.controlplane.store import Deposed
from kvbroker.testing.factories import node_spec
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
