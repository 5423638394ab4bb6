"""The registry's parts on an injected fake clock and the memory store, without a server: lease
expiry, claim deadlines, session deadlines, superseding, typed errors, and a takeover's
replay. Deadlines are applied by hand as the clock moves (the deadline task is not started)."""

from __future__ import annotations

import asyncio

import pytest

from kvbroker.common.rules.clock import from_duration
from kvbroker.controlplane.api import convert
from kvbroker.controlplane.config import RegistryConfig
from kvbroker.controlplane.deadlines import DeadlineKind
from kvbroker.controlplane.errors import LeaseEnded, NodeNotRegistered, NoReadyNode, SessionLost
from kvbroker.controlplane.metrics import RegistryMetrics
from kvbroker.controlplane.records.answers import LeaseAnswer
from kvbroker.controlplane.records.lease_ids import TERM_SHIFT, next_epoch
from kvbroker.controlplane.records.model import NodeLoad
from kvbroker.controlplane.records.requests import Heartbeat, LeaseGrant, RetentionReport
from kvbroker.controlplane.registry import Registry
from kvbroker.controlplane.storage.cached_store import MemoryStore
from kvbroker.v1 import lease_pb2, node_pb2, registry_pb2
from kvbroker_tools.harness.factories import ManualClock, block_hashes, handle, node_spec, replayed
from tests.conftest import eventually

CONFIG = RegistryConfig(
    default_lease_ttl_s=60.0,
    learn_idle_ttl=False,
    claim_timeout_s=30.0,
    revoke_grace_s=2.0,
    heartbeat_interval_s=2.0,
    session_ttl_s=6.0,
)
ACTIVE = lease_pb2.LEASE_STATE_ACTIVE
CLAIMED = lease_pb2.LEASE_STATE_CLAIMED


class Harness:
    """A registry on a manual clock and the memory store, with one decode and one prefill node
    to register (``fleet``): the registry-unit tests' own, and the base of other modules'."""

    def __init__(self, store: MemoryStore | None = None, config: RegistryConfig = CONFIG) -> None:
        self.clock = ManualClock()
        self.store = store or MemoryStore()
        self.registry = Registry(self.store, config, clock=self.clock)
        self.decode = node_spec("decode-0")
        self.prefill = node_spec("prefill-0", node_pb2.NODE_ROLE_PREFILL, port=5700)

    async def fleet(self) -> None:
        for spec in (self.decode, self.prefill):
            await self.registry.register_node(spec)

    async def advance(
        self, seconds: float, beating: tuple[node_pb2.NodeSpec, ...] | None = None
    ) -> None:
        """Moves the clock in heartbeat-sized steps, applying every deadline due as the
        deadline task would; ``beating`` nodes (default: both) heartbeat at each step."""
        beating = (self.decode, self.prefill) if beating is None else beating
        end = self.clock.t + seconds
        while self.clock.t < end:
            self.clock.t = min(self.clock.t + self.registry.config.heartbeat_interval_s, end)
            registry = self.registry
            await registry._on_deadlines(registry._deadlines.pop_due(10_000))
            await self.heartbeat(*beating)

    async def grant(
        self, conversation: str, request_id: str, ttl: float | None = None
    ) -> LeaseAnswer:
        return await self.registry.grant_lease(
            LeaseGrant(
                conversation,
                self.decode.node_id,
                self.decode.incarnation,
                handle(request_id, 64, self.decode),
                block_hashes(64),
                64,
                ttl,
            )
        )

    async def heartbeat(self, *specs: node_pb2.NodeSpec) -> None:
        for spec in specs:
            await self.registry.heartbeat(
                Heartbeat(spec.node_id, spec.incarnation, True, NodeLoad())
            )

    async def next_command(self) -> registry_pb2.LeaseCommand:
        commands = self.registry.watch_commands(self.decode.node_id, self.decode.incarnation)
        return await asyncio.wait_for(anext(commands), 1)


