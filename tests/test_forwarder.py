"""A follower relays each call to the leader whole (``controlplane/api/forwarder.py``). Over
real gRPC on loopback, a follower's server (``tests.registry_doubles``) passes on the request
as its caller sent it, fields it never names included, and answers with the leader's response
as the leader sent it; it passes on what only the leader knows (its heartbeat pace), relays
the leader's typed errors, counts each outcome, and without a leader answers hints from its
cache and fails every other call with NO_LEADER."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc
import pytest

from kvbroker.common.client.grpc_client import (
    RegistryCallError,
    RegistryEndpoint,
    from_grpc_error,
    open_channel,
    registry_stub,
)
from kvbroker.common.rules.clock import from_duration, to_timestamp
from kvbroker.controlplane.api.forwarder import Forwarder
from kvbroker.controlplane.api.interface import Standalone
from kvbroker.controlplane.config import RegistryConfig
from kvbroker.controlplane.errors import NoLeader
from kvbroker.controlplane.records.model import NodeLoad
from kvbroker.controlplane.records.requests import Heartbeat
from kvbroker.controlplane.registry import Registry
from kvbroker.controlplane.server import SERVICE_NAME, RunningRegistry
from kvbroker.controlplane.storage.cached_store import MemoryStore
from kvbroker.v1 import lease_pb2, node_pb2, registry_pb2, registry_pb2_grpc
from kvbroker.v1.registry_pb2_grpc import RegistryServiceStub
from kvbroker_tools.harness.factories import block_hashes, handle, node_spec, register
from tests.registry_doubles import Following, serve

# A pace unlike the defaults, so that a follower passing on its own would show.
PACED = RegistryConfig(heartbeat_interval_s=0.7, session_ttl_s=4.5)
# Field 1000, varint 42: no field of any request of this schema.
UNKNOWN_FIELD = b"\xc0\x3e\x2a"


@pytest.fixture
def registry_config() -> RegistryConfig:
    return PACED


@pytest.fixture
async def follower(
    registry_server: RunningRegistry, stub: RegistryServiceStub
) -> AsyncIterator[tuple[Following, RegistryServiceStub]]:
    """A follower of the leader ``stub`` calls, and a client of the follower."""
    following = Following(stub)
    async with serve(following) as address, open_channel(RegistryEndpoint.parse(address)) as ch:
        yield following, registry_stub(ch)


async def failure(call: Awaitable[object]) -> RegistryCallError:
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await call
    return from_grpc_error(error.value)


def grant_request(spec: node_pb2.NodeSpec, conversation: str) -> registry_pb2.GrantLeaseRequest:
    return registry_pb2.GrantLeaseRequest(
        conversation_id=conversation,
        node_id=spec.node_id,
        node_incarnation=spec.incarnation,
        handle=handle("r", 64, spec),
        block_hashes=block_hashes(64),
        token_count=64,
        block_hash_stride=2,
    )


class Recorder(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """The bytes of each unary call as the server received them and answered them."""

    def __init__(self) -> None:
        self.received: dict[str, bytes] = {}
        self.answered: dict[str, bytes] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or handler.unary_unary is None:
            return handler
        method = details.method.rpartition("/")[2]
        behavior, serialize = handler.unary_unary, handler.response_serializer

        async def recording(raw: bytes, context: grpc.aio.ServicerContext) -> object:
            self.received[method] = raw  # the registry decodes requests itself: these are bytes
            response = await behavior(raw, context)
            self.answered[method] = serialize(response)
            return response

        return grpc.unary_unary_rpc_method_handler(recording, response_serializer=serialize)


async def test_a_follower_relays_a_call_whole() -> None:
    """The leader receives the bytes the caller sent the follower, a field no schema of
    this replica has included, and the caller receives the bytes the leader answered."""
    leader = Registry(MemoryStore(), PACED)
    recorder = Recorder()
    async with (
        serve(Standalone(leader), recorder) as leader_address,
        open_channel(RegistryEndpoint.parse(leader_address)) as to_leader,
    ):
        following = Following(registry_stub(to_leader))
        async with (
            serve(following) as follower_address,
            open_channel(RegistryEndpoint.parse(follower_address)) as to_follower,
        ):
            spec = node_spec("decode-0")
            await register(registry_stub(to_follower), spec)
            sent = grant_request(spec, "c").SerializeToString() + UNKNOWN_FIELD
            grant = to_follower.unary_unary(f"/{SERVICE_NAME}/GrantLease")

            answer = await grant(sent, timeout=5)

    assert recorder.received["GrantLease"] == sent
    assert answer == recorder.answered["GrantLease"]
    lease = registry_pb2.GrantLeaseResponse.FromString(answer).lease
    held = await leader.get_lease(lease.lease_id)
    assert (held.conversation_id, held.epoch) == ("c", lease.epoch)
    assert following.forwarded("ok") == 2


async def test_a_follower_answers_as_the_leader(
    follower: tuple[Following, RegistryServiceStub], stub: RegistryServiceStub
) -> None:
    following, via_follower = follower
    spec = node_spec("decode-0")

    registration = await via_follower.RegisterNode(
        registry_pb2.RegisterNodeRequest(spec=spec), timeout=5
    )
    granted = (await via_follower.GrantLease(grant_request(spec, "c"), timeout=5)).lease

    pace = (from_duration(registration.heartbeat_interval), from_duration(registration.session_ttl))
    assert pace == (0.7, 4.5)
    node = registry_pb2.GetNodeRequest(node_id=spec.node_id)
    assert await via_follower.GetNode(node) == await stub.GetNode(node)
    conversation = registry_pb2.GetConversationRequest(conversation_id="c")
    assert await via_follower.GetConversation(conversation) == await stub.GetConversation(
        conversation
    )
    listed = await via_follower.ListLeases(registry_pb2.ListLeasesRequest(node_id=spec.node_id))
    assert [lease.lease_id for lease in listed.leases] == [granted.lease_id]
    renewed = await via_follower.RenewLease(registry_pb2.RenewLeaseRequest(conversation_id="c"))
    revoked = await via_follower.RevokeLease(
        registry_pb2.RevokeLeaseRequest(lease_id=granted.lease_id, reason="closed")
    )
    assert renewed.lease.lease_id == revoked.lease.lease_id == granted.lease_id
    assert revoked.lease.state == lease_pb2.LEASE_STATE_REVOKED
    assert following.forwarded("ok") == 7


async def test_a_follower_relays_the_leaders_typed_error(
    follower: tuple[Following, RegistryServiceStub],
) -> None:
    following, via_follower = follower
    beat = registry_pb2.HeartbeatRequest(node_id="nobody", incarnation="x")

    error = await failure(via_follower.Heartbeat(beat, timeout=5))

    assert error.code() == grpc.StatusCode.NOT_FOUND
    assert error.reason == registry_pb2.ERROR_REASON_NODE_NOT_REGISTERED
    assert following.forwarded("relayed_error") == 1


async def test_without_a_leader_hints_come_from_the_cache_and_the_rest_fail() -> None:
    # The nodes a follower's etcd cache would hold: a ready decode and prefill node.
    cache = Registry(MemoryStore())
    for spec in (node_spec("decode-0"), node_spec("prefill-0", node_pb2.NODE_ROLE_PREFILL, 5700)):
        await cache.register_node(spec)
        await cache.heartbeat(Heartbeat(spec.node_id, spec.incarnation, True, NodeLoad()))
    following = Following(leader=None, cache=cache.store)
    async with (
        serve(following) as address,
        open_channel(RegistryEndpoint.parse(address)) as channel,
    ):
        via_follower = registry_stub(channel)
        asked = registry_pb2.GetRoutingHintRequest(conversation_id="c")

        hint = (await via_follower.GetRoutingHint(asked, timeout=5)).hint
        batch = await via_follower.BatchGetRoutingHints(
            registry_pb2.BatchGetRoutingHintsRequest(requests=[asked]), timeout=5
        )
        refused = await failure(
            via_follower.GetNode(registry_pb2.GetNodeRequest(node_id="decode-0"), timeout=5)
        )

    assert hint.consistency == registry_pb2.HINT_CONSISTENCY_DEGRADED
    assert (hint.decode.node_id, hint.prefill.node_id) == ("decode-0", "prefill-0")
    assert batch.results[0].hint.consistency == registry_pb2.HINT_CONSISTENCY_DEGRADED
    assert len(following.cache_asked) == 2
    assert refused.code() == grpc.StatusCode.UNAVAILABLE
    assert refused.reason == registry_pb2.ERROR_REASON_NO_LEADER
    assert following.forwarded("no_leader") == 3


async def test_a_follower_passes_on_a_nodes_work_and_costs(
    follower: tuple[Following, RegistryServiceStub], stub: RegistryServiceStub
) -> None:
    _, via_follower = follower
    spec = node_spec("prefill-0", node_pb2.NODE_ROLE_PREFILL)
    await register(via_follower, spec)
    profile = node_pb2.CostProfile(
        prefill_fixed_ms=5.0, prefill_us_per_token=50.0, calibrated_time=to_timestamp(1.0)
    )

    calibrated = await via_follower.SetCostProfile(
        registry_pb2.SetCostProfileRequest(node_id=spec.node_id, cost=profile), timeout=5
    )
    # Four prefills of 400 tokens, each far slower than the profile predicts.
    beat = await via_follower.Heartbeat(
        registry_pb2.HeartbeatRequest(
            node_id=spec.node_id,
            incarnation=spec.incarnation,
            engine_ready=True,
            load=node_pb2.NodeLoad(running_requests=1, waiting_requests=2, kv_cache_usage=0.5),
            work=node_pb2.EngineWork(prefills=4, prefill_computed_tokens=1600, prefill_seconds=4.0),
        ),
        timeout=5,
    )

    assert calibrated.node.cost == profile
    assert beat.node.load.kv_cache_usage == 0.5
    assert beat.node.cost_correction.prefill > 1.0
    assert beat.node == (await stub.GetNode(registry_pb2.GetNodeRequest(node_id=spec.node_id))).node


async def test_a_follower_relays_the_leaders_command_stream(
    follower: tuple[Following, RegistryServiceStub], stub: RegistryServiceStub
) -> None:
    following, via_follower = follower
    spec = node_spec("decode-0")
    await register(stub, spec)
    granted = (await stub.GrantLease(grant_request(spec, "c"), timeout=5)).lease
    watch = registry_pb2.WatchLeaseCommandsRequest(node_id="decode-0", incarnation=spec.incarnation)
    stream = via_follower.WatchLeaseCommands(watch)
    try:
        renew = registry_pb2.RenewLeaseRequest(lease_id=granted.lease_id)
        renew.time_to_live.FromSeconds(90)
        await stub.RenewLease(renew, timeout=5)  # at the leader: it commands the holder
        command = (await asyncio.wait_for(stream.read(), 5)).command
    finally:
        stream.cancel()
    assert (command.lease_id, command.remote_request_id) == (granted.lease_id, "r")

    following.leader = None  # the election is pending
    refused = await failure(via_follower.WatchLeaseCommands(watch).read())
    assert refused.reason == registry_pb2.ERROR_REASON_NO_LEADER


class _Stalled(registry_pb2_grpc.RegistryServiceServicer):
    """A leader whose heartbeat never answers: the call is in flight when its channel closes."""

    def __init__(self) -> None:
        self.entered = asyncio.Event()

    async def Heartbeat(
        self, request: registry_pb2.HeartbeatRequest, context: grpc.aio.ServicerContext
    ) -> registry_pb2.HeartbeatResponse:
        self.entered.set()
        await asyncio.Event().wait()
        raise AssertionError("unreachable")


async def test_a_call_cut_off_by_a_change_of_leader_fails_as_no_leader() -> None:
    """A follower closes its channel to the leader when the leader it follows changes; grpc.aio
    then ends the calls in flight on it with a bare ``CancelledError``. That is a failed call
    (NO_LEADER, retried by the caller), never the server's CANCELLED."""
    leader = _Stalled()
    server = grpc.aio.server()
    registry_pb2_grpc.add_RegistryServiceServicer_to_server(leader, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        channel = open_channel(RegistryEndpoint.parse(f"127.0.0.1:{port}"))
        following = Following(registry_pb2_grpc.RegistryServiceStub(channel))
        beat = registry_pb2.HeartbeatRequest(node_id="decode-0", incarnation="x")
        call = asyncio.create_task(Forwarder(following, 5.0).relay("Heartbeat", beat))
        await asyncio.wait_for(leader.entered.wait(), 10)

        await channel.close()

        with pytest.raises(NoLeader):
            await asyncio.wait_for(call, 10)
        assert following.forwarded("leader_changed") == 1
    finally:
        await server.stop(None)
