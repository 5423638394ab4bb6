"""Turns in flight, on a registry served for real on loopback: a hint never waits for a report
that cannot come or past its caller's deadline, a turn's load leaves its prefill node when the
turn ends, and only the node a turn was routed to may lease its conversation."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator

import grpc
import pytest

from kvbroker.common.client.grpc_client import RegistryEndpoint, open_channel, registry_stub
from kvbroker.controlplane.server import RunningRegistry, ServerOptions, start_registry
from kvbroker.v1 import node_pb2, registry_pb2
from kvbroker.v1.registry_pb2_grpc import RegistryServiceStub
from kvbroker_tools.harness.factories import grant, node_spec, register
from tests.conftest import FAST, eventually

PREFILL = node_pb2.NODE_ROLE_PREFILL
# Long enough that a hint which waited for it would fail its caller: what bounds a wait here
# is the caller's deadline, or nothing to wait for.
SLOW_SETTLE = dataclasses.replace(FAST, turn_settle_timeout_s=30.0)


@pytest.fixture
async def slow_settle() -> AsyncIterator[tuple[RunningRegistry, RegistryServiceStub]]:
    running = await start_registry(
        ServerOptions(listen="127.0.0.1:0", metrics_listen="127.0.0.1:0", config=SLOW_SETTLE)
    )
    async with open_channel(RegistryEndpoint.parse(running.address)) as channel:
        yield running, registry_stub(channel)
    await running.stop(grace=0.1)


async def beat(stub: RegistryServiceStub, *specs: node_pb2.NodeSpec) -> None:
    """One heartbeat of each node, reporting it ready and idle."""
    for spec in specs:
        await stub.Heartbeat(
            registry_pb2.HeartbeatRequest(
                node_id=spec.node_id, incarnation=spec.incarnation, engine_ready=True
            ),
            timeout=5,
        )


async def up(stub: RegistryServiceStub, *specs: node_pb2.NodeSpec) -> None:
    for spec in specs:
        await register(stub, spec)
    await beat(stub, *specs)


async def turn(
    stub: RegistryServiceStub,
    conversation: str,
    deadline_s: float = 5.0,
    prompt_tokens: int = 0,
    new_tokens: int = 0,
) -> registry_pb2.RoutingHint:
    request = registry_pb2.GetRoutingHintRequest(
        conversation_id=conversation, prompt_tokens=prompt_tokens, new_tokens=new_tokens
    )
    return (await stub.GetRoutingHint(request, timeout=deadline_s)).hint


def settle_waits(running: RunningRegistry) -> dict[str, float]:
    assert running.registry is not None
    counter = running.registry.metrics.settle_waits
    return {
        sample.labels["outcome"]: sample.value
        for metric in counter.collect()
        for sample in metric.samples
        if sample.name.endswith("_total") and sample.value
    }


async def report_not_retained(
    stub: RegistryServiceStub,
    spec: node_pb2.NodeSpec,
    conversation: str,
    reason: registry_pb2.NotRetainedReason,
    sequence: int = 1,
) -> registry_pb2.ReportRetentionResponse:
    event = registry_pb2.RetentionEvent(
        sequence=sequence,
        not_retained=registry_pb2.TurnNotRetained(conversation_id=conversation, reason=reason),
    )
    request = registry_pb2.ReportRetentionRequest(
        node_id=spec.node_id, incarnation=spec.incarnation, events=[event]
    )
    response: registry_pb2.ReportRetentionResponse = await stub.ReportRetention(request, timeout=5)
    return response


async def test_a_hint_never_waits_for_a_decode_node_that_does_not_retain(
    slow_settle: tuple[RunningRegistry, RegistryServiceStub],
) -> None:
    """`kvbroker up --reuse off` with session ids: every turn's hint answers at once (before,
    the second turn's hint waited for a retention report that never comes, past the router's
    deadline, and the client got a 503)."""
    running, stub = slow_settle
    decode = node_spec("decode-0")
    decode.kv_retention = node_pb2.KV_RETENTION_OFF
    await up(stub, decode, node_spec("prefill-0", PREFILL, port=5700))
    for _ in range(3):
        hint = await turn(stub, "conv-off", deadline_s=1.0)
        assert hint.decision == registry_pb2.HINT_DECISION_MISS
    assert settle_waits(running) == {}


async def test_a_turn_the_decode_node_did_not_retain_is_not_waited_for(
    slow_settle: tuple[RunningRegistry, RegistryServiceStub],
) -> None:
    running, stub = slow_settle
    decode = node_spec("decode-0")
    await up(stub, decode, node_spec("prefill-0", PREFILL, port=5700))
    await turn(stub, "conv-aborted")
    answer = await report_not_retained(
        stub, decode, "conv-aborted", registry_pb2.NOT_RETAINED_REASON_ABORTED
    )
    assert not answer.refused
    await turn(stub, "conv-aborted", deadline_s=1.0)
    assert settle_waits(running) == {}
    assert running.registry is not None
    counted = running.registry.metrics.turns_not_retained.labels("aborted")
    assert counted._value.get() == 1


async def test_a_wait_for_retention_ends_within_the_caller_s_deadline(
    slow_settle: tuple[RunningRegistry, RegistryServiceStub],
) -> None:
    """A retaining decode node whose report is late: the next turn's hint waits for it only
    part of its caller's deadline (the settle timeout here is 30 s), then answers."""
    running, stub = slow_settle
    decode = node_spec("decode-0")
    await up(stub, decode, node_spec("prefill-0", PREFILL, port=5700))
    await turn(stub, "conv-late")
    hint = await turn(stub, "conv-late", deadline_s=0.6)
    assert hint.decision == registry_pb2.HINT_DECISION_MISS
    assert settle_waits(running) == {"timeout": 1.0}


