"""Real registry, real `kvbroker sidecar run` processes, the engine side driven by EngineLink;
and the agent in process against a scripted registry, for its forwarding and replay rules."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import cast

import grpc
import httpx
import pytest

from kvbroker.common.client.engine_link import Deadline, EngineLink
from kvbroker.common.client.grpc_client import RegistryEndpoint, open_channel, registry_stub
from kvbroker.common.process.ports import free_port
from kvbroker.common.process.supervisor import Announces, ChildProcess
from kvbroker.common.rules.checkpoints import Checkpoints, probe_blocks
from kvbroker.common.rules.clock import to_duration, to_timestamp
from kvbroker.controlplane.server import ServerOptions, start_registry
from kvbroker.engine_ext.prefix import prefix_hashes
from kvbroker.sidecar.agent import Agent
from kvbroker.sidecar.config import SidecarConfig, check_local_listen
from kvbroker.sidecar.server import start_sidecar
from kvbroker.v1 import (
    lease_pb2,
    node_pb2,
    registry_pb2,
    registry_pb2_grpc,
    sidecar_pb2,
    sidecar_pb2_grpc,
)
from kvbroker.v1.registry_pb2_grpc import RegistryServiceStub
from kvbroker_tools.harness.engine import FakeEngine
from kvbroker_tools.harness.factories import Heartbeats, block_hashes, handle, hint, node_spec
from kvbroker_tools.harness.processes import RegistryProcess, sidecar_process
from kvbroker_tools.stack import sidecar_command
from tests.conftest import FAST, eventually, run_cli, spawn_registry
from tests.test_engine_work import vllm_metrics

SESSION_FLAGS = ("--heartbeat-interval", "0.2", "--session-ttl", "1.0", "--revoke-grace", "0.5")


async def spawn_sidecar(
    registry: str, engine_url: str, node_id: str, socket_path: Path
) -> ChildProcess:
    sidecar = sidecar_process(registry, engine_url, node_id, socket_path)
    await sidecar.start()
    assert sidecar.announced["node"] == node_id
    return sidecar


def engine_info(node_id: str, port: int = 5601) -> sidecar_pb2.EngineInfo:
    return sidecar_pb2.EngineInfo(
        engine_id=f"engine-{node_id}",
        side_channel_host="127.0.0.1",
        side_channel_port=port,
        block_size=16,
        capacity_blocks=4096,
        bytes_per_block=65536,
    )


def retained_blocks(
    node_id: str, conversation: str, request_id: str, tokens: int = 160
) -> registry_pb2.RetainedBlocks:
    spec = node_spec(node_id)
    spec.engine_id = f"engine-{node_id}"
    return registry_pb2.RetainedBlocks(
        conversation_id=conversation,
        handle=handle(request_id, tokens, spec),
        block_hashes=block_hashes(tokens),
        token_count=tokens,
    )


async def live_leases(stub: RegistryServiceStub, node_id: str = "") -> list[lease_pb2.Lease]:
    response = await stub.ListLeases(
        registry_pb2.ListLeasesRequest(node_id=node_id, page_size=1000), timeout=5
    )
    return list(response.leases)


async def node_state(stub: RegistryServiceStub, node_id: str) -> int:
    return (await stub.GetNode(registry_pb2.GetNodeRequest(node_id=node_id), timeout=5)).node.state


@dataclass
class Stack:
    registry: RegistryProcess
    stub: RegistryServiceStub
    engine: FakeEngine
    sidecar: ChildProcess
    link: EngineLink
    port: int
    socket_path: Path


@pytest.fixture
async def stack(tmp_path: Path) -> AsyncIterator[Stack]:
    port = free_port()
    registry = await spawn_registry(
        *SESSION_FLAGS, "--metrics-listen", "127.0.0.1:0", listen=f"127.0.0.1:{port}"
    )
    socket_path = tmp_path / "s.sock"
    async with (
        FakeEngine("decode-0") as engine,
        open_channel(RegistryEndpoint.parse(registry.address)) as channel,
    ):
        sidecar = await spawn_sidecar(registry.address, engine.url, "decode-0", socket_path)
        link = EngineLink(f"unix:{socket_path}", engine_info("decode-0"))
        link.start()
        stub = registry_stub(channel)
        stack = Stack(registry, stub, engine, sidecar, link, port, socket_path)
        try:
            await eventually(lambda: asyncio.to_thread(link.attached.wait, 0.1))
            yield stack
        finally:
            link.close()
            await stack.sidecar.stop()  # a test may have replaced the first one
            await stack.registry.stop()


async def drain_deadlines(link: EngineLink) -> list[Deadline]:
    return link.poll_deadlines()


async def test_retention_is_visible_and_deadlines_reach_the_engine(stack: Stack) -> None:
    stack.link.retained(retained_blocks("decode-0", "conv-1", "req-1"))
    leases = await eventually(lambda: live_leases(stack.stub))
    assert [(lease.conversation_id, lease.node_id) for lease in leases] == [("conv-1", "decode-0")]
    lease = leases[0]
    node = (
        await stack.stub.GetNode(registry_pb2.GetNodeRequest(node_id="decode-0"), timeout=5)
    ).node
    assert node.spec.engine_id == "engine-decode-0"
    assert node.spec.model == "tiny-qwen3"  # learned from the engine's /v1/models
    assert node.spec.http_base_url == stack.engine.url
    assert node.spec.prefix_caching  # vLLM's default, and so the sidecar's

    table = await run_cli("lease", "ls", "--registry", stack.registry.address)
    assert lease.lease_id in table.stdout and "conv-1" in table.stdout

    granted = await eventually(lambda: drain_deadlines(stack.link))
    assert granted[0].lease_id == lease.lease_id and granted[0].lease_live

    renewed = await run_cli(
        "lease", "renew", lease.lease_id, "--ttl", "300", "--registry", stack.registry.address
    )
    assert renewed.code == 0, renewed.stderr
    [renewal] = await eventually(lambda: drain_deadlines(stack.link))
    loop_now = asyncio.get_running_loop().time()
    assert renewal.remote_request_id == "req-1"
    assert 295 < renewal.expires_at - loop_now <= 300.5

    revoked = await run_cli("lease", "revoke", lease.lease_id, "--registry", stack.registry.address)
    assert revoked.code == 0, revoked.stderr
    [revocation] = await eventually(lambda: drain_deadlines(stack.link))
    assert revocation.state == lease_pb2.LEASE_STATE_REVOKED and not revocation.lease_live
    assert revocation.expires_at - asyncio.get_running_loop().time() <= 0.5  # the revoke grace

    # The engine frees the blocks and says so; nothing stays live.
    stack.link.released("req-1", "revoked", lease_pb2.LEASE_END_CAUSE_REVOKED)
    assert stack.link.retained_count() == 0


async def test_a_link_closed_right_after_a_release_delivers_it_first(stack: Stack) -> None:
    """An engine that frees its blocks on its way out (its engine core stopping) closes its
    link at once: the release still reaches the registry, so the lease does not stay live."""
    stack.link.retained(retained_blocks("decode-0", "conv-1", "req-1"))
    [lease] = await eventually(lambda: live_leases(stack.stub))
    stack.link.released("req-1", "freed by the engine", lease_pb2.LEASE_END_CAUSE_ENGINE)
    await asyncio.to_thread(stack.link.close)
    request = registry_pb2.GetLeaseRequest(lease_id=lease.lease_id)

    async def ended_lease() -> lease_pb2.Lease | None:
        # The sidecar reports what reached it on its own round, after the link has closed.
        answer = (await stack.stub.GetLease(request, timeout=5)).lease
        return answer if answer.state != lease_pb2.LEASE_STATE_ACTIVE else None

    ended = await eventually(ended_lease, what="the release to reach the registry")
    assert ended is not None
    assert ended.state == lease_pb2.LEASE_STATE_RELEASED, ended
    assert ended.end_cause == lease_pb2.LEASE_END_CAUSE_ENGINE


async def test_registry_restart_loses_nothing(stack: Stack) -> None:
    for i in range(40):
        stack.link.retained(retained_blocks("decode-0", f"conv-{i}", f"req-{i}"))
    before = await eventually(lambda: _when_count(stack.stub, 40))
    stack.registry.kill()
    await stack.registry.wait()
    # While the registry is away the engine keeps working: frees some, retains more.
    for i in range(5):
        stack.link.released(f"req-{i}", "read completed", lease_pb2.LEASE_END_CAUSE_READ)
    for i in range(40, 45):
        stack.link.retained(retained_blocks("decode-0", f"conv-{i}", f"req-{i}"))
    now_retained = {f"req-{i}" for i in range(5, 45)}

    async def rebuilt() -> list[lease_pb2.Lease] | None:
        # The sidecar's replay, and its reports of what reached it after the replay if any:
        # what the engine retains now, never more.
        leases = await _when_count(stack.stub, 40, exact=True)
        ids = {lease.handle.remote_request_id for lease in leases or []}
        return leases if ids == now_retained else None

    stack.registry = await spawn_registry(*SESSION_FLAGS, listen=f"127.0.0.1:{stack.port}")
    after = await eventually(rebuilt, within=15)
    assert after is not None
    ids_after = {lease.handle.remote_request_id: lease for lease in after}
    # Leases that existed before keep their ids and epochs.
    for lease in before:
        if lease.handle.remote_request_id in ids_after:
            again = ids_after[lease.handle.remote_request_id]
            assert (again.lease_id, again.epoch) == (lease.lease_id, lease.epoch)
    assert len({lease.lease_id for lease in after}) == 40


async def test_a_closed_session_stays_closed_across_a_registry_restart(stack: Stack) -> None:
    """The memory store loses everything on a restart and the sidecar's replay rebuilds it.
    A lease revoked just before (a session closed; the engine keeps the blocks out the
    revoke grace) must not come back live with a fresh TTL, and a live lease comes back with
    the time it had left, not a new idle TTL."""
    stack.link.retained(retained_blocks("decode-0", "conv-open", "req-open"))
    stack.link.retained(retained_blocks("decode-0", "conv-closed", "req-closed"))
    await eventually(lambda: _when_count(stack.stub, 2))
    await stack.stub.RevokeLease(
        registry_pb2.RevokeLeaseRequest(conversation_id="conv-closed", reason="closed"),
        timeout=5,
    )
    before = {lease.conversation_id: lease for lease in await live_leases(stack.stub)}
    assert set(before) == {"conv-open"}
    seen: list[Deadline] = []

    async def revoke_reached_the_engine() -> bool:
        # The sidecar notes a command (its replay will not revive the lease) before it hands
        # the command on to the engine.
        seen.extend(stack.link.poll_deadlines())
        return any(d.remote_request_id == "req-closed" and not d.lease_live for d in seen)

    await eventually(revoke_reached_the_engine)
    stack.registry.kill()
    await stack.registry.wait()
    stack.registry = await spawn_registry(*SESSION_FLAGS, listen=f"127.0.0.1:{stack.port}")
    (after,) = await eventually(lambda: _when_count(stack.stub, 1, exact=True), within=15)
    assert after.conversation_id == "conv-open"
    assert after.time_to_live.ToTimedelta() <= before["conv-open"].time_to_live.ToTimedelta()


async def test_a_closed_session_stays_closed_when_the_engine_re_attaches_for_a_replay(
    stack: Stack,
) -> None:
    """The same within the revoke grace, when the node restarts with the registry: the
    engine's link re-attaches to a new sidecar with its own mirror's snapshot, which the
    sidecar replays to the restarted (empty) registry. The engine keeps the closed session's
    blocks out the grace, but its lease ended: the snapshot must not carry it as retained."""
    stack.link.retained(retained_blocks("decode-0", "conv-open", "req-open"))
    stack.link.retained(retained_blocks("decode-0", "conv-closed", "req-closed"))
    seen: list[Deadline] = []
    await eventually(lambda: _leases_known(stack.link, seen, 2))
    await stack.stub.RevokeLease(
        registry_pb2.RevokeLeaseRequest(conversation_id="conv-closed", reason="closed"),
        timeout=5,
    )

    async def revoked_reached_the_engine() -> bool:
        seen.extend(stack.link.poll_deadlines())
        return any(d.remote_request_id == "req-closed" and not d.lease_live for d in seen)

    await eventually(revoked_reached_the_engine)
    stack.registry.kill()
    await stack.registry.wait()
    stack.sidecar.kill()
    await stack.sidecar.wait()
    stack.registry = await spawn_registry(*SESSION_FLAGS, listen=f"127.0.0.1:{stack.port}")
    stack.sidecar = await spawn_sidecar(
        stack.registry.address, stack.engine.url, "decode-0", stack.socket_path
    )
    (after,) = await eventually(lambda: _when_count(stack.stub, 1, exact=True), within=15)
    assert after.conversation_id == "conv-open"


async def _when_count(stub: RegistryServiceStub, n: int, exact: bool = False):  # type: ignore[no-untyped-def]
    try:
        leases = await live_leases(stub)
    except Exception:  # the registry may still be starting
        return None
    if len(leases) == n:
        return leases
    assert not exact or len(leases) <= n, f"{len(leases)} leases: duplicates after replay"
    return None


async def test_killed_sidecar_withdraws_its_leases(stack: Stack) -> None:
    stack.link.retained(retained_blocks("decode-0", "conv-k", "req-k"))
    await eventually(lambda: live_leases(stack.stub))
    others = [
        node_spec("decode-1", port=5602),
        node_spec("prefill-0", node_pb2.NODE_ROLE_PREFILL, port=5700),
    ]
    async with Heartbeats(stack.stub, *others):
        assert (await hint(stack.stub, "conv-k", dry_run=True)).decode.node_id == "decode-0"
        stack.sidecar.kill()
        killed_at = asyncio.get_running_loop().time()
        await eventually(lambda: _no_live(stack.stub), within=5)
        elapsed = asyncio.get_running_loop().time() - killed_at
        assert elapsed < 1.0 + 0.5  # one session TTL plus the registry's scheduling slack
        assert await node_state(stack.stub, "decode-0") == node_pb2.NODE_STATE_DOWN
        result = await hint(stack.stub, "conv-k")
        assert result.decision == registry_pb2.HINT_DECISION_RECOMPUTE
        assert result.decode.node_id == "decode-1"


async def _no_live(stub: RegistryServiceStub) -> bool:
    return not await live_leases(stub)


async def test_a_registry_hung_for_less_than_its_session_ttl_keeps_the_session(
    tmp_path: Path,
) -> None:
    """SIGSTOPped past a heartbeat's deadline but within its session TTL, the registry finds
    the session as it was when it resumes: the failed heartbeat ended nothing (no
    re-registration, no replay), the node and its lease are live under the same incarnation,
    and the next heartbeats are answered. Ending the session on that one failure would have
    re-registered the node and replayed its retention into a registry too busy to answer."""
    registry = await spawn_registry("--heartbeat-interval", "0.2", "--session-ttl", "8")
    socket_path = tmp_path / "s.sock"
    async with (
        FakeEngine("decode-0") as engine,
        open_channel(RegistryEndpoint.parse(registry.address)) as channel,
    ):
        sidecar = sidecar_process(
            registry.address, engine.url, "decode-0", socket_path, log=tmp_path / "sidecar.log"
        )
        await sidecar.start()
        link = EngineLink(f"unix:{socket_path}", engine_info("decode-0"))
        link.start()
        stub = registry_stub(channel)
        try:
            await eventually(lambda: asyncio.to_thread(link.attached.wait, 0.1))
            link.retained(retained_blocks("decode-0", "conv-h", "req-h"))
            [lease] = await eventually(lambda: live_leases(stub))
            before = await _node(stub)
            registry.kill(signal.SIGSTOP)
            try:
                # A heartbeat's deadline (5 s) passes while the registry is stopped.
                failed = ("heartbeat_failed", "registry_session_lost")
                await eventually(
                    lambda: any(event in sidecar.log_tail(100_000) for event in failed),
                    within=15,
                    what="a failed heartbeat",
                )
            finally:
                registry.kill(signal.SIGCONT)
            await _heartbeats(stub, 2)
            node = await _node(stub)
            assert (node.spec.incarnation, node.state) == (
                before.spec.incarnation,
                node_pb2.NODE_STATE_READY,
            )
            assert [live.lease_id for live in await live_leases(stub)] == [lease.lease_id]
            assert "registry_session_lost" not in sidecar.log_tail(100_000)
        finally:
            link.close()
            await sidecar.stop()
            await registry.stop()


async def test_sidecar_restart_replays_from_the_engine(stack: Stack, tmp_path: Path) -> None:
    for i in range(3):
        stack.link.retained(retained_blocks("decode-0", f"conv-{i}", f"req-{i}"))
    before = await eventually(lambda: _when_count(stack.stub, 3))
    seen: list[Deadline] = []
    await eventually(lambda: _leases_known(stack.link, seen, 3))
    stack.sidecar.kill()
    await eventually(lambda: _no_live(stack.stub), within=5)
    stack.sidecar = await spawn_sidecar(
        stack.registry.address, stack.engine.url, "decode-0", stack.socket_path
    )
    after = await eventually(lambda: _when_count(stack.stub, 3, exact=True), within=10)
    assert {(x.lease_id, x.epoch) for x in after} == {(x.lease_id, x.epoch) for x in before}


async def _leases_known(link: EngineLink, seen: list[Deadline], n: int) -> bool:
    # Deadlines for the grants arrived, so the link knows each lease id for a replay.
    seen.extend(d for d in link.poll_deadlines() if d.lease_live)
    return len({d.lease_id for d in seen}) >= n


async def test_unhealthy_engine_makes_the_node_not_ready(stack: Stack) -> None:
    stack.link.retained(retained_blocks("decode-0", "conv-u", "req-u"))
    await eventually(lambda: live_leases(stack.stub))
    async with Heartbeats(
        stack.stub, node_spec("prefill-0", node_pb2.NODE_ROLE_PREFILL, port=5700)
    ):
        stack.engine.healthy = False

        async def not_ready() -> bool:
            return await node_state(stack.stub, "decode-0") == node_pb2.NODE_STATE_NOT_READY

        await eventually(not_ready, within=5)
        with pytest.raises(Exception) as error:  # no ready decode node is left to route to
            await hint(stack.stub, "conv-u")
        assert "no ready decode node" in str(error.value)
        stack.engine.healthy = True

        async def ready() -> bool:
            return await node_state(stack.stub, "decode-0") == node_pb2.NODE_STATE_READY

        await eventually(ready, within=5)
        assert (await hint(stack.stub, "conv-u")).decision == registry_pb2.HINT_DECISION_REUSE


async def test_a_slow_engine_keeps_its_session_and_leaves_routing_only_when_it_stays_slow(
    stack: Stack,
) -> None:
    """/health takes 3 s (the probe gives up after 1 s): heartbeats go on meanwhile, so the
    session and its lease survive; one timed-out probe keeps the node ready, three in a row
    take it out, and a prompt answer brings it back."""
    stack.link.retained(retained_blocks("decode-0", "conv-s", "req-s"))
    (lease,) = await eventually(lambda: live_leases(stack.stub))
    stack.engine.health_delay_s = 3.0
    probes = stack.engine.health_probes
    await eventually(lambda: _at_least(lambda: stack.engine.health_probes, probes + 2))
    # The first slow probe has timed out and the second is in flight: still ready.
    assert await node_state(stack.stub, "decode-0") == node_pb2.NODE_STATE_READY

    async def not_ready() -> bool:
        return await node_state(stack.stub, "decode-0") == node_pb2.NODE_STATE_NOT_READY

    await eventually(not_ready, within=10)
    stack.engine.health_delay_s = 0.0

    async def ready() -> bool:
        return await node_state(stack.stub, "decode-0") == node_pb2.NODE_STATE_READY

    await eventually(ready, within=10)
    assert [(x.lease_id, x.epoch) for x in await live_leases(stack.stub)] == [
        (lease.lease_id, lease.epoch)
    ]


async def _at_least(count: Callable[[], int], n: int) -> bool:
    return count() >= n


class ScriptedRegistry(registry_pb2_grpc.RegistryServiceServicer):
    """A registry that records the sidecar's reports, can hold one in flight and can refuse
    the next ones, so the forwarding and replay rules can be watched event by event."""

    def __init__(self) -> None:
        self.registrations = 0
        # (full snapshot, [(sequence, kind, request id, lease id)]) per report, as received.
        self.reports: list[tuple[bool, list[tuple[int, str, str, str]]]] = []
        self.received = asyncio.Condition()
        self.release = asyncio.Event()
        self.release.set()
        self.refuse = 0
        # Request ids whose retained events are refused one by one (answered per event).
        self.refuse_ids: set[str] = set()

    async def RegisterNode(
        self, request: registry_pb2.RegisterNodeRequest, context: grpc.aio.ServicerContext
    ) -> registry_pb2.RegisterNodeResponse:
        self.registrations += 1
        return registry_pb2.RegisterNodeResponse(heartbeat_interval=to_duration(1.0))

    async def Heartbeat(
        self, request: registry_pb2.HeartbeatRequest, context: grpc.aio.ServicerContext
    ) -> registry_pb2.HeartbeatResponse:
        return registry_pb2.HeartbeatResponse()

    async def WatchLeaseCommands(
        self, request: registry_pb2.WatchLeaseCommandsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[registry_pb2.WatchLeaseCommandsResponse]:
        await asyncio.Event().wait()
        yield registry_pb2.WatchLeaseCommandsResponse()

    async def ReportRetention(
        self, request: registry_pb2.ReportRetentionRequest, context: grpc.aio.ServicerContext
    ) -> registry_pb2.ReportRetentionResponse:
        events = []
        for event in request.events:
            kind = event.WhichOneof("event") or ""
            if kind == "retained":
                request_id, lease_id = (
                    event.retained.handle.remote_request_id,
                    event.retained.lease_id,
                )
            else:
                request_id, lease_id = getattr(event, kind).remote_request_id, ""
            events.append((event.sequence, kind, request_id, lease_id))
        async with self.received:
            self.reports.append((request.full_snapshot, events))
            self.received.notify_all()
        await self.release.wait()
        if self.refuse and not request.full_snapshot:
            self.refuse -= 1
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "refused")
        response = registry_pb2.ReportRetentionResponse()
        for event in request.events:
            if event.HasField("retained"):
                request_id = event.retained.handle.remote_request_id
                if request_id in self.refuse_ids:
                    response.refused.add(
                        sequence=event.sequence,
                        error=registry_pb2.HintError(
                            code=grpc.StatusCode.INVALID_ARGUMENT.value[0],
                            message="conversation_id is too long",
                            reason=registry_pb2.ERROR_REASON_INVALID_ARGUMENT,
                        ),
                    )
                    continue
                response.leases.add(
                    lease_id=f"lease-{request_id}",
                    epoch=1,
                    state=lease_pb2.LEASE_STATE_ACTIVE,
                    handle=lease_pb2.KvHandle(remote_request_id=request_id),
                )
        return response

    async def report(self, n: int) -> tuple[bool, list[tuple[int, str, str, str]]]:
        """The n-th report (from 0), once it has arrived."""
        async with self.received:
            await asyncio.wait_for(self.received.wait_for(lambda: len(self.reports) > n), 10)
        return self.reports[n]


def event(kind: str, request_id: str) -> registry_pb2.RetentionEvent:
    if kind == "retained":
        return registry_pb2.RetentionEvent(
            retained=retained_blocks("decode-0", f"conv-{request_id}", request_id)
        )
    return registry_pb2.RetentionEvent(
        released=registry_pb2.ReleasedBlocks(remote_request_id=request_id)
    )


async def test_reports_go_in_order_and_a_refused_one_is_replayed_not_resent() -> None:
    registry = ScriptedRegistry()
    server = grpc.aio.server()
    registry_pb2_grpc.add_RegistryServiceServicer_to_server(registry, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    config = SidecarConfig(
        "decode-0", node_pb2.NODE_ROLE_DECODE, "http://127.0.0.1:9", model="tiny-qwen3"
    )
    agent = Agent(config, RegistryEndpoint.parse(f"127.0.0.1:{port}"))
    agent.attach_engine(engine_info("decode-0"), [])
    running = asyncio.create_task(agent.run())
    try:
        assert await registry.report(0) == (True, [])  # the first session's (empty) replay
        await asyncio.wait_for(agent.connected.wait(), 10)

        # One report in flight; what comes meanwhile goes in the next, in order.
        registry.release.clear()
        agent.submit([event("retained", "a")])
        await registry.report(1)
        agent.submit([event("retained", "b"), event("retained", "c")])
        agent.submit([event("released", "a")])
        agent.submit([event("released", "never-retained")])  # nothing to send
        registry.release.set()
        assert [(kind, rid) for _, kind, rid, _ in (await registry.report(1))[1]] == [
            ("retained", "a")
        ]
        assert [(kind, rid) for _, kind, rid, _ in (await registry.report(2))[1]] == [
            ("retained", "b"),
            ("retained", "c"),
            ("released", "a"),
        ]

        # A refused report ends the session; the replay carries it and what queued behind
        # it (with the leases granted so far), and neither is sent again after the replay.
        registry.refuse = 1
        registry.release.clear()
        agent.submit([event("retained", "d")])
        await registry.report(3)
        agent.submit([event("retained", "e")])
        registry.release.set()
        full, replay = await registry.report(4)
        assert full and registry.registrations == 2
        assert sorted((rid, lease_id) for _, _, rid, lease_id in replay) == [
            ("b", "lease-b"),
            ("c", "lease-c"),
            ("d", ""),
            ("e", ""),
        ]
        await asyncio.wait_for(agent.connected.wait(), 10)
        agent.submit([event("released", "b")])
        assert [(kind, rid) for _, kind, rid, _ in (await registry.report(5))[1]] == [
            ("released", "b")
        ]
        sequences = [seq for _, events in registry.reports for seq, *_ in events]
        assert sequences == sorted(set(sequences))  # increasing, never reused
    finally:
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)
        await agent.close()
        await server.stop(0)


@pytest.mark.parametrize(
    "metrics",
    [
        "<html><body><h1>500 Internal Server Error</h1></body></html>",
        "vllm:num_requests_running NaN\n",
        "vllm:num_requests_running -3\n",
        "vllm:num_requests_running 4294967296\n",
    ],
)
async def test_an_engine_answering_garbage_metrics_keeps_its_session_and_readiness(
    stack: Stack, metrics: str
) -> None:
    """A bad /metrics answer costs the node its load figures, not its probe loop: heartbeats go
    on, so the node stays READY and its lease live (the session TTL is 1 s; we watch 3 s)."""
    stack.link.retained(retained_blocks("decode-0", "conv-g", "req-g"))
    (lease,) = await eventually(lambda: live_leases(stack.stub))
    stack.engine.running = 3
    await eventually(lambda: _running_requests(stack.stub, 3))
    stack.engine.metrics_body = metrics
    await eventually(lambda: _running_requests(stack.stub, 0))  # the figures are ignored
    probes = stack.engine.health_probes
    since = await _node(stack.stub)
    # Heartbeats go on past one session TTL (1 s) since the garbage was first reported.
    await eventually(lambda: _heartbeat_since(stack.stub, since, 1.5))
    await eventually(lambda: stack.engine.health_probes >= probes + 5)  # the probe loop goes on
    assert stack.sidecar.running
    assert (await _node(stack.stub)).registered_time == since.registered_time  # same session
    assert await node_state(stack.stub, "decode-0") == node_pb2.NODE_STATE_READY
    assert [x.lease_id for x in await live_leases(stack.stub)] == [lease.lease_id]
    stack.engine.metrics_body = None
    await eventually(lambda: _running_requests(stack.stub, 3))


async def test_the_engine_s_work_corrects_its_node_s_costs_live(stack: Stack) -> None:
    """The engine's /metrics says it has prefilled 4x slower than the node's (default) costs
    predict: the sidecar reports the work with a heartbeat, and the registry's view of the node,
    the CLI and the registry's metric show the correction; a calibration resets it."""
    # Work the engine did before the sidecar looked: a baseline, not work of an interval.
    stack.engine.metrics_body = vllm_metrics(50, 100.0, computed=5000, prompt=5000)
    await _probes_read_metrics(stack.engine)
    view = await _node(stack.stub)
    assert view.cost_correction.prefill == 1.0 and view.cost_correction.prefill_samples == 0

    # Then 10 prefills of 400 tokens: 10 * (25 + 400 * 0.45) = 2.05 s at the defaults; 8.2 s.
    stack.engine.metrics_body = vllm_metrics(
        prefills=60, prefill_seconds=108.2, computed=9000, prompt=9000
    )

    async def corrected() -> node_pb2.Node | None:
        node = await _node(stack.stub)
        return node if node.cost_correction.prefill_samples else None

    node = await eventually(corrected)
    assert node is not None
    assert node.cost_correction.prefill == pytest.approx(4**0.2)  # one sample: a fifth of the way
    assert (node.cost_correction.read, node.cost_correction.read_samples) == (1.0, 0)
    # The counters stand still: probes read them again, heartbeats carry what they took (no
    # work), and no sample is added.
    await _probes_read_metrics(stack.engine)
    await _heartbeats(stack.stub, 2)
    assert (await _node(stack.stub)).cost_correction.prefill_samples == 1

    shown = await run_cli("node", "get", "decode-0", "--registry", stack.registry.address)
    assert shown.code == 0, shown.stderr
    assert "x1.32/x1.00" in shown.stdout and "x1.32 (1)" in shown.stdout
    async with httpx.AsyncClient(timeout=5) as client:
        page = await client.get(f"http://{stack.registry.announced['metrics']}/metrics")
    assert 'kvbroker_node_cost_correction{figure="prefill",node="decode-0"} 1.3' in page.text

    profile = node_pb2.CostProfile(prefill_us_per_token=900.0, calibrated_time=to_timestamp(1.0))
    await stack.stub.SetCostProfile(
        registry_pb2.SetCostProfileRequest(node_id="decode-0", cost=profile), timeout=5
    )
    assert (await _node(stack.stub)).cost_correction == node_pb2.CostCorrection(
        prefill=1.0, read=1.0
    )


