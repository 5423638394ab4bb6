"""Registry replicas over a real etcd: fencing, racing replicas, partitions, and kills under load.

Every part is real and in its own process (etcd, `kvbroker registry serve --store etcd://…`,
`kvbroker sidecar run`, `kvbroker router run`); only the engines are simulated, through the
real EngineLink (see tools/kvbroker_tools/bench/failover_engine.py).
"""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import aetcd
import grpc
import httpx
import pytest

from kvbroker.common.client.grpc_client import RegistryEndpoint, open_channel, registry_stub
from kvbroker.common.process.local_etcd import LocalEtcd
from kvbroker.common.process.ports import free_port
from kvbroker.controlplane.errors import StoreUnavailable
from kvbroker.controlplane.records.model import Node
from kvbroker.controlplane.storage.etcd_store import EtcdEndpoints, EtcdStore
from kvbroker.v1 import lease_pb2, node_pb2, registry_pb2
from kvbroker_tools.bench.failover import SoakConfig, fleet_for_tests, registry_replica, run_soak
from kvbroker_tools.harness.factories import Heartbeats, grant, node_spec
from tests.conftest import eventually

pytestmark = pytest.mark.etcd

FLAGS = ["--election-ttl", "2", "--heartbeat-interval", "0.3", "--session-ttl", "1.5"]


async def test_a_deposed_leader_cannot_write(etcd: LocalEtcd) -> None:
    """The fence: once the leader key is someone else's, the old leader's commit fails and
    nothing of it reaches etcd."""
    store = EtcdStore(EtcdEndpoints.parse(etcd.url))
    async with aetcd.Client(port=etcd.client_port, timeout=2) as client:
        won = await client.put(store.leader_key, b"replica-a")
        store.fence = won.header.revision
        await store.put_node(Node(spec=node_spec("decode-0")))
        await store.commit()
        assert await client.get(store._key("node", "decode-0")) is not None

        # Replica A's key expires and replica B wins: a new create revision.
        await client.delete(store.leader_key)
        await client.put(store.leader_key, b"replica-b")
        await store.put_node(Node(spec=node_spec("decode-1")))
        with pytest.raises(StoreUnavailable, match="deposed"):
            await store.commit()
        assert await client.get(store._key("node", "decode-1")) is None
    await store.close()


async def test_racing_renew_and_revoke_on_two_replicas_agree(
    etcd: LocalEtcd, tmp_path: Path
) -> None:
    """Renew through one replica and revoke through the other, at once, for 20 leases: every
    lease ends REVOKED, both replicas say the same, and each renewal either happened
    before the revoke or was refused."""
    replicas = [registry_replica(tmp_path, i, etcd.url, FLAGS) for i in range(2)]
    for replica in replicas:
        await replica.start()
    try:
        first, second = (RegistryEndpoint.parse(r.address) for r in replicas)
        async with open_channel(first) as a, open_channel(second) as b:
            stub_a, stub_b = registry_stub(a), registry_stub(b)
            spec = node_spec("decode-0")
            async with Heartbeats(stub_a, spec):
                leases = [await grant(stub_a, spec, f"conv-{i}", f"req-{i}") for i in range(20)]

                async def renew(lease_id: str) -> str:
                    try:
                        await stub_a.RenewLease(
                            registry_pb2.RenewLeaseRequest(lease_id=lease_id), timeout=5
                        )
                    except grpc.aio.AioRpcError as error:
                        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
                        return "refused"
                    return "renewed"

                async def revoke(lease_id: str) -> int:
                    response = await stub_b.RevokeLease(
                        registry_pb2.RevokeLeaseRequest(lease_id=lease_id, reason="closed"),
                        timeout=5,
                    )
                    return int(response.lease.state)

                outcomes = await asyncio.gather(
                    *(renew(lease.lease_id) for lease in leases),
                    *(revoke(lease.lease_id) for lease in leases),
                )
                assert set(outcomes[len(leases) :]) == {lease_pb2.LEASE_STATE_REVOKED}
                assert set(outcomes[: len(leases)]) <= {"renewed", "refused"}
                for lease in leases:
                    request = registry_pb2.GetLeaseRequest(lease_id=lease.lease_id)
                    seen_a = (await stub_a.GetLease(request, timeout=5)).lease
                    seen_b = (await stub_b.GetLease(request, timeout=5)).lease
                    for seen in (seen_a, seen_b):
                        assert seen.state == lease_pb2.LEASE_STATE_REVOKED
                        assert seen.epoch == lease.epoch
                        assert seen.end_reason == "closed"
    finally:
        for replica in replicas:
            await replica.stop()


