"""`kvbroker bench fleet` small: its trace's shape, and one fleet of 10 nodes and 300 live
conversations on a real etcd and two real registry replicas (their own processes), whose
figures must say what happened: hints answered, later turns reusing what the simulated
engines held and never what they had reclaimed, sub-agents finding their parent's KV."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import grpc
import pytest
from rich.console import Console

from kvbroker.common.client.grpc_client import RegistryEndpoint, open_channel, registry_stub
from kvbroker.common.rules.checkpoints import probe_blocks
from kvbroker.v1 import node_pb2, registry_pb2
from kvbroker.v1.registry_pb2_grpc import RegistryServiceStub
from kvbroker_tools.bench.fleet import run_fleet
from kvbroker_tools.bench.fleet_config import FleetConfig
from kvbroker_tools.bench.fleet_engines import BLOCK_SIZE, node_spec
from kvbroker_tools.bench.fleet_heartbeats import HeartbeatProcess
from kvbroker_tools.bench.fleet_report import print_table, write
from kvbroker_tools.bench.fleet_trace import FleetTrace, TraceParams
from kvbroker_tools.harness.processes import RegistryProcess


def test_the_trace_grows_contexts_forks_sub_agents_and_replaces_ended_conversations() -> None:
    params = TraceParams(conversations_per_node=20, fork_share=0.2, seed=3)
    trace = FleetTrace(params, nodes=10, block_size=BLOCK_SIZE)
    assert len(trace.live) == 200
    initial = set(trace.live)
    again = FleetTrace(params, nodes=10, block_size=BLOCK_SIZE)
    turns = [trace.next_turn() for _ in range(3_000)]
    assert turns[:50] == [again.next_turn() for _ in range(50)]  # seeded: repeatable
    seen: dict[str, int] = {}
    forks = []
    for turn in turns:
        if turn.conversation in seen:  # the context: every earlier prompt and answer
            assert turn.context_tokens == seen[turn.conversation]
        seen[turn.conversation] = turn.context_tokens + turn.new_tokens + turn.output_tokens
        if turn.parent:
            forks.append(turn)
    assert forks and all(f.index == 0 and f.shared_tokens > 0 for f in forks)
    assert sum(turn.last for turn in turns) > 100
    # Top-level conversations that end are replaced; sub-agents come on top.
    assert len(trace.live) >= 200
    assert any(t.index == 0 and not t.parent and t.conversation not in initial for t in turns)


def test_a_sub_agent_shares_its_parents_block_hashes_up_to_where_it_forked() -> None:
    trace = FleetTrace(TraceParams(conversations_per_node=5, fork_share=1.0), 2, BLOCK_SIZE)
    fork = next(t for t in iter(trace.next_turn, None) if t.parent)
    shared = fork.shared_tokens // BLOCK_SIZE
    blocks = probe_blocks(shared)
    assert trace.hashes(fork.conversation, blocks) == trace.hashes(fork.parent, blocks)
    past = [shared, shared + 1]
    assert set(trace.hashes(fork.conversation, past)).isdisjoint(trace.hashes(fork.parent, past))


@pytest.mark.etcd
async def test_a_small_fleet_on_real_replicas_reuses_what_engines_hold(tmp_path: Path) -> None:
    """A decode engine small enough that it reclaims under its budget: later turns still
    reuse what it held, and no hint offers what it reclaimed."""
    config = FleetConfig(
        sizes=(10,), rate=100, seconds=3, saturation_s=1, replicas=2, capacity_blocks=8_192,
        trace=TraceParams(conversations_per_node=30, fork_share=0.1),
    )  # fmt: skip
    (point,) = await run_fleet(config, progress=lambda _: None)

    assert point.turns == 300 and point.errors == 0 and point.refused_events == 0
    assert point.later_turns > 100
    # Engines reclaimed (held < 1), and the hints followed what they held, never more.
    assert 0 < point.held_rate < 1
    assert 0 < point.hit_rate <= point.held_rate
    assert point.reused_of_held > 0.9
    assert point.reused_not_held == 0
    assert point.forks > 0 and point.fork_hits > 0
    assert point.hint_p50_ms <= point.hint_p99_ms <= point.hint_p999_ms
    assert len(point.replica_cores) == 2 and point.registry_cores > 0
    assert math.isclose(point.registry_cores, sum(point.replica_cores))
    assert point.hints_per_core > 0 and point.saturated_hints_per_s > 0
    assert point.registry_rss_mib > 50 and point.heartbeat_errors == {}

    paths = write([point], config, tmp_path)
    assert [p.name for p in paths] == ["fleet.json", "fleet.png"]
    report = json.loads(paths[0].read_text())
    assert report["points"][0]["hit_rate"] == point.hit_rate
    assert report["trace"]["conversations_per_node"] == 30
    console = Console(record=True, width=160)
    print_table([point], console)
    assert "300" in console.export_text()


async def test_heartbeats_keep_sessions_while_the_load_process_does_not_yield() -> None:
    """The load process builds the engines' replay for seconds without yielding (over ten at
    1,000 nodes): its nodes' heartbeats leave from a process of their own meanwhile, and no
    session lapses. Here the load process's loop is held, calling the registry only through a
    blocking channel, until the registry has applied heartbeats well past a session TTL."""
    interval_s, ttl_s = 0.2, 1.0
    registry = RegistryProcess("--heartbeat-interval", str(interval_s), "--session-ttl", str(ttl_s))
    await registry.start()
    channel = open_channel(RegistryEndpoint.parse(registry.address))
    try:
        spec = node_spec(0, node_pb2.NODE_ROLE_DECODE, 1_024)
        heartbeats = HeartbeatProcess(registry.address, [spec], interval_s)
        await heartbeats.started()
        answer = await registry_stub(channel).RegisterNode(
            registry_pb2.RegisterNodeRequest(spec=spec), timeout=10
        )
        registered = answer.node.registered_time.ToDatetime().timestamp()
        heartbeats.registered(spec.node_id)
        node = _hold_the_loop(registry.address, spec.node_id, until=registered + 3 * ttl_s)
        figures = await heartbeats.stop()
        assert node.state == node_pb2.NODE_STATE_READY
        assert figures.sent >= 3 * ttl_s / interval_s and not figures.errors
        assert 0 < figures.max_s < ttl_s
    finally:
        await channel.close()
        await registry.stop()


def _hold_the_loop(address: str, node_id: str, until: float) -> node_pb2.Node:
    """Holds the caller's event loop (called without an await, as a replay's build holds it),
    looking at the registry's record of the node through a blocking channel until a heartbeat
    applied after ``until`` or the session's end: the record then."""
    with grpc.insecure_channel(address) as blocking:
        stub = RegistryServiceStub(blocking)
        request = registry_pb2.GetNodeRequest(node_id=node_id)
        give_up = time.monotonic() + 30
        while True:
            node: node_pb2.Node = stub.GetNode(request, timeout=5).node
            heard = node.last_heartbeat_time.ToDatetime().timestamp()
            if node.state == node_pb2.NODE_STATE_DOWN or heard > until:
                return node
            assert time.monotonic() < give_up, "no heartbeat applied in 30 s, nor the end"
            time.sleep(0.05)  # the next look at the record