async def _node(stub: RegistryServiceStub) -> node_pb2.Node:
    return (await stub.GetNode(registry_pb2.GetNodeRequest(node_id="decode-0"), timeout=5)).node


async def _probes_read_metrics(engine: FakeEngine) -> None:
    """Returns once the sidecar's probes have read the engine's /metrics as it is now: two
    more scrapes, the second only after the first was read (one probe at a time)."""
    scrapes = engine.metrics_scrapes
    await eventually(lambda: engine.metrics_scrapes >= scrapes + 2)


async def _heartbeat_since(stub: RegistryServiceStub, since: node_pb2.Node, after_s: float) -> bool:
    """Whether decode-0 heartbeated more than ``after_s`` after ``since`` was read (both on
    the registry's clock)."""
    last = (await _node(stub)).last_heartbeat_time.ToNanoseconds()
    return last > since.last_heartbeat_time.ToNanoseconds() + after_s * 1e9


async def _heartbeats(stub: RegistryServiceStub, n: int) -> None:
    """Returns after ``n`` more heartbeats of decode-0 reached the registry: all but the first
    were sent after this call began (a sidecar sends one heartbeat at a time)."""
    for _ in range(n):
        since = await _node(stub)
        await eventually(partial(_heartbeat_since, stub, since, 0))