async def test_a_malformed_not_retained_report_is_refused_alone(
    stub: RegistryServiceStub,
) -> None:
    decode = node_spec("decode-0")
    await up(stub, decode)
    answer = await report_not_retained(stub, decode, "", registry_pb2.NOT_RETAINED_REASON_FAILED)
    assert [r.error.reason for r in answer.refused] == [registry_pb2.ERROR_REASON_INVALID_ARGUMENT]
    answer = await report_not_retained(stub, decode, "c", 99, sequence=2)  # type: ignore[arg-type]
    assert [r.error.reason for r in answer.refused] == [registry_pb2.ERROR_REASON_INVALID_ARGUMENT]
    assert answer.applied_sequence == 2


async def test_only_the_node_a_turn_was_routed_to_may_lease_its_conversation(
    stub: RegistryServiceStub,
) -> None:
    """One node's credential must not pull another's conversation (its next prompt) to
    itself by reporting a retention for it."""
    decodes = [node_spec("decode-0"), node_spec("decode-1", port=5602)]
    await up(stub, *decodes, node_spec("prefill-0", PREFILL, port=5700))
    routed = (await turn(stub, "conv-x")).decode.node_id
    holder = next(d for d in decodes if d.node_id == routed)
    thief = next(d for d in decodes if d.node_id != routed)

    async def refused_grant(request_id: str) -> None:
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await grant(stub, thief, "conv-x", request_id)
        assert error.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert routed in (error.value.details() or "")

    await refused_grant("steal-1")  # while the turn is in flight
    await grant(stub, holder, "conv-x", "req-1")
    await refused_grant("steal-2")  # between turns: the holder's
    hint = await turn(stub, "conv-x")
    assert hint.decode.node_id == routed
    assert hint.lease.node_id == routed
    # A conversation the registry does not know (a registry rebuilding from its holders'
    # replays) may be leased by any decode node.
    await grant(stub, thief, "conv-new", "req-2")


@pytest.mark.parametrize("retained", [True, False], ids=["retained", "not-retained"])
async def test_a_turn_s_load_leaves_its_prefill_node_when_the_turn_ends(
    stub: RegistryServiceStub, retained: bool
) -> None:
    """No heartbeat between two turns of a conversation: the second still goes to the prefill
    node that caches the first, whose load the first turn's end took off it."""
    decode = node_spec("decode-0")
    prefills = [node_spec(f"prefill-{i}", PREFILL, port=5700 + 2 * i) for i in range(2)]
    for spec in prefills:
        spec.prefix_caching = True
    await up(stub, decode, *prefills)
    first = await turn(stub, "conv-p", prompt_tokens=3000)
    if retained:
        await grant(stub, decode, "conv-p", "req-1", tokens=3200)
    else:
        await report_not_retained(
            stub, decode, "conv-p", registry_pb2.NOT_RETAINED_REASON_RETENTION_OFF
        )
    second = await turn(stub, "conv-p", prompt_tokens=6240, new_tokens=3040)
    assert second.prefill.node_id == first.prefill.node_id
    cached = {e.prefill_node_id: e.prefill_cached_tokens for e in second.estimates}
    assert cached[first.prefill.node_id] == 3000 // 16 * 16


