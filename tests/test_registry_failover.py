"""Clients given a list of registry replicas (``--registry a,b``: sidecar, router, CLI) over
real gRPC servers on loopback: a call goes on to the next replica when one cannot serve it
(no leader, refused, hung), a replica that failed is not asked again on every call, and one
that is back is used again; the registry's own answers (NO_READY_NODE) are not routed around."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator

import grpc
import pytest

from kvbroker.common.client.grpc_client import (
    REPLICA_BACKOFF_S,
    RegistryEndpoint,
    from_grpc_error,
    open_channel,
    registry_stub,
)
from kvbroker.common.process.ports import free_port
from kvbroker.common.process.tasks import poll_until
from kvbroker.controlplane.errors import (
    NoLeader,
    NoReadyNode,
    RegistryError,
    hint_error,
    status_metadata,
)
from kvbroker.controlplane.server import RunningRegistry
from kvbroker.v1 import registry_pb2, registry_pb2_grpc
from kvbroker_tools.harness.factories import node_spec
from tests.conftest import spawn_registry

LIST_NODES = registry_pb2.ListNodesRequest()


class Replica(registry_pb2_grpc.RegistryServiceServicer):
    """A replica that answers ListNodes with no node, or refuses it with ``refusal``; it
    counts the calls it got."""

    def __init__(self) -> None:
        self.refusal: RegistryError | None = None
        self.calls = 0

    async def ListNodes(
        self, request: registry_pb2.ListNodesRequest, context: grpc.aio.ServicerContext
    ) -> registry_pb2.ListNodesResponse:
        self.calls += 1
        if self.refusal is not None:
            context.set_trailing_metadata(status_metadata(hint_error(self.refusal)))
            await context.abort(self.refusal.code, self.refusal.message)
        return registry_pb2.ListNodesResponse()


@pytest.fixture
async def replica() -> AsyncIterator[tuple[Replica, str]]:
    servicer = Replica()
    server = grpc.aio.server()
    registry_pb2_grpc.add_RegistryServiceServicer_to_server(servicer, server)
    address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    await server.start()
    yield servicer, address
    await server.stop(0)


async def register_a_node(running: RunningRegistry) -> None:
    assert running.registry is not None
    await running.registry.register_node(node_spec("decode-0"))


async def nodes_seen(stub: registry_pb2_grpc.RegistryServiceStub) -> list[str]:
    answer = await stub.ListNodes(LIST_NODES, timeout=2)
    return [node.spec.node_id for node in answer.nodes]


async def test_a_replica_without_a_leader_is_passed_over_and_used_again_once_back(
    replica: tuple[Replica, str], registry_server: RunningRegistry
) -> None:
    """The first replica answers UNAVAILABLE (no leader): every call is answered by the
    second, the first is asked again only after its backoff, and once it serves it is the
    first asked again."""
    first, first_address = replica
    await register_a_node(registry_server)
    first.refusal = NoLeader("no replica leads (election pending); retry shortly")
    endpoint = RegistryEndpoint.parse(f"{first_address},{registry_server.address}")
    async with open_channel(endpoint) as channel:
        stub = registry_stub(channel)
        started = asyncio.get_running_loop().time()
        for _ in range(20):
            assert await nodes_seen(stub) == ["decode-0"]
        if asyncio.get_running_loop().time() - started < REPLICA_BACKOFF_S:
            assert first.calls == 1  # not hammered: one try, then its backoff

        first.refusal = None
        await poll_until(
            lambda: _answered_by_first(stub), within_s=4 * REPLICA_BACKOFF_S, what="first back"
        )
        asked = first.calls
        assert await nodes_seen(stub) == []
        assert first.calls == asked + 1


async def _answered_by_first(stub: registry_pb2_grpc.RegistryServiceStub) -> bool:
    return await nodes_seen(stub) == []


async def test_a_refused_connection_is_passed_over(registry_server: RunningRegistry) -> None:
    await register_a_node(registry_server)
    gone = f"127.0.0.1:{free_port()}"
    endpoint = RegistryEndpoint.parse(f"{gone},{registry_server.address}")
    async with open_channel(endpoint) as channel:
        assert await nodes_seen(registry_stub(channel)) == ["decode-0"]


async def test_the_registry_s_own_answer_is_not_routed_around(
    replica: tuple[Replica, str], registry_server: RunningRegistry
) -> None:
    """NO_READY_NODE is UNAVAILABLE too, but it is the registry's word, the same from every
    replica: the client gets it, and the next replica is not asked."""
    first, first_address = replica
    first.refusal = NoReadyNode("no ready decode node")
    endpoint = RegistryEndpoint.parse(f"{first_address},{registry_server.address}")
    async with open_channel(endpoint) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await nodes_seen(registry_stub(channel))
    assert from_grpc_error(refused.value).reason == registry_pb2.ERROR_REASON_NO_READY_NODE


async def test_a_hung_replica_is_passed_over_after_its_first_timeout(
    registry_server: RunningRegistry,
) -> None:
    """A replica that is up but answers nothing (SIGSTOP): the call that waited on it fails at
    its deadline (no time is left to ask another), the calls after it go to the next."""
    await register_a_node(registry_server)
    hung = await spawn_registry()
    hung.kill(signal.SIGSTOP)
    try:
        endpoint = RegistryEndpoint.parse(f"{hung.address},{registry_server.address}")
        async with open_channel(endpoint) as channel:
            stub = registry_stub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as timed_out:
                await stub.ListNodes(LIST_NODES, timeout=0.5)
            assert timed_out.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            for _ in range(5):
                assert await nodes_seen(stub) == ["decode-0"]
    finally:
        hung.kill(signal.SIGCONT)
        await hung.stop()