async def _running_requests(stub: RegistryServiceStub, n: int) -> bool:
    node = (await stub.GetNode(registry_pb2.GetNodeRequest(node_id="decode-0"), timeout=5)).node
    return node.load.running_requests == n


# Loaded by a child sidecar at start-up (as its sitecustomize): its probe meets a bug.
_BROKEN_PROBE = """
from kvbroker.sidecar.engine_probe import EngineProbe


async def _probe(self):
    raise RuntimeError("a bug in the probe")


EngineProbe.probe = _probe
"""


async def test_a_sidecar_whose_loop_dies_logs_why_and_exits_non_zero(tmp_path: Path) -> None:
    """Alive without its loops, a sidecar would let its node go DOWN for good with nobody to
    restart it: it must say what ended its loop and exit, for its supervisor to restart it."""
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(_BROKEN_PROBE)
    socket_path = tmp_path / "s.sock"
    sidecar = ChildProcess(
        "sidecar-decode-0",
        sidecar_command(
            f"127.0.0.1:{free_port()}", "http://127.0.0.1:9", "decode", "decode-0", socket_path
        ),
        tmp_path / "sidecar.log",
        ready=[Announces()],
        env={"PYTHONPATH": os.pathsep.join([str(inject), os.environ.get("PYTHONPATH", "")])},
    )
    await sidecar.start()
    link = EngineLink(f"unix:{socket_path}", engine_info("decode-0"))
    link.start()  # the agent probes once an engine is attached
    try:
        assert await asyncio.wait_for(sidecar.wait(), 10) == 1
    finally:
        link.close()
        await sidecar.stop()
    lines = sidecar.log_tail(100_000).splitlines()
    records = [json.loads(line) for line in lines if line.startswith("{")]
    [failed] = [record for record in records if record.get("event") == "sidecar_failed"]
    assert failed["level"] == "error" and "a bug in the probe" in failed["exception"]