async def test_a_lease_expires_when_its_ttl_runs_out() -> None:
    h = Harness()
    await h.fleet()
    lease = await h.grant("c", "req-1", ttl=10)
    assert lease.time_to_live == pytest.approx(10)
    await h.advance(9.9)
    assert (await h.registry.get_lease(lease.lease_id)).state == ACTIVE
    await h.advance(0.2)
    ended = await h.registry.get_lease(lease.lease_id)
    assert ended.state == lease_pb2.LEASE_STATE_EXPIRED
    assert ended.end_cause == lease_pb2.LEASE_END_CAUSE_IDLE
    command = await h.next_command()
    assert command.lease_id == lease.lease_id and from_duration(command.time_to_live) == 0
    with pytest.raises(LeaseEnded) as error:
        await h.registry.renew_lease(lease.lease_id)
    assert error.value.reason == registry_pb2.ERROR_REASON_LEASE_ENDED


async def test_no_lease_outlives_the_holder_engine_s_hard_cap() -> None:
    """The engine frees retained blocks at its hard cap whatever the lease says: the idle TTL,
    a turn's requested TTL and a keep-alive are all bounded by it, so no hint offers blocks
    the engine has already given to new work."""
    h = Harness()
    h.decode.retention_hard_cap.FromSeconds(45)
    await h.fleet()
    idle = await h.grant("c", "req-1")
    assert idle.time_to_live == pytest.approx(45)
    asked = await h.grant("d", "req-2", ttl=600)
    assert asked.time_to_live == pytest.approx(45)
    kept = await h.registry.renew_lease(asked.lease_id, ttl=3600)
    assert kept.time_to_live == pytest.approx(45)
    short = await h.grant("e", "req-3", ttl=10)
    assert short.time_to_live == pytest.approx(10)
    await h.advance(45.1)
    assert (await h.registry.get_lease(kept.lease_id)).state == lease_pb2.LEASE_STATE_EXPIRED


async def test_expiry_is_checked_on_read_even_before_the_deadline_task_runs() -> None:
    h = Harness()
    await h.fleet()
    lease = await h.grant("c", "req-1", ttl=10)
    h.clock.t += 11  # no deadline applied
    hint = await h.registry.routing_hint("c", "")
    assert hint.decision == registry_pb2.HINT_DECISION_RECOMPUTE
    assert "not renewed in time" in hint.reason
    assert (await h.registry.get_lease(lease.lease_id)).state == lease_pb2.LEASE_STATE_EXPIRED


async def test_a_claim_holds_off_other_reads_until_it_ends() -> None:
    h = Harness()
    await h.fleet()
    lease = await h.grant("c", "req-1", ttl=600)
    first = await h.registry.routing_hint("c", "")
    assert first.decision == registry_pb2.HINT_DECISION_REUSE
    assert (await h.registry.get_lease(lease.lease_id)).state == CLAIMED
    await h.advance(1)
    second = await h.registry.routing_hint("c", "", dry_run=True)
    assert second.decision == registry_pb2.HINT_DECISION_RECOMPUTE
    assert "claimed" in second.reason
    await h.advance(CONFIG.claim_timeout_s)
    assert (await h.registry.get_lease(lease.lease_id)).state == ACTIVE
    again = await h.registry.routing_hint("c", "", dry_run=True)
    assert again.decision == registry_pb2.HINT_DECISION_REUSE


async def test_a_claim_outlives_a_shorter_ttl_and_tells_the_holder() -> None:
    h = Harness()
    await h.fleet()
    lease = await h.grant("c", "req-1", ttl=5)
    await h.registry.routing_hint("c", "")
    command = await h.next_command()
    assert command.reason == "claimed by a read"
    assert from_duration(command.time_to_live) == pytest.approx(CONFIG.claim_timeout_s)
    await h.advance(10)  # past the TTL, within the claim
    assert (await h.registry.get_lease(lease.lease_id)).state == CLAIMED
    await h.advance(CONFIG.claim_timeout_s)
    assert (await h.registry.get_lease(lease.lease_id)).state == lease_pb2.LEASE_STATE_EXPIRED