async def test_expiry_happens_once_across_replicas(etcd: LocalEtcd, tmp_path: Path) -> None:
    """Short leases granted through one replica expire exactly once in all: only the leader
    expires them; a follower never does."""
    metrics = [free_port() for _ in range(2)]
    replicas = [
        registry_replica(tmp_path, i, etcd.url, [*FLAGS, "--metrics-listen", f"127.0.0.1:{port}"])
        for i, port in enumerate(metrics)
    ]
    for replica in replicas:
        await replica.start()
    try:
        endpoint = RegistryEndpoint.parse(",".join(r.address for r in replicas))
        async with open_channel(endpoint) as channel, httpx.AsyncClient() as http:
            stub = registry_stub(channel)
            spec = node_spec("decode-0")
            async with Heartbeats(stub, spec):
                granted = [
                    await grant(stub, spec, f"conv-{i}", f"req-{i}", ttl_s=0.5) for i in range(10)
                ]

                async def all_expired() -> bool:
                    for lease in granted:
                        request = registry_pb2.GetLeaseRequest(lease_id=lease.lease_id)
                        seen = (await stub.GetLease(request, timeout=5)).lease
                        if seen.state != lease_pb2.LEASE_STATE_EXPIRED:
                            return False
                    return True

                async def expiries() -> float:
                    counted = 0.0
                    for port in metrics:
                        text = (await http.get(f"http://127.0.0.1:{port}/metrics")).text
                        for line in text.splitlines():
                            if line.startswith('kvbroker_lease_events_total{event="expired"}'):
                                counted += float(line.split()[-1])
                    return counted

                await eventually(all_expired)
                # Counted where they expired; a second count (a follower's) would come with it.
                assert await expiries() == len(granted)
    finally:
        for replica in replicas:
            await replica.stop()


async def test_a_partitioned_sidecars_leases_expire_and_are_not_offered(tmp_path: Path) -> None:
    """SIGSTOP a decode node's sidecar: its session ends, its leases are withdrawn and no hint
    offers them; SIGCONT: it re-registers, replays, and the same blocks are offered again."""
    config = SoakConfig(replicas=2, decode_engines=2, prefill_engines=1)
    async with fleet_for_tests(tmp_path, config, FLAGS) as fleet:
        decisions = [await fleet.turn("conv-p", i) for i in range(6)]
        assert ("REUSE", "EXACT") in decisions
        holder = fleet.engines[0] if fleet.engines[0].held else fleet.engines[1]
        sidecar = fleet.sidecars[fleet.engines.index(holder)]
        async with open_channel(RegistryEndpoint.parse(fleet.addresses)) as channel:
            stub = registry_stub(channel)
            dry = registry_pb2.GetRoutingHintRequest(conversation_id="conv-p", dry_run=True)

            sidecar.kill(signal.SIGSTOP)
            try:
                node = registry_pb2.GetNodeRequest(node_id=holder.node_id)

                async def down() -> bool:
                    state = (await stub.GetNode(node, timeout=5)).node.state
                    return state == node_pb2.NODE_STATE_DOWN

                await eventually(down, what="the session's end")
                hint = (await stub.GetRoutingHint(dry, timeout=5)).hint
                assert hint.decision != registry_pb2.HINT_DECISION_REUSE
                assert hint.decode.node_id != holder.node_id
                live = await stub.ListLeases(
                    registry_pb2.ListLeasesRequest(conversation_id="conv-p"), timeout=5
                )
                assert not live.leases
                # While partitioned, turns go on (recomputed elsewhere) and never read its KV.
                for i in range(3):
                    decision, _ = await fleet.turn("conv-q", i)
                    assert decision
            finally:
                sidecar.kill(signal.SIGCONT)

            async def offered() -> registry_pb2.RoutingHint | None:
                hint = (await stub.GetRoutingHint(dry, timeout=5)).hint
                return hint if hint.decision == registry_pb2.HINT_DECISION_REUSE else None

            hint = await eventually(offered, within=15, what="the replayed lease offered")
            assert hint is not None
        assert hint.consistency == registry_pb2.HINT_CONSISTENCY_EXACT
        assert hint.lease.node_id == holder.node_id
        assert hint.lease.handle.remote_request_id in holder.held
        assert fleet.tally.stale_reads == fleet.tally.stale_hints == 0
        assert not fleet.tally.failed


@pytest.mark.soak
async def test_kills_under_load_lose_nothing(tmp_path: Path) -> None:
    """The soak, bounded: replicas killed (mostly the leader), etcd restarted and etcd hung
    (SIGSTOP for four election TTLs, then SIGCONT) under a steady load of turns through the
    router. After the hang every replica leads or follows again within five TTLs."""
    config = SoakConfig(
        duration_s=48,
        kill_every_s=6,
        conversations=6,
        restart_etcd=True,
        hang_etcd_s=8,
        rejoin_within_s=10,
        leader_kill_share=1.0,
    )
    report = await run_soak(config, FLAGS, tmp_path)
    print(report)
    assert report.failures == []
    assert report.failed_requests == 0
    assert report.leases_lost == 0
    assert report.stale_hints == report.stale_reads == 0
    assert report.leader_kills >= 1 and report.etcd_restarts == 1
    assert report.etcd_hangs == 1 and report.replicas_stuck == 0
    assert len(report.etcd_hang_rejoin_s) == 1
    assert report.recovery_s and report.etcd_recovery_s  # reuse came back after each
    assert report.reuse_exact > report.turns // 4