async def test_a_refused_event_is_dropped_not_the_session() -> None:
    """The registry refuses one event of a report: the sidecar drops it from its mirror and
    tells the engine to free its blocks; the session goes on, and no replay carries it."""
    registry = ScriptedRegistry()
    registry.refuse_ids = {"bad"}
    server = grpc.aio.server()
    registry_pb2_grpc.add_RegistryServiceServicer_to_server(registry, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    config = SidecarConfig(
        "decode-0", node_pb2.NODE_ROLE_DECODE, "http://127.0.0.1:9", model="tiny-qwen3"
    )
    agent = Agent(config, RegistryEndpoint.parse(f"127.0.0.1:{port}"))
    agent.attach_engine(engine_info("decode-0"), [])
    to_engine: list[tuple[str, int]] = []

    async def watch_deadlines() -> None:
        async for command in agent.deadlines():
            to_engine.append((command.remote_request_id, command.state))

    watching = asyncio.create_task(watch_deadlines())
    running = asyncio.create_task(agent.run())
    try:
        assert await registry.report(0) == (True, [])
        await asyncio.wait_for(agent.connected.wait(), 10)
        agent.submit([event("retained", "a"), event("retained", "bad"), event("retained", "c")])
        full, sent = await registry.report(1)
        assert not full and [rid for _, _, rid, _ in sent] == ["a", "bad", "c"]
        await eventually(lambda: _at_least(lambda: len(to_engine), 3), within=5)
        assert ("bad", lease_pb2.LEASE_STATE_RELEASED) in to_engine
        assert ("a", lease_pb2.LEASE_STATE_ACTIVE) in to_engine
        # The session goes on: the next report goes out in it, with no replay before.
        agent.submit([event("released", "a")])
        full, sent = await registry.report(2)
        assert not full and [rid for _, _, rid, _ in sent] == ["a"]
        assert registry.registrations == 1
        # A later replay (the engine re-attaches) no longer carries the refused event.
        agent.attach_engine(engine_info("decode-0"), [])
        agent._relay.replace([event("retained", "c").retained])
        full, sent = await registry.report(3)
        assert full and [rid for _, _, rid, _ in sent] == ["c"]
    finally:
        watching.cancel()
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)
        await agent.close()
        await server.stop(0)


