"""The one routing rule, on plain nodes: candidates, the least-loaded pick, the holder kept, and
the reuse decision."""

from __future__ import annotations

import pytest

from kvbroker.common.rules import routing
from kvbroker.v1 import lease_pb2, node_pb2, registry_pb2
from kvbroker_tools.harness.factories import node_spec

PREFILL = node_pb2.NODE_ROLE_PREFILL
DECODE = node_pb2.NODE_ROLE_DECODE


def node(
    node_id: str,
    role: node_pb2.NodeRole = DECODE,
    queued: int = 0,
    state: node_pb2.NodeState = node_pb2.NODE_STATE_READY,
    model: str = "m",
    retains: bool = True,
) -> routing.RoutedNode[node_pb2.Node]:
    spec = node_spec(node_id, role, model=model)
    if not retains:
        spec.kv_retention = node_pb2.KV_RETENTION_OFF
    listed = node_pb2.Node(spec=spec, state=state)
    routed = routing.RoutedNode(listed)
    routed.queued = queued
    return routed


def test_candidates_are_ready_nodes_of_the_model_by_role() -> None:
    nodes = [
        node("p0", PREFILL),
        node("p1", PREFILL, state=node_pb2.NODE_STATE_NOT_READY),
        node("p2", PREFILL, model="other"),
        node("d0"),
        node("d1", state=node_pb2.NODE_STATE_DRAINING),
        node("both", node_pb2.NODE_ROLE_BOTH),
    ]
    routes = routing.candidates(nodes, "m")
    assert [n.node_id for n in routes.prefills] == ["p0", "both"]
    assert [n.node_id for n in routes.decodes] == ["d0", "both"]
    assert len(routing.candidates(nodes, "").prefills) == 3  # any model


def test_no_ready_node_names_the_missing_role() -> None:
    with pytest.raises(routing.NoReadyNode) as missing_prefill:
        routing.candidates([node("d0")], "m")
    assert missing_prefill.value.role == "prefill"
    assert missing_prefill.value.message == "no ready prefill node serves model 'm'"
    with pytest.raises(routing.NoReadyNode) as missing_decode:
        routing.candidates([node("p0", PREFILL)], "")
    assert missing_decode.value.role == "decode"
    assert missing_decode.value.message == "no ready decode node serves any model"


def test_pick_takes_the_least_queued_then_the_most_headroom() -> None:
    busy, idle = node("busy", queued=3), node("idle", queued=1)
    idle.assigned_since_heartbeat = 1  # still less than busy's 3
    assert routing.pick([busy, idle], turn=0) is idle
    idle.assigned_since_heartbeat = 5
    assert routing.pick([busy, idle], turn=0) is busy
    full, empty = node("full"), node("empty")
    full.kv_usage = 0.1
    full.retained_blocks = full.spec.capacity_blocks // 2  # retention counts as usage
    assert routing.pick([full, empty], turn=0) is empty


def test_ties_rotate_with_the_turn() -> None:
    nodes = [node("a"), node("b"), node("c")]
    assert [routing.pick(nodes, turn).node_id for turn in range(4)] == ["a", "b", "c", "a"]


def test_the_holder_is_kept_only_while_it_is_a_candidate() -> None:
    routes = routing.candidates([node("p0", PREFILL), node("d0"), node("holder", queued=9)], "m")
    prefill, decode = routing.choose(routes, 0, holder="holder")
    assert (prefill.node_id, decode.node_id) == ("p0", "holder")
    assert routing.choose(routes, 0, holder="gone")[1].node_id == "d0"


def test_a_conversation_goes_to_a_retaining_decode_node_as_free_as_any() -> None:
    """A fleet half retaining (a rollout of reuse): retention on the retaining node is a cache
    that yields, so it does not push a conversation onto the node that keeps nothing; a turn
    without a conversation goes by headroom as before; queued work still comes first."""
    retaining, keeps_nothing = node("d-on"), node("d-off", retains=False)
    retaining.retained_blocks = retaining.spec.capacity_blocks // 2
    routes = routing.candidates([node("p0", PREFILL), keeps_nothing, retaining], "m")
    for turn in range(4):
        assert routing.choose(routes, turn, conversation=True)[1] is retaining
        assert routing.choose(routes, turn)[1] is keeps_nothing
    retaining.queued = routing.RETAINING_PREFERENCE  # a request or two is counting noise
    assert routing.choose(routes, 0, conversation=True)[1] is retaining
    retaining.queued += 1
    assert routing.choose(routes, 0, conversation=True)[1] is keeps_nothing


def test_a_holder_that_retains_nothing_does_not_keep_its_conversation() -> None:
    """A conversation that landed on a node that retains nothing (its retaining peer was busy)
    moves to a retaining node once that is as free: staying would make every turn a MISS."""
    busy = routing.RETAINING_PREFERENCE + 1
    retaining, keeps_nothing = node("d-on", queued=busy), node("d-off", retains=False)
    routes = routing.candidates([node("p0", PREFILL), keeps_nothing, retaining], "m")
    assert routing.choose(routes, 0, holder="d-off", conversation=True)[1] is keeps_nothing
    retaining.queued = 0
    assert routing.choose(routes, 0, holder="d-off", conversation=True)[1] is retaining
    keeps_nothing.queued = 0
    retaining.queued = 5  # a retaining holder is kept however busy (its KV is there)
    assert routing.choose(routes, 0, holder="d-on", conversation=True)[1] is retaining


def test_many_candidates_never_pick_the_one_overloaded_node() -> None:
    nodes = [node(f"d{i}") for i in range(routing.EXACT_PICK_LIMIT + 4)]
    nodes[3].queued = 100
    chosen = {routing.pick(nodes, turn).node_id for turn in range(300)}
    assert "d3" not in chosen
    assert len(chosen) > 2  # two random choices spread the load


