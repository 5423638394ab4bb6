"""A report runs as one batch (its live leases' index entries and deadlines done at each
yield and at its end): over real gRPC, the same full snapshot reported with batching on and
off must leave the same answers, records, commands, deadlines and prefix-index hits."""

from __future__ import annotations

import asyncio
import dataclasses
import re
import time
from collections.abc import Awaitable, Callable
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from kvbroker.common.client.grpc_client import RegistryEndpoint, open_channel, registry_stub
from kvbroker.controlplane.deadlines import DeadlineKind
from kvbroker.controlplane.records.lease_ids import new_lease_id
from kvbroker.controlplane.server import ServerOptions, start_registry
from kvbroker.v1 import lease_pb2, node_pb2, registry_pb2
from kvbroker.v1.registry_pb2_grpc import RegistryServiceStub
from kvbroker_tools.harness.factories import block_hashes, node_spec, register
from tests.conftest import FAST
from tests.test_retention_reports import released, report, retained

# Sessions outlive the test: no heartbeats are sent.
CONFIG = dataclasses.replace(FAST, session_ttl_s=60.0, heartbeat_interval_s=10.0)


def replay_of(
    seq: int, spec: node_pb2.NodeSpec, lease: lease_pb2.Lease
) -> registry_pb2.RetentionEvent:
    return retained(seq, spec, lease.conversation_id, lease.handle.remote_request_id, lease)


def unknown(
    seq: int, spec: node_pb2.NodeSpec, conversation: str, request_id: str, epoch: int
) -> registry_pb2.RetentionEvent:
    """A replay of a lease this registry never minted (its records were lost)."""
    event = retained(seq, spec, conversation, request_id)
    event.retained.lease_id = new_lease_id(time.time())
    event.retained.epoch = epoch
    return event


Report = Callable[
    [RegistryServiceStub, node_pb2.NodeSpec], Awaitable[registry_pb2.ReportRetentionResponse]
]


async def outcome(batched: bool, build: Report) -> dict[str, Any]:
    """Runs ``build`` (the registry's state, then the report under test) on a fresh registry
    and returns what the report left, with lease ids (random per registry) named by their
    request ids."""
    running = await start_registry(ServerOptions(listen="127.0.0.1:0", config=CONFIG))
    registry = running.registry
    assert registry is not None
    registry.retention.batched = batched
    spec = node_spec("decode-0")
    try:
        async with open_channel(RegistryEndpoint.parse(running.address)) as channel:
            stub = registry_stub(channel)
            await register(stub, spec)
            answer = await build(stub, spec)
        store, index = registry.store, registry.leases.prefix_index
        leases = sorted(await store.list_leases(), key=lambda lease: lease.handle.remote_request_id)
        name = {lease.lease_id: lease.handle.remote_request_id for lease in leases}
        # Epochs carry the registry's term (its own each): named by their rank.
        epochs = sorted({lease.epoch for lease in leases} | {a.epoch for a in answer.leases})
        rank = {epoch: f"epoch#{i}" for i, epoch in enumerate(epochs)}

        def named(text: str) -> str:
            for lease_id, request_id in name.items():
                text = text.replace(lease_id, request_id)
            return re.sub(r"\d+", lambda m: rank.get(int(m.group()), m.group()), text)

        deadlines = registry._deadlines  # what the deadline task acts on
        commands = [
            (name.get(c.lease_id, "unstored"), c.state, c.cause, named(c.reason))
            for queue in registry.outbox._queues.values()  # not yet watched
            for c in queue.pending
        ]
        records = []
        for lease in leases:
            scope = index.scope(lease.lease_id)
            hits = (
                [
                    sorted(name[i] for i in hit.lease_ids)
                    for hit in index.hits(scope, block_hashes(128))
                ]
                if scope is not None
                else None
            )
            times = {
                DeadlineKind.LEASE_EXPIRY: lease.expire_time,
                DeadlineKind.CLAIM_END: lease.claim_expire_time,
                DeadlineKind.FORGET_LEASE: (lease.end_time or 0.0) + CONFIG.ended_lease_retention_s,
            }
            records.append(
                (
                    lease.handle.remote_request_id,
                    lease.conversation_id,
                    rank[lease.epoch],
                    lease.state,
                    lease.end_cause,
                    named(lease.end_reason),
                    lease.node_incarnation == spec.incarnation,
                    # Which deadlines are set, and each at the time its record says.
                    sorted(
                        (kind.name, deadlines.deadline((kind, lease.lease_id)) == times[kind])
                        for kind in times
                        if deadlines.deadline((kind, lease.lease_id)) is not None
                    ),
                    hits,
                )
            )
        return {
            "acks": [
                (name.get(a.lease_id, "unstored"), a.state, rank[a.epoch]) for a in answer.leases
            ],
            "refused": [(r.sequence, r.error.code) for r in answer.refused],
            "applied": answer.applied_sequence,
            "records": records,
            "commands": commands,
        }
    finally:
        await running.stop(grace=0)