async def test_a_second_sidecar_for_a_live_node_waits_and_says_why(
    stack: Stack, tmp_path: Path
) -> None:
    """Two sidecars with one node id fought: each registration withdrew the other's leases.
    The second is refused while the first's session is live, says so in its log, and keeps
    trying: once the first is gone (a crash: its session lapses), it
    registers. A sidecar restarted after a crash is this second sidecar."""
    stack.link.retained(retained_blocks("decode-0", "conv-a", "req-a"))
    [lease] = await eventually(lambda: live_leases(stack.stub))
    first = stack.sidecar.announced["incarnation"]
    log = tmp_path / "second.log"
    socket_path = tmp_path / "second.sock"
    second = sidecar_process(
        stack.registry.address, stack.engine.url, "decode-0", socket_path, log=log
    )
    await second.start()
    link = EngineLink(f"unix:{socket_path}", engine_info("decode-0"))
    link.start()
    try:

        async def refused_twice() -> bool:
            text = log.read_text() if log.exists() else ""
            return text.count("node_in_use") >= 2  # said, and tried again

        await eventually(refused_twice, within=10)
        assert "already registered by a live session" in log.read_text()
        node = (await stack.stub.GetNode(registry_pb2.GetNodeRequest(node_id="decode-0"))).node
        assert node.spec.incarnation == first and node.state == node_pb2.NODE_STATE_READY
        assert [x.lease_id for x in await live_leases(stack.stub)] == [lease.lease_id]

        stack.sidecar.kill()  # the first crashes: the second takes over once its session ends
        stack.sidecar = second  # stopped by the fixture

        async def second_registered() -> bool:
            got = await stack.stub.GetNode(registry_pb2.GetNodeRequest(node_id="decode-0"))
            return (
                got.node.spec.incarnation == second.announced["incarnation"]
                and got.node.state == node_pb2.NODE_STATE_READY
            )

        await eventually(second_registered, within=10)
    finally:
        link.close()
        if stack.sidecar is not second:
            await second.stop()  # the test failed before handing it to the fixture


