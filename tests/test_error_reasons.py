"""Error reasons round trip through real gRPC servers on loopback: raised as types in the
registry, carried with the status, relayed by a follower, read back by the one client-side
function, and decided on by the router."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbroker.common.client.grpc_client import (
    RegistryCallError,
    RegistryEndpoint,
    from_grpc_error,
    open_channel,
    registry_stub,
)
from kvbroker.common.client.hint_batcher import HintBatcher
from kvbroker.common.process.tasks import poll_until
from kvbroker.controlplane.config import RegistryConfig
from kvbroker.controlplane.server import RunningRegistry
from kvbroker.router.config import RouterConfig
from kvbroker.router.proxy import Router
from kvbroker.v1 import lease_pb2, node_pb2, registry_pb2
from kvbroker.v1.registry_pb2_grpc import RegistryServiceStub
from kvbroker_tools.harness.factories import Heartbeats, grant, hint, node_spec, register
from tests.conftest import eventually
from tests.registry_doubles import Following, serve

PREFILL = node_pb2.NODE_ROLE_PREFILL


async def failure(call: object) -> RegistryCallError:
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await call  # type: ignore[misc]
    return from_grpc_error(error.value)


async def test_unary_errors_carry_their_reason(stub: RegistryServiceStub) -> None:
    unknown = await failure(
        stub.Heartbeat(registry_pb2.HeartbeatRequest(node_id="nope", incarnation="i"), timeout=5)
    )
    assert unknown.code() == grpc.StatusCode.NOT_FOUND
    assert unknown.reason == registry_pb2.ERROR_REASON_NODE_NOT_REGISTERED
    assert "nope" in unknown.message

    spec = node_spec("decode-0")
    await register(stub, spec)
    await stub.DeregisterNode(
        registry_pb2.DeregisterNodeRequest(node_id="decode-0", incarnation=spec.incarnation)
    )
    replaced = node_spec("decode-0")  # a new incarnation of the same node, once it is gone
    await register(stub, replaced)
    lost = await failure(
        stub.Heartbeat(
            registry_pb2.HeartbeatRequest(node_id="decode-0", incarnation=spec.incarnation),
            timeout=5,
        )
    )
    assert lost.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert lost.reason == registry_pb2.ERROR_REASON_SESSION_LOST

    no_route = await failure(hint(stub, "c"))
    assert no_route.code() == grpc.StatusCode.UNAVAILABLE
    assert no_route.reason == registry_pb2.ERROR_REASON_NO_READY_NODE
    assert no_route.message == "no ready prefill node serves any model"


async def test_a_live_session_of_a_node_is_not_replaced_by_another_incarnation(
    stub: RegistryServiceStub, registry_config: RegistryConfig
) -> None:
    """Two sidecars with one node id withdrew each other's leases at every registration. While
    a session is live, another incarnation is refused (ALREADY_EXISTS, saying why and what to
    do); once it ends, deregistered or silent past the session TTL, the other registers."""
    first = node_spec("decode-0")
    async with Heartbeats(stub, first):
        lease = await grant(stub, first, "conv-1", "req-1")
        rival = node_spec("decode-0")
        refused = await failure(register(stub, rival))
        assert refused.code() == grpc.StatusCode.ALREADY_EXISTS
        assert "'decode-0' is already registered by a live session" in refused.message
        assert "started at" in refused.message and "stop the other sidecar" in refused.message
        assert first.incarnation not in refused.message
        # The live session is untouched: its node, its incarnation, its lease.
        node = (await stub.GetNode(registry_pb2.GetNodeRequest(node_id="decode-0"))).node
        assert node.spec.incarnation == first.incarnation
        assert node.state == node_pb2.NODE_STATE_READY
        got = await stub.GetLease(registry_pb2.GetLeaseRequest(lease_id=lease.lease_id))
        assert got.lease.state == lease_pb2.LEASE_STATE_ACTIVE
        # Its own incarnation registering again is no rival.
        await register(stub, first)
    # Heartbeats stopped (a crash): refused until the session lapses, then registered.
    started = asyncio.get_running_loop().time()

    async def registered() -> bool:
        try:
            await register(stub, rival)
        except grpc.aio.AioRpcError as error:
            assert from_grpc_error(error).code() == grpc.StatusCode.ALREADY_EXISTS
            return False
        return True

    await poll_until(registered, 10, "the rival's registration", every_s=0.05, retrying=())
    waited = asyncio.get_running_loop().time() - started
    assert waited >= registry_config.session_ttl_s * 0.5, waited
    node = (await stub.GetNode(registry_pb2.GetNodeRequest(node_id="decode-0"))).node
    assert node.spec.incarnation == rival.incarnation


async def test_refused_hints_of_a_batch_carry_their_reason(stub: RegistryServiceStub) -> None:
    batcher = HintBatcher(stub, timeout_s=5)
    async with Heartbeats(stub, node_spec("decode-0"), node_spec("prefill-0", PREFILL, port=5700)):
        with pytest.raises(RegistryCallError) as too_long:
            await batcher.hint(registry_pb2.GetRoutingHintRequest(conversation_id="x" * 300))
        with pytest.raises(RegistryCallError) as no_model:
            await batcher.hint(registry_pb2.GetRoutingHintRequest(model="other-model"))
    assert too_long.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert too_long.value.reason == registry_pb2.ERROR_REASON_INVALID_ARGUMENT
    assert no_model.value.reason == registry_pb2.ERROR_REASON_NO_READY_NODE
    assert "'other-model'" in no_model.value.message


async def test_a_transport_failure_has_no_reason() -> None:
    async with open_channel(RegistryEndpoint.parse("127.0.0.1:1")) as channel:
        batcher = HintBatcher(registry_stub(channel), timeout_s=1)
        with pytest.raises(RegistryCallError) as error:
            await batcher.hint(registry_pb2.GetRoutingHintRequest())
    assert error.value.code() == grpc.StatusCode.UNAVAILABLE
    assert error.value.reason == registry_pb2.ERROR_REASON_UNSPECIFIED


@pytest.fixture
async def follower(
    registry_server: RunningRegistry, stub: RegistryServiceStub
) -> AsyncIterator[tuple[Following, str]]:
    replica = Following(stub)
    async with serve(replica) as address:
        yield replica, address


async def test_a_follower_relays_the_leader_s_reason_and_gives_its_own(
    follower: tuple[Following, str], stub: RegistryServiceStub
) -> None:
    replica, address = follower
    async with open_channel(RegistryEndpoint.parse(address)) as channel:
        via_follower = registry_stub(channel)
        await register(stub, node_spec("decode-0"))
        # The leader's word: nowhere to route. Relayed, not answered from the cache.
        relayed = await failure(hint(via_follower, "c"))
        assert relayed.reason == registry_pb2.ERROR_REASON_NO_READY_NODE
        lost = await failure(
            via_follower.Heartbeat(
                registry_pb2.HeartbeatRequest(node_id="decode-0", incarnation="old"), timeout=5
            )
        )
        assert lost.reason == registry_pb2.ERROR_REASON_SESSION_LOST

        replica.leader = None  # the election is pending
        leaderless = await failure(hint(via_follower, "c"))
        assert leaderless.code() == grpc.StatusCode.UNAVAILABLE
        assert leaderless.reason == registry_pb2.ERROR_REASON_NO_LEADER
        refused = await failure(
            via_follower.GetNode(registry_pb2.GetNodeRequest(node_id="decode-0"), timeout=5)
        )
        assert refused.reason == registry_pb2.ERROR_REASON_NO_LEADER


async def test_the_router_falls_back_only_when_no_leader_answers(
    follower: tuple[Following, str], stub: RegistryServiceStub
) -> None:
    replica, address = follower
    # One hint per plan (no waiting for a ready node) and a generous hint deadline: the
    # outcome must follow from the reason alone. With the defaults a plan made ~30 round trips
    # under a 0.5 s deadline, and one slow trip on a loaded machine was served as a fallback.
    config = RouterConfig(node_refresh_s=3600, ready_node_wait_s=0, hint_timeout_s=10)
    router = Router(RegistryEndpoint.parse(address), config)
    await register(stub, node_spec("decode-0"))
    await router.start()
    try:
        # The router's first (and, here, only) node refresh, before its list is replaced.
        await eventually(lambda: [n.spec.node_id for n in router.known_nodes] == ["decode-0"])
        router.known_nodes = [
            node_pb2.Node(spec=node_spec("decode-1"), state=node_pb2.NODE_STATE_READY),
            node_pb2.Node(
                spec=node_spec("prefill-1", PREFILL, port=5701), state=node_pb2.NODE_STATE_READY
            ),
        ]
        with pytest.raises(RegistryCallError) as error:
            await router.plan("c", "")  # the leader says no prefill node is ready
        assert error.value.reason == registry_pb2.ERROR_REASON_NO_READY_NODE

        replica.leader = None
        plan = await router.plan("c", "")  # no leader: plain P/D from the router's list
        assert (plan.prefill.node_id, plan.decode.node_id) == ("prefill-1", "decode-1")
        assert (plan.decision, plan.consistency) == ("MISS", "DEGRADED")
    finally:
        await router.close()


@pytest.mark.parametrize(
    ("method", "raw"),
    [
        # A NodeSpec whose node_id is not UTF-8.
        ("RegisterNode", b"\x0a\x03\x0a\x01\xff"),
        # Truncated: a field that promises 5 bytes and has 1.
        ("Heartbeat", b"\x0a\x05a"),
        # A wire type that no field of it has.
        ("BatchGetRoutingHints", b"\x0f"),
    ],
)
async def test_an_undecodable_request_is_invalid_argument(
    channel: grpc.aio.Channel, method: str, raw: bytes
) -> None:
    """Refused at the server's edge with its reason, not gRPC's UNKNOWN."""
    call = channel.unary_unary(f"/kvbroker.v1.RegistryService/{method}")
    error = await failure(call(raw, timeout=5))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.reason == registry_pb2.ERROR_REASON_INVALID_ARGUMENT


async def test_an_undecodable_command_watch_is_invalid_argument(
    channel: grpc.aio.Channel,
) -> None:
    call = channel.unary_stream("/kvbroker.v1.RegistryService/WatchLeaseCommands")
    with pytest.raises(grpc.aio.AioRpcError) as error:
        async for _ in call(b"\x0a\x01\xff", timeout=5):
            pass
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT


_UNARY = sorted(
    method.name
    for method in registry_pb2.DESCRIPTOR.services_by_name["RegistryService"].methods
    if not method.server_streaming
)


@settings(
    max_examples=80,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(method=st.sampled_from(_UNARY), raw=st.binary(max_size=64))
async def test_fuzzed_bytes_are_never_unknown_or_internal(
    channel: grpc.aio.Channel, method: str, raw: bytes
) -> None:
    """Arbitrary bytes to any method: undecodable, or decoded into arbitrary field values.
    Answered, or refused with a status and a reason of the registry's; never UNKNOWN or
    INTERNAL."""
    call = channel.unary_unary(f"/kvbroker.v1.RegistryService/{method}")
    try:
        await call(raw, timeout=5)
    except grpc.aio.AioRpcError as rpc_error:
        error = from_grpc_error(rpc_error)
        assert error.code() not in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL), error
        assert error.reason != registry_pb2.ERROR_REASON_UNSPECIFIED, error