def test_a_draining_decode_node_takes_no_new_turn_not_even_its_own_conversation_s() -> None:
    nodes = [
        node("p0", PREFILL),
        node("d0", state=node_pb2.NODE_STATE_DRAINING),
        node("d1", queued=50),
    ]
    routes = routing.candidates(nodes, "m")
    for turn in range(4):
        _, decode = routing.choose(routes, turn, holder="d0")
        assert decode.node_id == "d1"  # the busier READY node, never the draining holder
    with pytest.raises(routing.NoReadyNode, match="decode"):
        routing.candidates([node("p0", PREFILL), nodes[1]], "m")


def test_a_listed_node_routes_on_its_reported_load_and_retention() -> None:
    listed = node_pb2.Node(
        spec=node_spec("d0"),
        state=node_pb2.NODE_STATE_DRAINING,
        load=node_pb2.NodeLoad(running_requests=2, waiting_requests=3, kv_cache_usage=0.25),
        retained_blocks=1024,
    )
    routed = routing.RoutedNode.of_node(listed)
    assert (routed.queued, routed.kv_usage, routed.retained_fraction) == (5, 0.25, 0.25)
    assert routed.decodes and not routed.prefills
    assert not routing.routable(routed, "")


def lease(
    state: lease_pb2.LeaseState = lease_pb2.LEASE_STATE_ACTIVE,
    end_cause: lease_pb2.LeaseEndCause = lease_pb2.LEASE_END_CAUSE_UNSPECIFIED,
    end_reason: str = "",
) -> lease_pb2.Lease:
    return lease_pb2.Lease(
        lease_id="l1",
        node_id="d0",
        epoch=2,
        token_count=64,
        state=state,
        end_cause=end_cause,
        end_reason=end_reason,
    )


CONVERSATION = lease_pb2.Conversation(conversation_id="c", lease_id="l1")
REUSE = registry_pb2.HINT_DECISION_REUSE
RECOMPUTE = registry_pb2.HINT_DECISION_RECOMPUTE
MISS = registry_pb2.HINT_DECISION_MISS


@pytest.mark.parametrize(
    ("conversation_id", "conversation", "current", "holder", "replayed", "expected", "phrase"),
    [
        ("", None, None, None, True, MISS, "no conversation id"),
        ("c", None, None, None, True, MISS, "first turn"),
        ("c", CONVERSATION, None, None, True, MISS, "nothing retained"),
        (
            "c",
            CONVERSATION,
            lease(
                lease_pb2.LEASE_STATE_EXPIRED,
                end_cause=lease_pb2.LEASE_END_CAUSE_IDLE,
                end_reason="not renewed in time",
            ),
            node("d0"),
            True,
            RECOMPUTE,
            "ended (IDLE): not renewed in time",
        ),
        (
            "c",
            CONVERSATION,
            lease(lease_pb2.LEASE_STATE_CLAIMED),
            node("d0"),
            True,
            RECOMPUTE,
            "claimed by a read in flight",
        ),
        ("c", CONVERSATION, lease(), None, True, RECOMPUTE, "is gone"),
        (
            "c",
            CONVERSATION,
            lease(),
            node("d0", state=node_pb2.NODE_STATE_DOWN),
            True,
            RECOMPUTE,
            "is DOWN",
        ),
        ("c", CONVERSATION, lease(), node("d0"), True, REUSE, "(epoch 2) on d0 holds 64 tokens"),
        (
            "c",
            CONVERSATION,
            lease(),
            node("d0", state=node_pb2.NODE_STATE_DRAINING),
            True,
            RECOMPUTE,
            "is DRAINING",
        ),
    ],
)
def test_reuse_decision(
    conversation_id: str,
    conversation: lease_pb2.Conversation | None,
    current: lease_pb2.Lease | None,
    holder: routing.RoutedNode[node_pb2.Node] | None,
    replayed: bool,
    expected: int,
    phrase: str,
) -> None:
    reuse = routing.reuse_decision(conversation_id, conversation, current, holder, replayed)
    assert reuse.decision == expected
    assert phrase in reuse.reason
    assert reuse.exact
    assert reuse.reuses == (expected == REUSE)


def test_a_holder_that_has_not_replayed_is_not_vouched_for() -> None:
    reuse = routing.reuse_decision("c", CONVERSATION, lease(), node("d0"), holder_replayed=False)
    assert reuse.decision == RECOMPUTE and not reuse.exact
    assert "has not replayed" in reuse.reason


def test_without_a_leader_nothing_is_reused() -> None:
    known = routing.leaderless_decision(conversation_known=True, why="election pending")
    assert known.decision == RECOMPUTE and not known.exact
    assert "election pending" in known.reason
    assert routing.leaderless_decision(False, "x").decision == MISS


def test_only_a_claimed_lease_at_the_handle_s_epoch_may_be_read() -> None:
    claimed = lease_pb2.Lease(lease_id="l-1", epoch=3, state=lease_pb2.LEASE_STATE_CLAIMED)
    assert routing.read_refusal(claimed, 3) is None
    assert "stale epoch 2" in (routing.read_refusal(claimed, 2) or "")
    active = lease_pb2.Lease(lease_id="l-1", epoch=3, state=lease_pb2.LEASE_STATE_ACTIVE)
    assert routing.read_refusal(active, 3) == "lease l-1 is ACTIVE: its claim ended"
    released = lease_pb2.Lease(
        lease_id="l-1", epoch=3, state=lease_pb2.LEASE_STATE_RELEASED, end_reason="pressure"
    )
    assert routing.read_refusal(released, 3) == "lease l-1 is RELEASED (pressure)"