async def test_a_replaced_engine_s_new_incarnation_ends_the_old_session_first() -> None:
    """Another engine process behind the sidecar means a new incarnation, and the registry
    refuses a new incarnation while the old one's session is live: the sidecar deregisters
    its old incarnation first, so it registers at once rather than after the session TTL
    (here far longer than the test waits)."""
    config = replace(FAST, session_ttl_s=60.0)
    registry = await start_registry(ServerOptions(listen="127.0.0.1:0", config=config))
    async with (
        FakeEngine("decode-0") as engine,
        open_channel(RegistryEndpoint.parse(registry.address)) as channel,
    ):
        stub = registry_stub(channel)
        sidecar = SidecarConfig("decode-0", node_pb2.NODE_ROLE_DECODE, engine.url)
        agent = Agent(sidecar, RegistryEndpoint.parse(registry.address))
        agent.attach_engine(engine_info("decode-0"), [])
        running = asyncio.create_task(agent.run())
        try:
            await asyncio.wait_for(agent.connected.wait(), 10)
            first = agent.incarnation
            replacement = engine_info("decode-0")
            replacement.engine_id = "engine-decode-0-restarted"
            agent.attach_engine(replacement, [])
            assert agent.incarnation != first

            async def registered_anew() -> bool:
                got = await stub.GetNode(registry_pb2.GetNodeRequest(node_id="decode-0"))
                return got.node.spec.incarnation == agent.incarnation and agent.connected.is_set()

            await eventually(registered_anew, within=10)
            in_use = agent.metrics.registry.get_sample_value("kvbroker_sidecar_node_in_use")
            assert in_use == 0  # never refused meanwhile
        finally:
            running.cancel()
            await asyncio.gather(running, return_exceptions=True)
            await agent.close()
            await registry.stop(grace=0.1)