async def test_a_claim_never_outlasts_the_holder_s_hard_cap() -> None:
    h = Harness()
    h.decode.retention_hard_cap.FromSeconds(20)  # below the 30 s claim timeout
    await h.fleet()
    lease = await h.grant("c", "req-1", ttl=5)
    await h.registry.routing_hint("c", "")
    command = await h.next_command()
    assert command.reason == "claimed by a read"
    assert from_duration(command.time_to_live) == pytest.approx(20)
    await h.advance(20.1)
    assert (await h.registry.get_lease(lease.lease_id)).state == lease_pb2.LEASE_STATE_EXPIRED


async def test_a_new_turn_supersedes_the_lease_with_a_grace_for_reads() -> None:
    h = Harness()
    await h.fleet()
    first = await h.grant("c", "req-1")
    second = await h.grant("c", "req-2")
    assert second.epoch == first.epoch + 1
    old = await h.registry.get_lease(first.lease_id)
    assert old.state == lease_pb2.LEASE_STATE_REVOKED
    assert old.end_cause == lease_pb2.LEASE_END_CAUSE_SUPERSEDED
    command = await h.next_command()
    assert command.lease_id == first.lease_id
    assert from_duration(command.time_to_live) == pytest.approx(CONFIG.revoke_grace_s)


async def test_a_silent_node_loses_its_session_and_its_leases() -> None:
    h = Harness()
    await h.fleet()
    lease = await h.grant("c", "req-1")
    await h.advance(CONFIG.session_ttl_s - 1)
    await h.advance(CONFIG.session_ttl_s + 1, beating=(h.prefill,))
    node = await h.registry.get_node(h.decode.node_id)
    assert node.state == node_pb2.NODE_STATE_DOWN
    assert (await h.registry.get_node(h.prefill.node_id)).state == node_pb2.NODE_STATE_READY
    ended = await h.registry.get_lease(lease.lease_id)
    assert ended.end_cause == lease_pb2.LEASE_END_CAUSE_NODE_LOST
    with pytest.raises(SessionLost) as error:
        await h.heartbeat(h.decode)
    assert error.value.reason == registry_pb2.ERROR_REASON_SESSION_LOST
    with pytest.raises(NoReadyNode) as no_route:
        await h.registry.routing_hint("c", "")
    assert no_route.value.reason == registry_pb2.ERROR_REASON_NO_READY_NODE
    assert no_route.value.message == "no ready decode node serves any model"


async def _holding_the_lock(h: Harness, done: asyncio.Event) -> asyncio.Task[None]:
    """A stand-in for a long report: holds the registry's lock until ``done`` is set."""

    async def long_report() -> None:
        async with h.registry._mutation:
            await done.wait()

    report = asyncio.create_task(long_report())
    await _queued_on_the_lock(h, 0)  # it holds the lock
    return report


async def _queued_on_the_lock(h: Harness, waiting: int) -> None:
    """Returns once the registry's lock is held and ``waiting`` tasks wait for it."""
    lock = h.registry._mutation._lock
    await eventually(lambda: lock.locked() and len(lock._waiters or ()) == waiting)


async def _decode_kept_and_prefill_lost(h: Harness, lease_id: str) -> None:
    assert (await h.registry.get_node(h.decode.node_id)).state == node_pb2.NODE_STATE_READY
    assert (await h.registry.get_lease(lease_id)).state == ACTIVE
    assert (await h.registry.get_node(h.prefill.node_id)).state == node_pb2.NODE_STATE_DOWN


