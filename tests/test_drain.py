"""Drain before the pod dies, with real processes: a registry, two decode sidecars and one
prefill sidecar (engines simulated through the real EngineLink) and the router, several
conversations live and a read in flight on decode-0 when ``kvbroker node drain decode-0
--wait`` runs as the decode pod's preStop hook would."""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path
from typing import Any

import pytest

from kvbroker.common.client.grpc_client import RegistryEndpoint, open_channel, registry_stub
from kvbroker.common.rules.handles import LEASE_ID_KEY
from kvbroker.v1 import lease_pb2, node_pb2, registry_pb2
from kvbroker_tools.bench.failover import Fleet, SoakConfig, fleet_for_tests
from kvbroker_tools.bench.failover_engine import SimEngine
from tests.conftest import eventually, run_cli

pytestmark = pytest.mark.etcd

FLAGS = ["--election-ttl", "2", "--heartbeat-interval", "0.3", "--session-ttl", "1.5"]
CONVERSATIONS = 6
# A decode leg takes this long, counted as running on its engine (vLLM's num_requests_running).
DECODE_S = 0.1
# The read in flight goes on this long after decode-0 is DRAINING.
READ_HELD_S = 1.0
DRAINING = node_pb2.NODE_STATE_DRAINING


def last_engine(fleet: Fleet, conversation: str) -> str:
    """The engine whose decode leg retained the conversation's latest turn."""
    return fleet.retentions[conversation][-1][0]


