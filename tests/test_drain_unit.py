"""Draining a decode node, on the registry with a fake clock: no new conversation and no new
turn's decode leg goes there, its unclaimed leases end at once (the holder told to free them
after the grace), claimed reads finish, a lease that turns live there ends too, and the node
is drained once it holds no live lease and a later heartbeat reports nothing running."""

from __future__ import annotations

import pytest

from kvbroker.common.rules.clock import from_duration
from kvbroker.controlplane.api.identity import Principal, Role, authorize
from kvbroker.controlplane.errors import PermissionDenied
from kvbroker.controlplane.records.model import NodeLoad
from kvbroker.controlplane.records.requests import Heartbeat, LeaseListing
from kvbroker.v1 import lease_pb2, node_pb2, registry_pb2
from kvbroker_tools.harness.factories import node_spec
from tests.test_registry_unit import CONFIG, Harness

ACTIVE = lease_pb2.LEASE_STATE_ACTIVE
CLAIMED = lease_pb2.LEASE_STATE_CLAIMED
REVOKED = lease_pb2.LEASE_STATE_REVOKED
DRAINED = lease_pb2.LEASE_END_CAUSE_DRAINED
REUSE = registry_pb2.HINT_DECISION_REUSE
RECOMPUTE = registry_pb2.HINT_DECISION_RECOMPUTE
MISS = registry_pb2.HINT_DECISION_MISS


class DrainHarness(Harness):
    """The harness's decode-0 and prefill-0, plus decode-1 to take the turns over."""

    def __init__(self) -> None:
        super().__init__()
        self.other = node_spec("decode-1", port=5800)

    async def fleet(self) -> None:
        await super().fleet()
        await self.registry.register_node(self.other)

    async def tick(self, seconds: float, running: int = 0) -> None:
        """Moves the clock, applies due deadlines, and every node heartbeats (decode-0 with
        ``running`` requests)."""
        self.clock.t += seconds
        registry = self.registry
        await registry._on_deadlines(registry._deadlines.pop_due(10_000))
        load = NodeLoad(running_requests=running)
        await registry.heartbeat(
            Heartbeat(self.decode.node_id, self.decode.incarnation, True, load)
        )
        await self.heartbeat(self.prefill, self.other)

    async def drained(self) -> bool:
        return (await self.registry.get_node(self.decode.node_id)).drained


async def test_a_drain_ends_unclaimed_leases_lets_claimed_reads_finish_and_routes_away() -> None:
    h = DrainHarness()
    await h.fleet()
    idle = await h.grant("idle", "req-1", ttl=600)
    reading = await h.grant("reading", "req-2", ttl=600)
    hint = await h.registry.routing_hint("reading", "")  # a read in flight
    assert hint.decision == REUSE and hint.decode.node_id == h.decode.node_id

    node = await h.registry.drain_node(h.decode.node_id)
    assert node.state == node_pb2.NODE_STATE_DRAINING and not node.drained
    assert node.live_leases == 1  # the claimed read's

    ended = await h.registry.get_lease(idle.lease_id)
    assert (ended.state, ended.end_cause) == (REVOKED, DRAINED)
    command = await h.next_command()  # the holder frees it after the grace, as on a revoke
    assert command.lease_id == idle.lease_id and command.cause == DRAINED
    assert from_duration(command.time_to_live) == pytest.approx(CONFIG.revoke_grace_s)
    assert (await h.registry.get_lease(reading.lease_id)).state == CLAIMED

    # Its conversation's next turn recomputes on the other decode node; so does a new one.
    again = await h.registry.routing_hint("idle", "")
    assert again.decision == RECOMPUTE and "DRAINED" in again.reason
    assert again.decode.node_id == h.other.node_id
    for turn in range(4):
        fresh = await h.registry.routing_hint(f"new-{turn}", "")
        assert fresh.decision == MISS and fresh.decode.node_id == h.other.node_id

    # Not drained while the read's lease lives, nor while a request runs there.
    await h.tick(1.0)
    assert not await h.drained()
    await h.registry.release_lease(reading.lease_id, h.decode.node_id, h.decode.incarnation, "read")
    await h.tick(1.0, running=1)  # the read's turn decoding there
    assert not await h.drained()
    h.clock.t += 0.1
    await h.registry.heartbeat(Heartbeat(h.decode.node_id, h.decode.incarnation, True, NodeLoad()))
    assert await h.drained()
    listed = await h.registry.list_leases(LeaseListing(node_id=h.decode.node_id))
    assert listed == ([], "")


async def test_drained_needs_a_heartbeat_after_the_last_lease_ended() -> None:
    """A zero load reported before the last lease ended says nothing about the decode leg
    that follows the read: it takes a heartbeat at least ``drain_quiet_s`` later."""
    h = DrainHarness()
    await h.fleet()
    lease = await h.grant("c", "req-1", ttl=600)
    await h.registry.routing_hint("c", "")
    await h.registry.drain_node(h.decode.node_id)
    await h.tick(1.0)
    await h.registry.release_lease(lease.lease_id, h.decode.node_id, h.decode.incarnation, "")
    assert not await h.drained()  # the last heartbeat came before the release
    h.clock.t += CONFIG.drain_quiet_s / 2
    await h.registry.heartbeat(Heartbeat(h.decode.node_id, h.decode.incarnation, True, NodeLoad()))
    assert not await h.drained()
    await h.tick(CONFIG.drain_quiet_s)
    assert await h.drained()


async def test_a_claim_that_ends_unread_on_a_draining_node_ends_the_lease() -> None:
    h = DrainHarness()
    await h.fleet()
    lease = await h.grant("c", "req-1", ttl=600)
    await h.registry.routing_hint("c", "")
    await h.registry.drain_node(h.decode.node_id)
    for _ in range(int(CONFIG.claim_timeout_s / 2) + 1):
        await h.tick(2.0)
    ended = await h.registry.get_lease(lease.lease_id)
    assert (ended.state, ended.end_cause) == (REVOKED, DRAINED)
    await h.tick(1.0)
    assert await h.drained()


async def test_a_turn_that_finishes_on_a_draining_node_is_not_offered() -> None:
    """A decode leg already running when the drain began retains its KV: the lease is granted
    (the conversation's epoch moves on) and ended at once, the engine told to free it."""
    h = DrainHarness()
    await h.fleet()
    await h.registry.drain_node(h.decode.node_id)
    late = await h.grant("c", "req-1", ttl=600)
    assert (late.state, late.end_cause) == (REVOKED, DRAINED)
    command = await h.next_command()
    assert command.lease_id == late.lease_id and command.state == REVOKED
    hint = await h.registry.routing_hint("c", "")
    assert hint.decision == RECOMPUTE and hint.decode.node_id == h.other.node_id
    node = await h.registry.get_node(h.decode.node_id)
    assert node.live_leases == 0


async def test_draining_again_keeps_the_drain_and_a_node_may_drain_only_itself() -> None:
    h = DrainHarness()
    await h.fleet()
    await h.registry.drain_node(h.decode.node_id)
    await h.tick(1.0)
    assert await h.drained()
    again = await h.registry.drain_node(h.decode.node_id)
    assert again.state == node_pb2.NODE_STATE_DRAINING and again.drained
    node = Principal(Role.NODE, "decode-0")
    authorize(node, "DrainNode", registry_pb2.DrainNodeRequest(node_id="decode-0"))
    with pytest.raises(PermissionDenied):
        authorize(node, "DrainNode", registry_pb2.DrainNodeRequest(node_id="decode-1"))