async def test_a_heartbeat_that_waited_for_the_lock_ahead_of_its_due_session_keeps_it() -> None:
    """A report holds the registry's lock; a node's heartbeat waits for it, then its session
    deadline falls due and the deadline task waits behind the heartbeat. The heartbeat renews
    the session first, so the deadline popped before it must end nothing; a node that sent
    none is still marked down."""
    h = Harness()
    await h.fleet()
    lease = await h.grant("c", "req-1")
    report_done = asyncio.Event()
    report = await _holding_the_lock(h, report_done)
    beat = asyncio.create_task(h.heartbeat(h.decode))
    await _queued_on_the_lock(h, 1)  # the heartbeat waits for it
    h.clock.t += CONFIG.session_ttl_s + 1
    due = h.registry._deadlines.pop_due(10_000)
    assert sorted(due) == sorted(
        (DeadlineKind.NODE_SESSION, spec.node_id) for spec in (h.decode, h.prefill)
    )
    expiries = asyncio.create_task(h.registry._on_deadlines(due))
    await _queued_on_the_lock(h, 2)  # the deadlines wait behind the heartbeat
    report_done.set()
    await asyncio.gather(report, beat, expiries)
    await _decode_kept_and_prefill_lost(h, lease.lease_id)


async def test_heartbeats_waiting_behind_a_long_report_keep_their_sessions() -> None:
    """A report holds the registry's lock past the session TTL (a fleet's replays) while a
    node's heartbeats arrive on time and wait for it: each moves its session's deadline as it
    arrives, so none falls due; a node that sent none loses its session once the lock is free."""
    h = Harness()
    await h.fleet()
    lease = await h.grant("c", "req-1")
    report_done = asyncio.Event()
    report = await _holding_the_lock(h, report_done)
    beats = []
    for waiting in range(1, 5):  # 8 s of heartbeats every 2 s, past the 6 s TTL
        h.clock.t += CONFIG.heartbeat_interval_s
        beats.append(asyncio.create_task(h.heartbeat(h.decode)))
        await _queued_on_the_lock(h, waiting)  # it arrives, and waits for the lock
    due = h.registry._deadlines.pop_due(10_000)
    assert due == [(DeadlineKind.NODE_SESSION, h.prefill.node_id)]
    expiries = asyncio.create_task(h.registry._on_deadlines(due))
    await _queued_on_the_lock(h, 5)
    report_done.set()
    await asyncio.gather(report, *beats, expiries)
    await _decode_kept_and_prefill_lost(h, lease.lease_id)


async def test_ended_leases_and_idle_conversations_are_forgotten() -> None:
    h = Harness()
    await h.fleet()
    lease = await h.grant("c", "req-1")
    await h.registry.revoke_lease(lease.lease_id, reason="closed")
    await h.advance(CONFIG.ended_lease_retention_s + 1, beating=())
    assert await h.store.get_lease(lease.lease_id) is None
    assert await h.store.get_conversation("c") is not None
    await h.advance(CONFIG.conversation_retention_s, beating=())
    assert await h.store.get_conversation("c") is None


async def test_a_successor_offers_a_holder_s_leases_only_after_its_replay() -> None:
    h = Harness()
    await h.fleet()
    lease = await h.grant("c", "req-1")
    metrics = RegistryMetrics()
    successor = Registry(h.store, CONFIG, metrics, clock=h.clock)
    await successor.restore()
    hint = await successor.routing_hint("c", "", dry_run=True)
    assert hint.decision == registry_pb2.HINT_DECISION_RECOMPUTE
    assert hint.consistency == registry_pb2.HINT_CONSISTENCY_DEGRADED
    # Both nodes wait for their replay (the prefill node's is as empty as its retention).
    assert metrics.registry.get_sample_value("kvbroker_nodes_awaiting_replay") == 2
    replay = replayed(convert.lease_message(lease))
    response = await successor.report_retention(
        RetentionReport(h.decode.node_id, h.decode.incarnation, [replay], full_snapshot=True)
    )
    assert metrics.registry.get_sample_value("kvbroker_nodes_awaiting_replay") == 1
    assert [ack.lease_id for ack in response.leases] == [lease.lease_id]
    hint = await successor.routing_hint("c", "", dry_run=True)
    assert hint.decision == registry_pb2.HINT_DECISION_REUSE
    assert hint.consistency == registry_pb2.HINT_CONSISTENCY_EXACT
    figures = {f.node_id: f for f in successor.nodes.figures()}
    assert figures[h.decode.node_id].live_leases == 1


