"""Sidecar-style retention reports: ordering, duplicates, snapshots and replay after restart."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import grpc
import pytest

from kvbroker.common.client.grpc_client import RegistryEndpoint, open_channel, registry_stub
from kvbroker.common.rules.clock import to_duration
from kvbroker.controlplane.config import RegistryConfig
from kvbroker.controlplane.lessor.retention import YIELD_EVERY
from kvbroker.controlplane.server import RunningRegistry, ServerOptions, start_registry
from kvbroker.v1 import lease_pb2, node_pb2, registry_pb2
from kvbroker.v1.registry_pb2_grpc import RegistryServiceStub
from kvbroker_tools.harness.factories import block_hashes, handle, hint, node_spec, register
from tests.conftest import FAST


def retained(
    seq: int,
    spec: node_pb2.NodeSpec,
    conversation: str,
    request_id: str,
    lease: lease_pb2.Lease | None = None,
) -> registry_pb2.RetentionEvent:
    event = registry_pb2.RetentionEvent(
        sequence=seq,
        retained=registry_pb2.RetainedBlocks(
            conversation_id=conversation,
            handle=handle(request_id, 128, spec),
            block_hashes=block_hashes(128),
            token_count=128,
        ),
    )
    if lease is not None:
        event.retained.lease_id = lease.lease_id
        event.retained.epoch = lease.epoch
        event.retained.time_to_live.CopyFrom(to_duration(60))
    return event


def released(seq: int, request_id: str) -> registry_pb2.RetentionEvent:
    return registry_pb2.RetentionEvent(
        sequence=seq, released=registry_pb2.ReleasedBlocks(remote_request_id=request_id)
    )


async def report(
    stub: RegistryServiceStub,
    spec: node_pb2.NodeSpec,
    *events: registry_pb2.RetentionEvent,
    full_snapshot: bool = False,
) -> registry_pb2.ReportRetentionResponse:
    return await stub.ReportRetention(
        registry_pb2.ReportRetentionRequest(
            node_id=spec.node_id,
            incarnation=spec.incarnation,
            events=events,
            full_snapshot=full_snapshot,
        ),
        timeout=5,
    )


async def live(stub: RegistryServiceStub) -> list[lease_pb2.Lease]:
    return list((await stub.ListLeases(registry_pb2.ListLeasesRequest(), timeout=5)).leases)


async def test_ordered_batches_and_harmless_duplicates(stub: RegistryServiceStub) -> None:
    spec = node_spec("decode-0")
    await register(stub, spec)
    # Out of order within a batch: applied by sequence, so the release follows the grant.
    response = await report(
        stub,
        spec,
        released(2, "req-a"),
        retained(1, spec, "c1", "req-a"),
        retained(3, spec, "c2", "req-b"),
    )
    assert response.applied_sequence == 3
    assert [lease.conversation_id for lease in await live(stub)] == ["c2"]
    # The same batch again (a retry after a lost response) changes nothing.
    again = await report(stub, spec, retained(3, spec, "c2", "req-b"))
    assert again.leases[0].lease_id == response.leases[1].lease_id
    assert len(await live(stub)) == 1


async def test_snapshot_withdraws_what_the_engine_no_longer_holds(
    stub: RegistryServiceStub,
) -> None:
    spec = node_spec("decode-0")
    await register(stub, spec)
    first = await report(stub, spec, retained(1, spec, "c1", "r1"), retained(2, spec, "c2", "r2"))
    kept = first.leases[1]
    await report(stub, spec, retained(3, spec, "c2", "r2", kept), full_snapshot=True)
    assert [lease.lease_id for lease in await live(stub)] == [kept.lease_id]


async def test_replay_rebuilds_state_after_registry_restart() -> None:
    config = RegistryConfig(**{**FAST.__dict__, "session_ttl_s": 30.0})
    decode = node_spec("decode-0")
    prefill = node_spec("prefill-0", node_pb2.NODE_ROLE_PREFILL, port=5700)
    first = await start_registry(ServerOptions(listen="127.0.0.1:0", config=config))
    port = first.address.rpartition(":")[2]
    async with open_channel(RegistryEndpoint.parse(first.address)) as channel:
        stub = registry_stub(channel)
        await register(stub, decode)
        granted = list(
            (
                await report(
                    stub, decode, *(retained(i + 1, decode, f"c{i}", f"r{i}") for i in range(20))
                )
            ).leases
        )
        # Turn 2 of c0 supersedes its first lease: the next epoch.
        turn2 = (await report(stub, decode, retained(21, decode, "c0", "r0-turn2"))).leases[0]
        assert turn2.epoch == granted[0].epoch + 1
    await first.stop(grace=0)

    # Same address, empty memory: the sidecar re-registers and replays what the engine holds.
    second = await start_registry(ServerOptions(listen=f"127.0.0.1:{port}", config=config))
    try:
        async with open_channel(RegistryEndpoint.parse(second.address)) as channel:
            stub = registry_stub(channel)
            await register(stub, decode)
            await register(stub, prefill)
            still_held = [turn2, *granted[1:]]
            replay = [
                retained(
                    i + 1, decode, lease.conversation_id, lease.handle.remote_request_id, lease
                )
                for i, lease in enumerate(still_held)
            ]
            await report(stub, decode, *replay, full_snapshot=True)
            after = await live(stub)
            assert sorted(lease.lease_id for lease in after) == sorted(
                lease.lease_id for lease in still_held
            )
            assert {lease.lease_id: lease.epoch for lease in after}[turn2.lease_id] == turn2.epoch
            result = await hint(stub, "c0")
            assert result.decision == registry_pb2.HINT_DECISION_REUSE
            assert result.lease.lease_id == turn2.lease_id

            # A late replay of the superseded turn-1 lease is fenced by turn 2's epoch.
            stale = await report(stub, decode, retained(100, decode, "c0", "r0", granted[0]))
            assert stale.leases[0].state == lease_pb2.LEASE_STATE_REVOKED
            assert "fenced" in stale.leases[0].end_reason
            assert len(await live(stub)) == len(still_held)
    finally:
        await second.stop(grace=0)


async def test_reports_need_a_live_session(stub: RegistryServiceStub) -> None:
    spec = node_spec("decode-0")
    await register(stub, spec)
    stranger = node_spec("decode-0")  # same name, another incarnation
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await report(stub, stranger, retained(1, stranger, "c", "r"))
    assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    # A malformed event is refused on its own, in the answer: the session goes on.
    empty = registry_pb2.RetentionEvent(sequence=1)
    answer = await report(stub, spec, empty)
    assert [refused.sequence for refused in answer.refused] == [1]
    assert answer.refused[0].error.reason == registry_pb2.ERROR_REASON_INVALID_ARGUMENT
    assert "the event is neither retained" in answer.refused[0].error.message


async def test_listings_page_and_filter_without_repeats(stub: RegistryServiceStub) -> None:
    nodes = [node_spec("decode-0"), node_spec("decode-1", port=5601)]
    for spec in nodes:
        await register(stub, spec)
    for index, spec in enumerate(nodes):
        await report(
            stub, spec, *(retained(i + 1, spec, f"c{i}-{index}", f"r{i}") for i in range(25))
        )
    # A second turn of one conversation supersedes its first lease.
    await report(stub, nodes[0], retained(26, nodes[0], "c3-0", "r-next"))

    async def pages(**filters: object) -> list[lease_pb2.Lease]:
        leases: list[lease_pb2.Lease] = []
        token = ""
        while True:
            response = await stub.ListLeases(
                registry_pb2.ListLeasesRequest(page_size=7, page_token=token, **filters),  # type: ignore[arg-type]
                timeout=5,
            )
            assert len(response.leases) <= 7
            leases.extend(response.leases)
            token = response.next_page_token
            if not token:
                return leases

    everything = await pages()
    ids = [lease.lease_id for lease in everything]
    assert len(ids) == 50 and ids == sorted(set(ids))  # live only, each once, in id order
    of_node = await pages(node_id="decode-1")
    assert len(of_node) == 25 and {lease.node_id for lease in of_node} == {"decode-1"}
    current = await pages(conversation_id="c3-0")
    assert [lease.handle.remote_request_id for lease in current] == ["r-next"]
    superseded = await pages(conversation_id="c3-0", states=[lease_pb2.LEASE_STATE_REVOKED])
    assert [lease.handle.remote_request_id for lease in superseded] == ["r3"]
    assert await pages(conversation_id="c3-0", node_id="decode-1") == []


# The node sends no heartbeat: a session that outlives the replay on a loaded machine.
@pytest.mark.parametrize("registry_config", [replace(FAST, session_ttl_s=60.0)])
async def test_a_long_replay_lets_the_server_take_other_calls_meanwhile(
    registry_server: RunningRegistry, stub: RegistryServiceStub
) -> None:
    """A replay yields to the event loop as it goes (every ``YIELD_EVERY`` events). gRPC's
    server accepts a call only while the loop runs, and its core cancels a call left
    unaccepted for 30 s (``grpc.server_max_unrequested_time_in_server``): while one node's
    replay held the loop, a fleet's other replays and heartbeats ended CANCELLED. Here the
    test, on the server's loop, sees the replay part-applied, and a call it sends then is
    answered before the replay is."""
    spec = node_spec("decode-0")
    await register(stub, spec)
    events = [retained(i + 1, spec, f"c{i}", f"r{i}") for i in range(50 * YIELD_EVERY)]
    replay = asyncio.create_task(report(stub, spec, *events, full_snapshot=True))
    registry = registry_server.registry
    assert registry is not None
    applied = 0
    while not replay.done() and not 0 < applied < len(events):
        await asyncio.sleep(0)
        applied = registry.store.live_lease_count(spec.node_id)
    assert 0 < applied < len(events), "the replay ran to its end without yielding"
    nodes = await stub.ListNodes(registry_pb2.ListNodesRequest(), timeout=5)
    assert [node.spec.node_id for node in nodes.nodes] == [spec.node_id]
    assert not replay.done(), "the call waited for the whole replay"
    assert len((await replay).leases) == len(events)
