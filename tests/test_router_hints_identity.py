"""The router's copy of the hint state with identity on (``--local-hints`` with a router-role
credential), on real registry replicas over a real etcd, real gRPC and a real router on
loopback: the watch streams the state with every incarnation hidden (``hint_state_for``, by
the rule of every answer), from the leader and re-served by a follower alike; the router
answers placement from it, the same hint the registry answers that router; a node's credential
is refused the watch; a router whose credential is wrong, or revoked (its line removed from the
credentials file and the replica restarted), keeps no copy and asks the registry.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from kvbroker.common.client.grpc_client import (
    RegistryEndpoint,
    from_grpc_error,
    open_channel,
    registry_stub,
)
from kvbroker.common.process.credentials import token_digest
from kvbroker.common.process.local_etcd import LocalEtcd
from kvbroker.controlplane.server import ServerOptions, start_registry
from kvbroker.router.local_hints import HintSource
from kvbroker.router.placement import HINT_SOURCE_HEADER
from kvbroker.v1 import lease_pb2, node_pb2, registry_pb2
from kvbroker.v1.registry_pb2_grpc import RegistryServiceStub
from kvbroker_tools.harness.factories import Heartbeats, grant
from tests.conftest import FAST, eventually
from tests.test_replica_hints import DECODE, PREFILL, Pair, hints_answered, replicas
from tests.test_router_hints import local_router, offered_locally

pytestmark = pytest.mark.etcd

ADMIN = "operator-token"
ROUTER = "router-token"
NODE = "node-token"


@dataclass
class Incarnations:
    """What one snapshot of the watch held: node and lease records, and their incarnations."""

    nodes: int
    leases: int
    shown: list[str]


async def watched(stub: RegistryServiceStub) -> Incarnations:
    """The watch's snapshot, read whole, and every incarnation in it."""
    nodes, leases, shown = 0, 0, []
    call = stub.WatchHintState(registry_pb2.WatchHintStateRequest(), timeout=10)
    async for message in call:
        for record in message.records:
            if record.kind == registry_pb2.HINT_RECORD_KIND_NODE and record.record:
                nodes += 1
                shown.append(node_pb2.Node.FromString(record.record).spec.incarnation)
            elif record.kind == registry_pb2.HINT_RECORD_KIND_LEASE and record.record:
                leases += 1
                shown.append(lease_pb2.Lease.FromString(record.record).node_incarnation)
        if message.snapshot_complete:
            break
    call.cancel()
    return Incarnations(nodes, leases, [i for i in shown if i])


@contextlib.asynccontextmanager
async def as_holder(address: str, token: str) -> AsyncIterator[RegistryServiceStub]:
    async with open_channel(RegistryEndpoint.parse(address, token=token)) as channel:
        yield registry_stub(channel)


@contextlib.asynccontextmanager
async def fleet(etcd: LocalEtcd, tmp_path: Path) -> AsyncIterator[Pair]:
    """Two replicas with identity on: the shared token is the operators' (and the replicas'),
    the credentials file holds a router's and the decode node's."""
    path = tmp_path / "credentials"
    path.write_text(
        f"router {token_digest(ROUTER)}\nnode:{DECODE.node_id}:decode {token_digest(NODE)}\n"
    )
    async with replicas(etcd, token=ADMIN, credentials_file=path) as pair:
        yield pair


def without_times(hint: registry_pb2.RoutingHint) -> registry_pb2.RoutingHint:
    """A hint less what moves with the clock between two askings (the lease's time left)."""
    shown = registry_pb2.RoutingHint()
    shown.CopyFrom(hint)
    shown.lease.ClearField("time_to_live")
    return shown