async def test_a_fleet_with_a_retaining_and_a_non_retaining_decode_node(
    slow_settle: tuple[RunningRegistry, RegistryServiceStub],
) -> None:
    """Mid-rollout: one decode node retains, the other does not. Conversations on either get
    every next turn's hint at once; those on the retaining node are waited for only while
    their retention is due, and reuse it once reported."""
    running, stub = slow_settle
    retaining, not_retaining = node_spec("decode-on"), node_spec("decode-off", port=5602)
    not_retaining.kv_retention = node_pb2.KV_RETENTION_OFF
    await up(stub, retaining, not_retaining, node_spec("prefill-0", PREFILL, port=5700))
    placed: dict[str, str] = {}
    for index in range(6):
        conversation = f"conv-mixed-{index}"
        placed[conversation] = (await turn(stub, conversation, deadline_s=1.0)).decode.node_id
    assert set(placed.values()) == {"decode-on", "decode-off"}
    for conversation, node in placed.items():
        if node == "decode-on":
            await grant(stub, retaining, conversation, f"req-{conversation}")
    for conversation, node in placed.items():
        hint = await turn(stub, conversation, deadline_s=1.0)
        if node == "decode-on":
            assert hint.decision == registry_pb2.HINT_DECISION_REUSE
            assert hint.lease.node_id == "decode-on"
        else:
            assert hint.decision == registry_pb2.HINT_DECISION_MISS
    assert settle_waits(running) == {}


async def test_a_newer_parallel_turn_on_the_same_node_is_still_waited_for(
    slow_settle: tuple[RunningRegistry, RegistryServiceStub],
) -> None:
    """Two turns of one conversation in flight on one decode node: the first one's end is
    the older turn's, and the next hint still waits for the newer one's retention."""
    running, stub = slow_settle
    decode = node_spec("decode-0")
    await up(stub, decode, node_spec("prefill-0", PREFILL, port=5700))
    await turn(stub, "conv-par")
    await turn(stub, "conv-par", deadline_s=0.6)  # waits for the first (it has not ended)
    assert settle_waits(running) == {"timeout": 1.0}
    await report_not_retained(stub, decode, "conv-par", registry_pb2.NOT_RETAINED_REASON_ABORTED)
    await turn(stub, "conv-par", deadline_s=0.6)  # the second is still in flight
    assert settle_waits(running) == {"timeout": 2.0}


SHORT_TURNS = dataclasses.replace(FAST, turn_timeout_s=0.5)


@pytest.mark.parametrize("registry_config", [SHORT_TURNS])
async def test_a_turn_that_never_reached_its_node_stops_counting_after_the_turn_timeout(
    stub: RegistryServiceStub,
) -> None:
    """A turn routed to a decode node that never ran it (its prefill leg refused, its client
    gone) decides who may lease the conversation only until ``turn_timeout_s`` has passed:
    then the holder's retention of a turn served without a hint is accepted again."""
    holder, other = node_spec("decode-0"), node_spec("decode-1", port=5602)
    await up(stub, holder, other, node_spec("prefill-0", PREFILL, port=5700))
    await grant(stub, holder, "conv-lost", "req-1")
    # The holder is not ready for a moment: the next turn is routed to the other node, and
    # never gets there.
    await stub.Heartbeat(
        registry_pb2.HeartbeatRequest(
            node_id=holder.node_id, incarnation=holder.incarnation, engine_ready=False
        ),
        timeout=5,
    )
    assert (await turn(stub, "conv-lost")).decode.node_id == other.node_id
    await beat(stub, holder)
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await grant(stub, holder, "conv-lost", "req-2")
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED

    async def holder_leases_again() -> bool:
        try:
            await grant(stub, holder, "conv-lost", "req-3")
        except grpc.aio.AioRpcError:
            return False
        return True

    await eventually(holder_leases_again, within=5, every=0.05)