async def the_snapshot(
    stub: RegistryServiceStub, spec: node_pb2.NodeSpec
) -> registry_pb2.ReportRetentionResponse:
    granted = (
        await report(stub, spec, *(retained(i, spec, f"c{i}", f"r{i}") for i in (1, 2, 3, 4)))
    ).leases
    turn2 = (await report(stub, spec, retained(5, spec, "c1", "r1-turn2"))).leases[0]
    malformed = retained(5, spec, "c5", "r5")
    malformed.retained.lease_id, malformed.retained.epoch = "not-a-lease-id", 1
    return await report(
        stub,
        spec,
        replay_of(1, spec, granted[0]),  # superseded by turn 2: freed
        unknown(2, spec, "c1", "r-fenced", 1),  # an older epoch than c1's: fenced
        replay_of(3, spec, granted[1]),
        replay_of(4, spec, granted[1]),  # a duplicate
        malformed,  # refused alone
        unknown(6, spec, "c9", "r9", 1),  # unknown: recreated
        retained(7, spec, "c10", "r10"),  # a grant
        replay_of(8, spec, turn2),
        replay_of(9, spec, granted[2]),
        released(10, "r3"),  # freed by the engine
        # granted[3] (c4) is left out: ended
        full_snapshot=True,
    )


async def test_a_snapshot_leaves_the_same_state_batched_or_not() -> None:
    batched = await outcome(True, the_snapshot)
    one_by_one = await outcome(False, the_snapshot)
    assert batched == one_by_one
    # The snapshot exercised what it was built for.
    states = {record[0]: (record[3], record[4]) for record in batched["records"]}
    assert [seq for seq, _ in batched["refused"]] == [5]
    assert batched["applied"] == 10
    assert states["r4"][0] == states["r1"][0] == lease_pb2.LEASE_STATE_REVOKED
    assert {"r9", "r10"} <= set(states)
    # The superseded lease and the fenced one (never stored) are freed by commands.
    assert {"r1", "unstored"} <= {command[0] for command in batched["commands"]}
    live = [r for r in batched["records"] if r[-1] is not None]
    assert live and all(r[-2] for r in live)  # live leases are indexed and have deadlines


# An event of a report, drawn: (kind, which lease or conversation).
KINDS = ("grant", "replay", "release", "reclaim", "unknown", "malformed")


@settings(max_examples=20, deadline=None)
@given(
    events=st.lists(st.tuples(st.sampled_from(KINDS), st.integers(0, 3)), max_size=12),
    full_snapshot=st.booleans(),
)
def test_any_mix_of_events_leaves_the_same_state_batched_or_not(
    events: list[tuple[str, int]], full_snapshot: bool
) -> None:
    async def build(
        stub: RegistryServiceStub, spec: node_pb2.NodeSpec
    ) -> registry_pb2.ReportRetentionResponse:
        setup = [retained(i + 1, spec, f"c{i}", f"r{i}") for i in range(3)]
        setup.append(retained(4, spec, "c0", "r0-turn2"))  # supersedes r0
        granted = list((await report(stub, spec, *setup)).leases)
        mix: list[registry_pb2.RetentionEvent] = []
        for seq, (kind, which) in enumerate(events, 5):
            request = f"r{which % 3}"
            if kind == "grant":
                mix.append(retained(seq, spec, f"c{which}", f"g{seq}"))
            elif kind == "replay":
                mix.append(replay_of(seq, spec, granted[which]))
            elif kind == "release":
                mix.append(released(seq, request))
            elif kind == "reclaim":
                reclaim = registry_pb2.ReclaimRequest(
                    remote_request_id=request, cause=lease_pb2.LEASE_END_CAUSE_PRESSURE
                )
                mix.append(registry_pb2.RetentionEvent(sequence=seq, reclaim=reclaim))
            elif kind == "unknown":
                mix.append(unknown(seq, spec, f"c{which}", f"u{seq}", 1))
            else:
                bad = retained(seq, spec, f"c{which}", f"m{seq}")
                bad.retained.lease_id, bad.retained.epoch = "not-a-lease-id", 1
                mix.append(bad)
        return await report(stub, spec, *mix, full_snapshot=full_snapshot)

    async def both() -> None:
        assert await outcome(True, build) == await outcome(False, build)

    asyncio.run(both())