async def test_a_router_credential_watches_without_incarnations(
    etcd: LocalEtcd, tmp_path: Path
) -> None:
    """The stream a router gets, from the leader and from a follower's relay, holds every
    node and lease and no incarnation (an operator's holds them all); the router answers
    placement from it with no replica computing a hint, and its hint is the one the registry
    answers that router; a node's credential is refused the watch."""
    async with (
        fleet(etcd, tmp_path) as pair,
        Heartbeats(pair.to_leader, PREFILL, DECODE),
        as_holder(pair.leader.address, ROUTER) as router_at_leader,
        as_holder(pair.follower.address, ROUTER) as router_at_follower,
        as_holder(pair.follower.address, NODE) as node_at_follower,
        local_router(pair.follower.address, token=ROUTER) as router,
    ):
        lease = await grant(pair.to_leader, DECODE, "conv-1", "req-1")
        await eventually(lambda: offered_locally(router, "conv-1", lease), what="the copy")

        whole = await watched(pair.to_follower)
        assert (whole.nodes, whole.leases) == (2, 1)
        assert len(whole.shown) == 3  # both nodes' and the lease's holder's
        for stub in (router_at_leader, router_at_follower):
            seen = await watched(stub)
            assert (seen.nodes, seen.leases, seen.shown) == (2, 1, [])

        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await watched(node_at_follower)
        assert from_grpc_error(refused.value).reason == registry_pb2.ERROR_REASON_PERMISSION_DENIED

        leader_before = hints_answered(pair.leader)
        for _ in range(10):
            placed = await router.place("conv-1")
            assert placed.status_code == 200, placed.text
            assert placed.headers[HINT_SOURCE_HEADER] == "router"
            assert placed.json()["decision"] == "REUSE"
            assert placed.json()["decode"] == DECODE.node_id
            assert "incarnation" not in placed.text
        local, source = await router.hint("conv-1")
        assert source is HintSource.LOCAL
        assert hints_answered(pair.leader) == leader_before
        asked = await router_at_leader.GetRoutingHint(
            registry_pb2.GetRoutingHintRequest(conversation_id="conv-1", dry_run=True), timeout=5
        )
        assert not local.decode.incarnation and not local.lease.node_incarnation
        assert without_times(local) == without_times(asked.hint)
        assert local.lease.epoch == lease.epoch


async def test_a_router_whose_credential_is_wrong_keeps_no_copy(
    etcd: LocalEtcd, tmp_path: Path
) -> None:
    """A router whose token the registry does not hold (a wrong or revoked one) gets no copy:
    each placement goes to the registry (counted ``stale``), which refuses it as it refuses
    every call of that token, never an answer from a copy; beside it, a router holding its
    credential answers from its own."""
    async with (
        fleet(etcd, tmp_path) as pair,
        Heartbeats(pair.to_leader, PREFILL, DECODE),
        local_router(pair.follower.address, token="not-a-credential") as stranger,
        local_router(pair.follower.address, token=ROUTER) as router,
    ):
        lease = await grant(pair.to_leader, DECODE, "conv-1", "req-1")
        await eventually(lambda: offered_locally(router, "conv-1", lease), what="the copy")
        for _ in range(5):
            refused = await stranger.place("conv-1")
            assert refused.status_code >= 400
            assert HINT_SOURCE_HEADER not in refused.headers or (
                refused.headers[HINT_SOURCE_HEADER] == "registry"
            )
        assert stranger.answered("local") == 0
        assert stranger.answered("stale") == 5
        placed = await router.place("conv-1")
        assert placed.headers[HINT_SOURCE_HEADER] == "router"
        assert placed.json()["decode"] == DECODE.node_id


async def test_a_router_whose_credential_is_revoked_loses_its_copy(
    etcd: LocalEtcd, tmp_path: Path
) -> None:
    """A credential is revoked by removing its line from the credentials file and restarting
    the replica: the router's watch of that replica ends, its next watch is refused, and from
    then on each placement goes to the registry, which refuses it, never an answer from the
    copy the router held before."""
    async with (
        fleet(etcd, tmp_path) as pair,
        Heartbeats(pair.to_leader, PREFILL, DECODE),
        local_router(pair.follower.address, token=ROUTER) as router,
    ):
        lease = await grant(pair.to_leader, DECODE, "conv-1", "req-1")
        await eventually(lambda: offered_locally(router, "conv-1", lease), what="the copy")
        revoked = tmp_path / "revoked"
        revoked.write_text(f"node:{DECODE.node_id}:decode {token_digest(NODE)}\n")
        await pair.follower.stop(0)
        restarted = await start_registry(
            ServerOptions(
                store=etcd.url,
                config=FAST,
                listen=pair.follower.address,
                token=ADMIN,
                credentials_file=revoked,
            )
        )
        try:

            async def refused() -> bool:
                placed = await router.place("conv-1")
                return placed.status_code >= 400

            await eventually(refused, what="the registry refusing the revoked router")
            stale_before, local_before = router.answered("stale"), router.answered("local")
            for _ in range(3):
                placed = await router.place("conv-1")
                assert placed.status_code >= 400, placed.text
                assert placed.headers.get(HINT_SOURCE_HEADER, "registry") == "registry"
            assert router.answered("stale") == stale_before + 3
            assert router.answered("local") == local_before
            assert restarted.address == pair.follower.address
        finally:
            await restarted.stop(0)
