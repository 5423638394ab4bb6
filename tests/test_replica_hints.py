"""Hints answered by every replica, on a real etcd and real gRPC: a follower answers dry-run
hints from its copy of the leader's state and sends the leader nothing; hints that write go to
the leader; a follower whose copy is behind forwards, or, allowed to lag, offers only what the
lease check before a read refuses; a follower cut off from its leader answers DEGRADED.

The follower reaches its leader through a TCP proxy on loopback (the leader advertises the
proxy's address), which the tests hold (bytes wait, as on a congested link) or cut (every
connection closed and new ones refused, as in a partition); clients reach each replica
directly.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from pathlib import Path

import grpc
import pytest

from kvbroker.common.client.grpc_client import (
    SERVED_BY_METADATA_KEY,
    RegistryEndpoint,
    open_channel,
    registry_stub,
)
from kvbroker.common.process.local_etcd import LocalEtcd
from kvbroker.common.process.ports import free_port
from kvbroker.common.rules import routing
from kvbroker.controlplane.replication.replica import Replica
from kvbroker.controlplane.server import RunningRegistry, ServerOptions, start_registry
from kvbroker.v1 import lease_pb2, node_pb2, registry_pb2
from kvbroker.v1.registry_pb2_grpc import RegistryServiceStub
from kvbroker_tools.harness.factories import Heartbeats, grant, node_spec
from tests.conftest import FAST, eventually

pytestmark = pytest.mark.etcd

REUSE = registry_pb2.HINT_DECISION_REUSE
EXACT = registry_pb2.HINT_CONSISTENCY_EXACT
DEGRADED = registry_pb2.HINT_CONSISTENCY_DEGRADED


class LinkProxy:
    """A TCP proxy on loopback to ``target``: ``hold`` keeps the bytes in both directions
    until ``release``; ``cut`` closes every connection and refuses new ones until
    ``restore``."""

    def __init__(self, target_port: int) -> None:
        self.port = free_port()
        self._target = target_port
        self._open = asyncio.Event()
        self._open.set()
        self._cut = False
        self._writers: set[asyncio.StreamWriter] = set()
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)

    async def stop(self) -> None:
        self.cut()
        if self._server is not None:
            self._server.close()

    def hold(self) -> None:
        self._open.clear()

    def release(self) -> None:
        self._open.set()

    def cut(self) -> None:
        self._cut = True
        for writer in self._writers:
            writer.close()
        self._writers.clear()

    def restore(self) -> None:
        self._cut = False

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._cut:
            writer.close()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self._target)
        except OSError:
            writer.close()
            return
        self._writers |= {writer, up_writer}
        await asyncio.gather(
            self._pipe(reader, up_writer), self._pipe(up_reader, writer), return_exceptions=True
        )

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                await self._open.wait()
                if self._cut:
                    break
                writer.write(data)
                await writer.drain()
        finally:
            writer.close()


@dataclass
class Pair:
    leader: RunningRegistry
    follower: RunningRegistry
    link: LinkProxy
    to_leader: RegistryServiceStub
    to_follower: RegistryServiceStub


@contextlib.asynccontextmanager
async def replicas(
    etcd: LocalEtcd,
    staleness_s: float = 1.0,
    token: str | None = None,
    credentials_file: Path | None = None,
) -> AsyncIterator[Pair]:
    """Two replicas in this process: the first leads, advertising the proxy; the second
    follows through it. With identity on, the stubs hold the shared (operator's) ``token``."""
    port = free_port()
    link = LinkProxy(port)
    await link.start()
    common = ServerOptions(
        store=etcd.url,
        config=FAST,
        hint_staleness_s=staleness_s,
        token=token,
        credentials_file=credentials_file,
    )
    leader = await start_registry(
        replace(common, listen=f"127.0.0.1:{port}", advertise=f"127.0.0.1:{link.port}")
    )
    follower: RunningRegistry | None = None
    try:
        await eventually(lambda: leader.registry is not None, what="the first replica leading")
        follower = await start_registry(replace(common, listen="127.0.0.1:0"))
        async with (
            open_channel(RegistryEndpoint.parse(leader.address, token=token)) as a,
            open_channel(RegistryEndpoint.parse(follower.address, token=token)) as b,
        ):
            yield Pair(leader, follower, link, registry_stub(a), registry_stub(b))
    finally:
        if follower is not None:
            await follower.stop(0)
        await leader.stop(0)
        await link.stop()


async def ask(
    stub: RegistryServiceStub, conversation: str, dry_run: bool = True
) -> tuple[registry_pb2.RoutingHint, str]:
    """A hint and the replica that answered it."""
    call = stub.GetRoutingHint(
        registry_pb2.GetRoutingHintRequest(conversation_id=conversation, dry_run=dry_run),
        timeout=10,
    )
    hint = (await call).hint
    served_by = dict(await call.trailing_metadata() or ()).get(SERVED_BY_METADATA_KEY, "")
    return hint, str(served_by)


def hints_answered(running: RunningRegistry) -> float:
    """Hints this replica computed (its ``kvbroker_hints_total``, all labels)."""
    total = 0.0
    for metric in running.leadership.metrics.registry.collect():
        if metric.name == "kvbroker_hints":
            total += sum(s.value for s in metric.samples if s.name.endswith("_total"))
    return total


def follower_hints(running: RunningRegistry, answer: str) -> float:
    value = running.leadership.metrics.registry.get_sample_value(
        "kvbroker_registry_follower_hints_total", {"answer": answer}
    )
    return value or 0.0


async def offered(pair: Pair, conversation: str, lease: lease_pb2.Lease) -> bool:
    """The follower's copy offers ``lease`` (it has caught up with its grant and with the
    heartbeat that made its holder ready)."""
    try:
        hint, _ = await ask(pair.to_follower, conversation)
    except grpc.aio.AioRpcError as error:
        if error.code() != grpc.StatusCode.UNAVAILABLE:
            raise
        return False
    return hint.decision == REUSE and hint.lease.epoch == lease.epoch


def read_refusal(current: lease_pb2.Lease, offered: lease_pb2.Lease) -> str | None:
    """The check a prefill node's sidecar makes before it reads (``Agent.check_lease``): the
    rule, on the lease as the leader says it is now, at the offered handle's epoch."""
    return routing.read_refusal(current, offered.epoch)


PREFILL = node_spec("prefill-0", node_pb2.NODE_ROLE_PREFILL, port=5700)
DECODE = node_spec("decode-0")


async def test_a_follower_answers_dry_run_hints_itself(etcd: LocalEtcd) -> None:
    """The follower's dry-run hint is the leader's answer (REUSE, EXACT, the same lease and
    epoch), named as the follower's, and the leader computes no hint for it; a hint that
    claims goes to the leader, which claims the lease, and the follower's copy then says
    CLAIMED too."""
    async with replicas(etcd) as pair, Heartbeats(pair.to_leader, PREFILL, DECODE):
        lease = await grant(pair.to_leader, DECODE, "conv-1", "req-1")
        await eventually(lambda: offered(pair, "conv-1", lease), what="the grant copied")
        from_leader, leader_name = await ask(pair.to_leader, "conv-1")
        before = hints_answered(pair.leader)
        for _ in range(20):
            hint, served_by = await ask(pair.to_follower, "conv-1")
            assert served_by == pair.follower.address != leader_name
            assert (hint.decision, hint.consistency) == (REUSE, EXACT)
            assert hint.lease.lease_id == from_leader.lease.lease_id == lease.lease_id
            assert hint.lease.epoch == from_leader.lease.epoch == lease.epoch
            assert hint.decode.node_id == DECODE.node_id
            assert 0 < hint.lease.time_to_live.ToNanoseconds() <= 300 * 10**9
        assert hints_answered(pair.leader) == before
        assert follower_hints(pair.follower, "local") >= 20

        # The batched call too, each hint on its own (one names no model: refused alone).
        batch = await pair.to_follower.BatchGetRoutingHints(
            registry_pb2.BatchGetRoutingHintsRequest(
                requests=[
                    registry_pb2.GetRoutingHintRequest(conversation_id="conv-1", dry_run=True),
                    registry_pb2.GetRoutingHintRequest(conversation_id="new", dry_run=True),
                    registry_pb2.GetRoutingHintRequest(
                        conversation_id="conv-1", dry_run=True, model="no-such-model"
                    ),
                ]
            ),
            timeout=10,
        )
        assert batch.results[0].hint.decision == REUSE
        assert batch.results[1].hint.decision == registry_pb2.HINT_DECISION_MISS
        assert batch.results[2].error.reason == registry_pb2.ERROR_REASON_NO_READY_NODE
        assert hints_answered(pair.leader) == before

        # A turn's hint claims the lease: the leader's to answer.
        claimed, served_by = await ask(pair.to_follower, "conv-1", dry_run=False)
        assert served_by == leader_name
        assert claimed.lease.state == lease_pb2.LEASE_STATE_CLAIMED
        assert hints_answered(pair.leader) == before + 1

        async def copied_claim() -> bool:
            hint, _ = await ask(pair.to_follower, "conv-1")
            return hint.decision == registry_pb2.HINT_DECISION_RECOMPUTE and "claimed" in (
                hint.reason
            )

        await eventually(copied_claim, what="the claim copied")
        assert hints_answered(pair.leader) == before + 1


async def test_a_follower_behind_forwards_hints(etcd: LocalEtcd) -> None:
    """The link to the leader held while the conversation's lease is superseded at the
    leader: until its copy is a second behind, the follower answers from it (the old lease,
    which the check before a read refuses); then it forwards, and the hint it answers once
    the link is back is the leader's, with the new epoch."""
    async with replicas(etcd, staleness_s=1.0) as pair, Heartbeats(pair.to_leader, PREFILL, DECODE):
        first = await grant(pair.to_leader, DECODE, "conv-1", "req-1")
        await eventually(lambda: offered(pair, "conv-1", first), what="the grant copied")
        leader_name = pair.leader.leadership.address
        stale_before = follower_hints(pair.follower, "stale")
        pair.link.hold()
        second = await grant(pair.to_leader, DECODE, "conv-1", "req-2")
        assert second.epoch > first.epoch
        answers: list[tuple[registry_pb2.RoutingHint, str]] = []

        async def keep_asking() -> None:
            while True:
                answers.append(await ask(pair.to_follower, "conv-1"))

        asking = asyncio.create_task(keep_asking())
        try:
            await eventually(
                lambda: follower_hints(pair.follower, "stale") > stale_before,
                what="the copy a second behind",
            )
            pair.link.release()
            await eventually(lambda: any(by == leader_name for _, by in answers))
        finally:
            asking.cancel()
            await asyncio.gather(asking, return_exceptions=True)
        superseded = await pair.to_leader.GetLease(
            registry_pb2.GetLeaseRequest(lease_id=first.lease_id), timeout=5
        )
        for hint, served_by in answers:
            if served_by == pair.follower.address and hint.lease.epoch == first.epoch:
                # From the copy behind: the old lease, which the check refuses.
                assert read_refusal(superseded.lease, hint.lease) is not None
            elif served_by == pair.follower.address:
                # From the copy caught up, after the link was released.
                assert (hint.decision, hint.lease.epoch) == (REUSE, second.epoch)
            else:
                assert served_by == leader_name
                assert (hint.decision, hint.lease.epoch) == (REUSE, second.epoch)


async def test_a_lagging_follower_offers_only_what_the_read_check_refuses(
    etcd: LocalEtcd,
) -> None:
    """Allowed to lag (30 s), a follower whose link is held answers from a copy that still
    holds the superseded lease: the lease check a prefill node makes before reading, on the
    leader's record of that lease, refuses it (superseded, and never claimed), so no read
    follows the stale hint."""
    async with (
        replicas(etcd, staleness_s=30.0) as pair,
        Heartbeats(pair.to_leader, PREFILL, DECODE),
    ):
        first = await grant(pair.to_leader, DECODE, "conv-1", "req-1")
        await eventually(lambda: offered(pair, "conv-1", first), what="the grant copied")
        pair.link.hold()
        try:
            second = await grant(pair.to_leader, DECODE, "conv-1", "req-2")
            stale, served_by = await ask(pair.to_follower, "conv-1")
            assert served_by == pair.follower.address
            assert (stale.decision, stale.lease.epoch) == (REUSE, first.epoch)
            current = await pair.to_leader.GetLease(
                registry_pb2.GetLeaseRequest(lease_id=stale.lease.lease_id), timeout=5
            )
            assert current.lease.end_cause == lease_pb2.LEASE_END_CAUSE_SUPERSEDED
            assert read_refusal(current.lease, stale.lease) is not None
            # Even unsuperseded, a lease a dry run offered is not claimed: no read on it.
            assert read_refusal(second, second) is not None
        finally:
            pair.link.release()
        await eventually(lambda: offered(pair, "conv-1", second), what="the copy caught up")


async def test_a_partitioned_follower_answers_degraded(etcd: LocalEtcd) -> None:
    """The link to the leader cut: the follower's copy goes stale, the leader cannot be
    reached, and the follower answers from its etcd cache, DEGRADED and with no lease; once
    the link is back it answers EXACT from a new copy."""
    async with replicas(etcd) as pair, Heartbeats(pair.to_leader, PREFILL, DECODE):
        lease = await grant(pair.to_leader, DECODE, "conv-1", "req-1")
        await eventually(lambda: offered(pair, "conv-1", lease), what="the grant copied")
        follower = pair.follower.leadership
        assert isinstance(follower, Replica)

        async def etcd_cache_routes() -> bool:
            """What the follower's etcd watch brought (behind its copy: a separate stream)."""
            nodes = await follower.store.list_nodes()
            return sum(node.state == node_pb2.NODE_STATE_READY for node in nodes) == 2

        await eventually(etcd_cache_routes, what="both nodes ready in the follower's etcd cache")
        pair.link.cut()
        try:

            async def degraded() -> registry_pb2.RoutingHint | None:
                hint, served_by = await ask(pair.to_follower, "conv-1")
                assert served_by in (pair.follower.address, "")
                return hint if hint.consistency == DEGRADED else None

            hint = await eventually(degraded, what="a degraded answer")
            assert hint is not None
            assert hint.decision != REUSE and not hint.HasField("lease")
        finally:
            pair.link.restore()
        await eventually(lambda: offered(pair, "conv-1", lease), what="a new copy")


async def test_a_follower_re_serves_its_copy(etcd: LocalEtcd) -> None:
    """A follower asked for the hint state serves its copy of the leader's (so routers need
    not all watch the leader): a snapshot holding the lease the leader granted, then the
    leader's own messages, stamped with the leader's times; a grant at the leader reaches the
    follower's watcher as a change."""
    async with replicas(etcd) as pair, Heartbeats(pair.to_leader, PREFILL, DECODE):
        first = await grant(pair.to_leader, DECODE, "conv-1", "req-1")
        await eventually(lambda: offered(pair, "conv-1", first), what="the grant copied")
        watch = pair.to_follower.WatchHintState(registry_pb2.WatchHintStateRequest(), timeout=30)
        try:
            snapshot: dict[str, bytes] = {}
            async for message in watch:
                snapshot |= {record.id: record.record for record in message.records}
                if message.snapshot_complete:
                    break
            else:
                raise AssertionError("the stream ended before its snapshot did")
            assert lease_pb2.Lease.FromString(snapshot[first.lease_id]).epoch == first.epoch
            second = await grant(pair.to_leader, DECODE, "conv-1", "req-2")
            async for message in watch:
                leases = [
                    lease_pb2.Lease.FromString(record.record)
                    for record in message.records
                    if record.kind == registry_pb2.HINT_RECORD_KIND_LEASE and record.record
                ]
                if any(lease.lease_id == second.lease_id for lease in leases):
                    break
            else:
                raise AssertionError("the stream ended before the grant reached it")
        finally:
            watch.cancel()