async def test_a_fork_resolves_its_parent_s_prefix_through_its_sidecar(
    stack: Stack, tmp_path: Path
) -> None:
    """Engine → sidecar → registry over real gRPC: a prefill engine's prompt that starts with
    what the decode engine retained for another conversation of its tenant gets that lease,
    pinned (the lease check then says it may be read, shared) until its read ends; another
    tenant's gets nothing."""
    tokens = [(7 * i + 3) % 4000 + 5 for i in range(400)]
    kept = Checkpoints.of(prefix_hashes(tokens, 16, 320))
    retained = retained_blocks("decode-0", "acme/parent", "req-parent", tokens=320)
    retained.block_hashes[:] = kept.hashes
    retained.block_hash_stride = kept.stride
    stack.link.retained(retained)
    [parent] = await eventually(lambda: live_leases(stack.stub))
    full = prefix_hashes(tokens, 16, 399)
    probes = [full[b] for b in probe_blocks(399 // 16)]
    async with FakeEngine("prefill-0") as engine:
        socket_path = tmp_path / "p.sock"
        sidecar = sidecar_process(
            stack.registry.address, engine.url, "prefill-0", socket_path, role="prefill"
        )
        await sidecar.start()
        link = EngineLink(f"unix:{socket_path}", engine_info("prefill-0", port=5602))
        link.start()
        try:
            await eventually(lambda: asyncio.to_thread(link.attached.wait, 0.1))

            async def matched(conversation: str) -> registry_pb2.MatchPrefixResponse | None:
                answer = await asyncio.wrap_future(
                    link.start_prefix_match(conversation, 16, probes, 2.0)
                )
                return answer.match

            fork = await eventually(lambda: matched("acme/fork"))
            assert fork is not None and fork.lease.lease_id == parent.lease_id
            assert fork.matched_blocks == 16
            check = await asyncio.wrap_future(
                link.start_lease_check(parent.lease_id, parent.epoch, 2.0)
            )
            assert check.usable and check.shared, check.reason
            other = await matched("evil/fork")
            assert other is not None and not other.HasField("lease")
            assert other.no_reuse == registry_pb2.NO_REUSE_REASON_NO_PREFIX_MATCH
            [still] = await live_leases(stack.stub)
            assert still.state == lease_pb2.LEASE_STATE_ACTIVE  # the parent's, unchanged
            assert still.HasField("pin_time_to_live")
            link.end_pin(parent.lease_id, fork.pin_id)  # the fork's read is over

            async def unpinned() -> bool:
                [lease] = await live_leases(stack.stub)
                return not lease.HasField("pin_time_to_live")

            await eventually(unpinned)
        finally:
            link.close()
            await sidecar.stop()


async def test_resolve_handle_refuses_a_turn_path_it_does_not_know(stack: Stack) -> None:
    """An unknown turn path (99) is refused naming the field, never answered as a hint."""
    async with grpc.aio.insecure_channel(f"unix:{stack.socket_path}") as channel:
        sidecar = sidecar_pb2_grpc.SidecarServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await sidecar.ResolveHandle(
                sidecar_pb2.ResolveHandleRequest(
                    conversation_id="conv-1",
                    path=cast("registry_pb2.TurnPath", 99),  # as a client's wire can carry
                ),
                timeout=5,
            )
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "path 99" in (refused.value.details() or "")
        # The node's session is up once it holds a lease the registry knows.
        stack.link.retained(retained_blocks("decode-0", "conv-1", "req-1"))
        await eventually(lambda: live_leases(stack.stub), what="the node's session")
        async with Heartbeats(stack.stub, node_spec("prefill-0", node_pb2.NODE_ROLE_PREFILL)):
            known = await sidecar.ResolveHandle(
                sidecar_pb2.ResolveHandleRequest(
                    conversation_id="conv-1", path=registry_pb2.TURN_PATH_DECODE_LOCAL
                ),
                timeout=5,
            )
        # A known path is the registry's to answer: this node holds conv-1's live lease.
        assert known.hint.path == registry_pb2.TURN_PATH_DECODE_LOCAL


@pytest.mark.parametrize("listen", ["0.0.0.0:0", "10.1.2.3:5000", "[::]:0", "node-7:5000"])
async def test_the_sidecar_is_never_served_beyond_its_node(listen: str) -> None:
    """ResolveHandle names any conversation and trusts its caller as the engine: the sidecar
    refuses to listen anywhere but a Unix socket or loopback, in process and on the CLI."""
    config = SidecarConfig("decode-0", node_pb2.NODE_ROLE_DECODE, "http://127.0.0.1:1")
    with pytest.raises(ValueError, match="unix:PATH or a loopback address"):
        await start_sidecar(config, RegistryEndpoint.parse("127.0.0.1:1"), listen)
    refused = await run_cli(
        "sidecar", "run", "--registry", "127.0.0.1:1", "--engine-url", "http://127.0.0.1:1",
        "--role", "decode", "--listen", listen,
    )  # fmt: skip
    assert refused.code == 2
    assert "loopback" in refused.stderr
    for local in ("unix:/tmp/s.sock", "127.0.0.1:5000", "localhost:5000", "[::1]:5000"):
        assert check_local_listen(local) == local