def decoding_takes_time(engine: SimEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    original = engine.kv_transfer_params

    async def decoding(body: dict[str, Any]) -> dict[str, Any]:
        engine.running += 1
        try:
            await asyncio.sleep(DECODE_S)
            return await original(body)
        finally:
            engine.running -= 1

    monkeypatch.setattr(engine, "kv_transfer_params", decoding)


class Load:
    """The other conversations talking while decode-0 drains, and when the registry first
    said it was DRAINING."""

    def __init__(self, fleet: Fleet, stub: Any) -> None:
        self.fleet, self.stub = fleet, stub
        self.stop = asyncio.Event()
        self.draining = asyncio.Event()
        self.draining_since = 0.0
        self.served: list[tuple[float, float, str]] = []  # start, end, engine

    async def talk(self, conversation: str) -> None:
        index = 2
        while not self.stop.is_set():
            started = time.monotonic()
            decision, _ = await self.fleet.turn(conversation, index)
            assert decision, self.fleet.tally.failed
            engine = last_engine(self.fleet, conversation)
            self.served.append((started, time.monotonic(), engine))
            index += 1
            await asyncio.sleep(0.05)

    async def watch(self, node_id: str) -> None:
        request = registry_pb2.GetNodeRequest(node_id=node_id)
        while not self.draining.is_set():
            if (await self.stub.GetNode(request, timeout=5)).node.state == DRAINING:
                self.draining_since = time.monotonic()
                self.draining.set()
            await asyncio.sleep(0.02)


async def hold_the_read(
    fleet: Fleet, monkeypatch: pytest.MonkeyPatch, lease_id: str
) -> tuple[asyncio.Event, asyncio.Event]:
    """The prefill engine holds the read of ``lease_id`` open (after its lease check) until
    told: (reading, may end)."""
    prefill = fleet.engines[-1]
    reading, may_end = asyncio.Event(), asyncio.Event()
    original = prefill._prefill

    async def slow_read(params: dict[str, Any]) -> dict[str, Any]:
        result = await original(params)
        if params.get(LEASE_ID_KEY) == lease_id:
            reading.set()
            await may_end.wait()
        return result

    monkeypatch.setattr(prefill, "_prefill", slow_read)
    return reading, may_end


async def two_turns_each(fleet: Fleet, conversations: list[str]) -> str:
    """Two turns of each conversation, spread over both decode nodes; returns one whose KV
    decode-0 holds."""
    for index in range(2):
        for conversation in conversations:
            assert (await fleet.turn(conversation, index))[0], fleet.tally.failed
    decode0 = fleet.engines[0].engine_id
    on_decode0 = [c for c in conversations if last_engine(fleet, c) == decode0]
    assert on_decode0 and len(on_decode0) < len(conversations), "turns spread over both"
    return on_decode0[0]


async def test_drain_waits_for_the_read_in_flight_and_loses_no_turn(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = SoakConfig(replicas=1, decode_engines=2, prefill_engines=1)
    async with (
        fleet_for_tests(tmp_path, config, FLAGS) as fleet,
        contextlib.AsyncExitStack() as stack,
    ):
        decode0, decode1, _ = fleet.engines
        for engine in (decode0, decode1):
            decoding_takes_time(engine, monkeypatch)
        conversations = [f"conv-{i}" for i in range(CONVERSATIONS)]
        reader = await two_turns_each(fleet, conversations)
        others = [c for c in conversations if c != reader]

        async with open_channel(RegistryEndpoint.parse(fleet.addresses)) as channel:
            stub = registry_stub(channel)
            live = await stub.ListLeases(
                registry_pb2.ListLeasesRequest(conversation_id=reader), timeout=5
            )
            lease = live.leases[0]
            assert lease.node_id == decode0.node_id

            # The reader's next turn reuses its KV; the prefill engine holds the read open.
            reading, read_may_end = await hold_the_read(fleet, monkeypatch, lease.lease_id)
            # A failed check must not leave the router waiting on the read at the fleet's stop.
            stack.callback(read_may_end.set)
            reads_before = fleet.tally.reads
            read_turn = asyncio.create_task(fleet.turn(reader, 2))
            await asyncio.wait_for(reading.wait(), 10)
            get = registry_pb2.GetLeaseRequest(lease_id=lease.lease_id)
            claimed = (await stub.GetLease(get, timeout=5)).lease
            assert claimed.state == lease_pb2.LEASE_STATE_CLAIMED
            assert fleet.tally.reads == reads_before + 1  # its lease check allowed it

            load = Load(fleet, stub)
            talkers = [asyncio.create_task(load.talk(c)) for c in others]
            watcher = asyncio.create_task(load.watch(decode0.node_id))

            async def end_the_read() -> None:
                await load.draining.wait()
                await asyncio.sleep(READ_HELD_S)
                read_may_end.set()

            ender = asyncio.create_task(end_the_read())
            # The load is on: as many turns served as there are talkers.
            await eventually(lambda: len(load.served) >= len(others))
            drain_started = time.monotonic()
            drained = await run_cli(
                *("node", "drain", decode0.node_id, "--wait", "--timeout", "40"),
                *("--registry", fleet.addresses, "-o", "json"),
            )
            drain_ended = time.monotonic()
            load.stop.set()
            await asyncio.gather(*talkers, watcher, ender)

            assert drained.code == 0, drained.stderr
            assert drained.json()["drained"] and "decode-0: drained" in drained.stderr
            # The claimed read completed (it was held past the drain's start), its turn too.
            assert (await read_turn)[0] == "REUSE"
            assert drain_started < load.draining_since < drain_ended
            gone = await stub.ListLeases(
                registry_pb2.ListLeasesRequest(node_id=decode0.node_id), timeout=5
            )
            assert not gone.leases, "no live lease left on decode-0"
            node = (await stub.GetNode(registry_pb2.GetNodeRequest(node_id="decode-0"))).node
            assert node.drained and node.live_leases == 0

        # Turns that started once decode-0 was draining went to decode-1; so do the next ones.
        late = [engine for started, _, engine in load.served if started > load.draining_since]
        assert late and set(late) == {decode1.engine_id}
        for conversation in conversations:
            assert (await fleet.turn(conversation, 100))[0], fleet.tally.failed
            assert last_engine(fleet, conversation) == decode1.engine_id
        assert fleet.tally.failed == [] and fleet.tally.stale_reads == 0

        during = [s for s in load.served if drain_started <= s[1] <= drain_ended]
        print(
            f"\ndrain: {drain_ended - drain_started:.2f} s from the command's start to its exit, "
            f"{drain_ended - load.draining_since:.2f} s from DRAINING (the read held "
            f"{READ_HELD_S:.1f} s of it); {len(during)} turns served during it by "
            f"{len(others)} conversations, "
            f"{sum(1 for *_, engine in during if engine == decode0.engine_id)} of them on "
            "decode-0 (started before the drain); 0 failed"
        )
