"""Reclaims and finishing turns over real gRPC: an engine under pressure gets blocks back only
on the registry's word, never while a read may be in flight, and a hint that arrives while the
previous turn is still finishing waits for its retention instead of recomputing."""

from __future__ import annotations

import asyncio

import grpc

from kvbroker.common.rules.clock import from_duration
from kvbroker.controlplane.server import RunningRegistry
from kvbroker.v1 import lease_pb2, node_pb2, registry_pb2
from kvbroker.v1.registry_pb2_grpc import RegistryServiceStub
from kvbroker_tools.harness.factories import Heartbeats, hint, node_spec
from tests.test_retention_reports import report, retained

PREFILL = node_pb2.NODE_ROLE_PREFILL


def reclaim(seq: int, request_id: str, cause: int) -> registry_pb2.RetentionEvent:
    return registry_pb2.RetentionEvent(
        sequence=seq,
        reclaim=registry_pb2.ReclaimRequest(remote_request_id=request_id, cause=cause),  # type: ignore[arg-type]
    )


async def next_command(
    commands: asyncio.Queue[registry_pb2.LeaseCommand],
) -> registry_pb2.LeaseCommand:
    return await asyncio.wait_for(commands.get(), 3)


async def watch(
    stub: RegistryServiceStub, spec: node_pb2.NodeSpec
) -> tuple[asyncio.Queue[registry_pb2.LeaseCommand], asyncio.Task[None]]:
    commands: asyncio.Queue[registry_pb2.LeaseCommand] = asyncio.Queue()

    async def pump() -> None:
        stream = stub.WatchLeaseCommands(
            registry_pb2.WatchLeaseCommandsRequest(
                node_id=spec.node_id, incarnation=spec.incarnation
            )
        )
        async for item in stream:
            commands.put_nowait(item.command)

    return commands, asyncio.create_task(pump())


async def test_reclaim_ends_an_active_lease_before_freeing_and_keeps_a_claimed_one(
    stub: RegistryServiceStub,
) -> None:
    decode = node_spec("decode-0")
    async with Heartbeats(stub, decode, node_spec("prefill-0", PREFILL, port=5700)):
        commands, pump = await watch(stub, decode)
        try:
            await report(stub, decode, retained(1, decode, "c-idle", "req-idle"))
            await report(stub, decode, retained(2, decode, "c-read", "req-read"))
            claimed = await hint(stub, "c-read")
            assert claimed.decision == registry_pb2.HINT_DECISION_REUSE

            await report(
                stub,
                decode,
                reclaim(3, "req-idle", lease_pb2.LEASE_END_CAUSE_PRESSURE),
                reclaim(4, "req-read", lease_pb2.LEASE_END_CAUSE_PRESSURE),
                reclaim(5, "req-unknown", lease_pb2.LEASE_END_CAUSE_BUDGET),
            )
            seen: dict[str, registry_pb2.LeaseCommand] = {}
            while len(seen) < 3:
                command = await next_command(commands)
                if command.reason != "claimed by a read":  # the claim's own extension
                    seen[command.remote_request_id] = command
            # The idle one: ended first (PRESSURE), then freed at once.
            freed = seen["req-idle"]
            assert freed.state == lease_pb2.LEASE_STATE_RELEASED
            assert freed.cause == lease_pb2.LEASE_END_CAUSE_PRESSURE
            assert freed.time_to_live.ToNanoseconds() == 0
            # The claimed one: a read may be in flight, so the holder keeps it, and for as long
            # as the lease lives (hints offer it until then), not just for the claim.
            kept = seen["req-read"]
            assert kept.state == lease_pb2.LEASE_STATE_CLAIMED
            held = await stub.GetLease(
                registry_pb2.GetLeaseRequest(lease_id=claimed.lease.lease_id), timeout=5
            )
            lives = from_duration(held.lease.time_to_live)
            assert lives > 25  # the 30 s idle TTL; the claim lasts 1 s
            assert from_duration(kept.time_to_live) >= lives - 1
            # Nothing the registry stands behind: free now.
            assert seen["req-unknown"].time_to_live.ToNanoseconds() == 0

            again = await hint(stub, "c-idle")
            assert again.decision == registry_pb2.HINT_DECISION_RECOMPUTE
            assert "(PRESSURE)" in again.reason and "memory pressure" in again.reason
            assert not again.HasField("lease")
            listed = await stub.ListLeases(
                registry_pb2.ListLeasesRequest(states=[lease_pb2.LEASE_STATE_RELEASED]), timeout=5
            )
            assert [lease.end_cause for lease in listed.leases] == [
                lease_pb2.LEASE_END_CAUSE_PRESSURE
            ]
        finally:
            pump.cancel()


async def test_a_reclaim_needs_a_reclaim_cause(stub: RegistryServiceStub) -> None:
    decode = node_spec("decode-0")
    async with Heartbeats(stub, decode):
        answer = await report(stub, decode, reclaim(1, "req-1", lease_pb2.LEASE_END_CAUSE_READ))
        assert [refused.sequence for refused in answer.refused] == [1]
        assert answer.refused[0].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]


def settle_waits(registry: RunningRegistry, outcome: str) -> float:
    samples = registry.leadership.metrics.registry
    return samples.get_sample_value("kvbroker_hint_settle_waits_total", {"outcome": outcome}) or 0


async def test_a_hint_waits_for_the_retention_of_a_turn_still_finishing(
    stub: RegistryServiceStub, registry_server: RunningRegistry
) -> None:
    decode = node_spec("decode-0")
    async with Heartbeats(stub, decode, node_spec("prefill-0", PREFILL, port=5700)):
        await report(stub, decode, retained(1, decode, "c-fast", "req-1"))
        first = await hint(stub, "c-fast")  # turn 2 starts: reads req-1 (claimed)
        assert first.decision == registry_pb2.HINT_DECISION_REUSE

        async def turn_two_finishes() -> None:
            await asyncio.sleep(0.05)
            # D frees what P read, then retains turn 2: both reach the registry late.
            released = registry_pb2.RetentionEvent(
                sequence=2,
                released=registry_pb2.ReleasedBlocks(
                    remote_request_id="req-1", cause=lease_pb2.LEASE_END_CAUSE_READ
                ),
            )
            await report(stub, decode, released, retained(3, decode, "c-fast", "req-2"))

        finishing = asyncio.create_task(turn_two_finishes())
        third = await hint(stub, "c-fast")  # sent before D's report arrived
        await finishing
        assert third.decision == registry_pb2.HINT_DECISION_REUSE, third.reason
        assert settle_waits(registry_server, "settled") == 1  # it waited for the report
        assert third.lease.handle.remote_request_id == "req-2"

        # The third turn never reports (aborted): the next hint waits the settle timeout (0.2 s
        # in the test config), no longer, and recomputes; a look (dry run) never waits.
        loop = asyncio.get_running_loop()
        started = loop.time()
        waited = await hint(stub, "c-fast")
        assert waited.decision == registry_pb2.HINT_DECISION_RECOMPUTE
        assert "claimed" in waited.reason
        assert 0.2 <= loop.time() - started < 1.0
        assert settle_waits(registry_server, "timeout") == 1
        await hint(stub, "c-fast", dry_run=True)
        assert (
            settle_waits(registry_server, "settled"),
            settle_waits(registry_server, "timeout"),
        ) == (1, 1)
