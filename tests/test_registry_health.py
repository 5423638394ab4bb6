"""The registry's gRPC health follows what its replicas can do, over a real etcd and real
`kvbroker registry serve --store etcd://…` processes: NOT_SERVING while a replica cannot reach
the store (every call but a hint would fail), SERVING again once it can."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Iterable
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvbroker.common.client.grpc_client import RegistryEndpoint, open_channel, registry_stub
from kvbroker.common.process.local_etcd import LocalEtcd
from kvbroker.common.process.supervisor import stop_all
from kvbroker.common.process.tasks import poll_until
from kvbroker.controlplane.server import SERVICE_NAME
from kvbroker.v1 import registry_pb2
from kvbroker_tools.bench.failover import registry_replica

pytestmark = pytest.mark.etcd

FLAGS = ["--election-ttl", "2", "--heartbeat-interval", "0.3", "--session-ttl", "1.5"]
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


async def health(address: str) -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        response = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=2
        )
    return int(response.status)


async def list_nodes(address: str) -> None:
    async with open_channel(RegistryEndpoint.parse(address)) as channel:
        await registry_stub(channel).ListNodes(registry_pb2.ListNodesRequest(), timeout=2)


async def answers_when_serving(address: str) -> bool:
    if await health(address) != SERVING:
        return False
    await list_nodes(address)  # fails the test if SERVING was a lie
    return True


async def _all(checks: Iterable[Awaitable[bool]]) -> bool:
    return all(await asyncio.gather(*checks))


async def until_all(addresses: list[str], status: int, within_s: float) -> None:
    name = health_pb2.HealthCheckResponse.ServingStatus.Name(status)
    await poll_until(
        lambda: _all(_is(address, status) for address in addresses),
        within_s,
        f"every replica {name}",
        every_s=0.1,
        retrying=(),
    )


async def _is(address: str, status: int) -> bool:
    return await health(address) == status


async def test_health_says_not_serving_while_the_store_is_away(
    etcd: LocalEtcd, tmp_path: Path
) -> None:
    replicas = [registry_replica(tmp_path, i, etcd.url, FLAGS) for i in range(2)]
    for replica in replicas:
        await replica.start()
    addresses = [replica.address for replica in replicas]
    try:
        await until_all(addresses, SERVING, within_s=15)  # one leads, the other follows it
        for address in addresses:
            await list_nodes(address)

        await etcd.stop()
        await until_all(addresses, NOT_SERVING, within_s=5)
        for address in addresses:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await list_nodes(address)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE

        await etcd.start()
        # Meanwhile a replica may say SERVING only if it answers (or forwards to who does):
        # the old leader's key outlives its term a while, and must not be taken for a leader.
        await poll_until(
            lambda: _all(answers_when_serving(address) for address in addresses),
            15,
            "every replica SERVING",
            every_s=0.05,
            retrying=(),
        )
    finally:
        await stop_all(replicas)


async def test_every_replica_leads_or_follows_again_after_etcd_hangs(
    etcd: LocalEtcd, tmp_path: Path
) -> None:
    """etcd hung, not dead (SIGSTOP for 8 s, four election TTLs, then SIGCONT): calls to it
    time out rather than fail, a replica's shared etcd client is closed under its other calls,
    and no replica may be left with its election ended. Within a few TTLs of etcd coming back
    every replica serves again: one leads, the others follow it."""
    replicas = [registry_replica(tmp_path, i, etcd.url, FLAGS) for i in range(3)]
    for replica in replicas:
        await replica.start()
    addresses = [replica.address for replica in replicas]
    try:
        await until_all(addresses, SERVING, within_s=15)
        await etcd.hang()
        try:
            await until_all(addresses, NOT_SERVING, within_s=8)
            await asyncio.sleep(8)  # etcd hung this long
        finally:
            etcd.resume()
        await poll_until(
            lambda: _all(answers_when_serving(address) for address in addresses),
            5 * 2,  # five election TTLs
            "every replica leading or following",
            every_s=0.1,
            retrying=(),
        )
        assert await etcd.leader() in addresses
    finally:
        await stop_all(replicas)