def test_epochs_rise_within_a_term_and_every_later_term_outranks_the_earlier() -> None:
    assert next_epoch(0, 0) == 1 and next_epoch(5, 0) == 6
    floor = 3 << TERM_SHIFT
    assert next_epoch(5, 3) == floor  # a conversation from before term 3
    assert next_epoch(floor + 7, 3) == floor + 8
    # The highest epoch term 3 could grant is below term 4's first.
    assert next_epoch(0, 4) > (4 << TERM_SHIFT) - 1 >= next_epoch(floor, 3)
    # A conversation whose epoch came from a later term still only rises.
    assert next_epoch(5 << TERM_SHIFT, 4) == (5 << TERM_SHIFT) + 1


async def test_after_a_restart_a_new_grant_fences_an_older_replay() -> None:
    """A restarted registry remembers nothing (the memory store; a successor replica alike):
    a new turn granted before the old holder replays outranks the old lease by its term, so
    the late replay is fenced rather than superseding the newer turn (with epochs counted
    from the conversation's alone both were epoch 1, and the replay won)."""
    clock = ManualClock()
    decodes = [node_spec("decode-0"), node_spec("decode-1", port=5601)]

    async def started(term: int) -> Registry:
        registry = Registry(MemoryStore(), CONFIG, clock=clock, term=term)
        for spec in decodes:
            await registry.register_node(spec)
        return registry

    async def grant(registry: Registry, spec: node_pb2.NodeSpec, request: str) -> LeaseAnswer:
        return await registry.grant_lease(
            LeaseGrant(
                "c",
                spec.node_id,
                spec.incarnation,
                handle(request, 64, spec),
                block_hashes(64),
                64,
            )
        )

    old = await grant(await started(term=2), decodes[0], "req-1")
    restarted = await started(term=3)
    new = await grant(restarted, decodes[1], "req-2")
    assert new.epoch > old.epoch
    replay = replayed(convert.lease_message(old))
    answer = await restarted.report_retention(
        RetentionReport(decodes[0].node_id, decodes[0].incarnation, [replay], full_snapshot=True)
    )
    assert answer.leases[0].state == lease_pb2.LEASE_STATE_REVOKED
    assert "fenced" in answer.leases[0].end_reason
    assert (await restarted.get_conversation("c")).lease_id == new.lease_id
    assert (await restarted.get_lease(new.lease_id)).state == ACTIVE


async def test_a_node_down_past_the_retention_is_forgotten_with_its_series() -> None:
    """Node ids that come and go (pods with new names) do not stay as DOWN entries and metric
    series forever; one that comes back in time is kept."""
    h = Harness()
    await h.fleet()
    await h.grant("c", "req-1")
    returning = node_spec("decode-1", port=5601)
    await h.registry.register_node(returning)
    await h.advance(CONFIG.session_ttl_s + 1, beating=(h.prefill,))
    for spec in (h.decode, returning):
        assert (await h.registry.get_node(spec.node_id)).state == node_pb2.NODE_STATE_DOWN
    await h.advance(CONFIG.forget_down_nodes_after_s / 2, beating=(h.prefill,))
    returning.incarnation = "back"
    await h.registry.register_node(returning)
    await h.advance(CONFIG.forget_down_nodes_after_s / 2 + 10, beating=(h.prefill, returning))

    with pytest.raises(NodeNotRegistered):
        await h.registry.get_node(h.decode.node_id)
    assert {n.spec.node_id for n in await h.registry.list_nodes()} == {"prefill-0", "decode-1"}
    assert h.decode.node_id not in h.registry.nodes.runtime
    series = {
        sample.labels.get("node")
        for family in h.registry.metrics.registry.collect()
        for sample in family.samples
    }
    assert h.decode.node_id not in series and "decode-1" in series
