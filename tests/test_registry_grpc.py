"""The registry served for real on loopback, driven through the generated stubs."""

from __future__ import annotations

import asyncio

import grpc
import httpx
import pytest

from kvbroker.common.client.grpc_client import from_grpc_error
from kvbroker.common.client.hint_batcher import HintBatcher
from kvbroker.common.rules.clock import from_duration, from_timestamp
from kvbroker.controlplane.server import RunningRegistry
from kvbroker.v1 import lease_pb2, node_pb2, registry_pb2
from kvbroker.v1.registry_pb2_grpc import RegistryServiceStub
from kvbroker_tools.harness.factories import (
    Heartbeats,
    block_hashes,
    grant,
    handle,
    hint,
    node_spec,
    register,
)
from tests.conftest import eventually

DECODE = node_pb2.NODE_ROLE_DECODE
PREFILL = node_pb2.NODE_ROLE_PREFILL


async def get_node(stub: RegistryServiceStub, node_id: str) -> node_pb2.Node:
    return (await stub.GetNode(registry_pb2.GetNodeRequest(node_id=node_id), timeout=5)).node


async def get_lease(stub: RegistryServiceStub, lease_id: str) -> lease_pb2.Lease:
    return (await stub.GetLease(registry_pb2.GetLeaseRequest(lease_id=lease_id), timeout=5)).lease


async def test_node_joins_heartbeats_and_expires(stub: RegistryServiceStub) -> None:
    spec = node_spec("decode-0")
    node = await register(stub, spec)
    assert node.state == node_pb2.NODE_STATE_READY
    beat = registry_pb2.HeartbeatRequest(
        node_id="decode-0",
        incarnation=spec.incarnation,
        engine_ready=False,
        load=node_pb2.NodeLoad(running_requests=3),
    )
    node = (await stub.Heartbeat(beat, timeout=5)).node
    assert node.state == node_pb2.NODE_STATE_NOT_READY
    assert node.load.running_requests == 3

    # Silence past the session TTL (0.8 s): the node is DOWN and must register again.
    async def is_down() -> bool:
        return (await get_node(stub, "decode-0")).state == node_pb2.NODE_STATE_DOWN

    await eventually(is_down, within=5)
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await stub.Heartbeat(beat, timeout=5)
    assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "register again" in (error.value.details() or "")
    assert (await register(stub, spec)).state == node_pb2.NODE_STATE_READY


async def test_lease_grant_renew_expire_revoke_with_rising_epochs(
    stub: RegistryServiceStub,
) -> None:
    decode = node_spec("decode-0")
    async with Heartbeats(stub, decode, node_spec("prefill-0", PREFILL, port=5700)):
        first = await grant(stub, decode, "conv-a", "req-1", ttl_s=0.6)
        assert first.state == lease_pb2.LEASE_STATE_ACTIVE
        assert 0.4 < from_duration(first.time_to_live) <= 0.6

        renewed = (
            await stub.RenewLease(
                registry_pb2.RenewLeaseRequest(
                    lease_id=first.lease_id, time_to_live=first.time_to_live
                ),
                timeout=5,
            )
        ).lease
        assert from_timestamp(renewed.expire_time) > from_timestamp(first.expire_time)

        # No more renewals: the registry's clock expires it on time.
        async def expired() -> bool:
            lease = await get_lease(stub, first.lease_id)
            return lease.state == lease_pb2.LEASE_STATE_EXPIRED

        await eventually(expired, within=3)
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await stub.RenewLease(
                registry_pb2.RenewLeaseRequest(lease_id=first.lease_id), timeout=5
            )
        assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "EXPIRED" in (error.value.details() or "")

        second = await grant(stub, decode, "conv-a", "req-2")
        assert second.epoch == first.epoch + 1
        third = await grant(stub, decode, "conv-a", "req-3")
        assert third.epoch == first.epoch + 2
        # The newer turn supersedes the older lease.
        superseded = await get_lease(stub, second.lease_id)
        assert superseded.state == lease_pb2.LEASE_STATE_REVOKED
        assert "superseded" in superseded.end_reason

        revoked = (
            await stub.RevokeLease(
                registry_pb2.RevokeLeaseRequest(conversation_id="conv-a", reason="test"), timeout=5
            )
        ).lease
        assert revoked.lease_id == third.lease_id
        assert revoked.state == lease_pb2.LEASE_STATE_REVOKED
        conversation = (
            await stub.GetConversation(
                registry_pb2.GetConversationRequest(conversation_id="conv-a"), timeout=5
            )
        ).conversation
        assert conversation.epoch == third.epoch


async def test_hint_names_holder_then_not_after_expiry(stub: RegistryServiceStub) -> None:
    decodes = [node_spec(f"decode-{i}", port=5600 + i) for i in range(3)]
    prefill = node_spec("prefill-0", PREFILL, port=5700)
    async with Heartbeats(stub, prefill, *decodes):
        lease = await grant(stub, decodes[2], "conv-h", "req-1", ttl_s=0.5)
        result = await hint(stub, "conv-h")
        assert result.decision == registry_pb2.HINT_DECISION_REUSE
        assert result.consistency == registry_pb2.HINT_CONSISTENCY_EXACT
        assert result.decode.node_id == "decode-2"
        assert result.prefill.node_id == "prefill-0"
        assert result.lease.lease_id == lease.lease_id
        assert result.lease.epoch == lease.epoch
        assert result.lease.handle.remote_engine_id == "engine-decode-2"
        assert result.lease.state == lease_pb2.LEASE_STATE_CLAIMED
        # While claimed, no second reader gets the same blocks.
        again = await hint(stub, "conv-h")
        assert again.decision == registry_pb2.HINT_DECISION_RECOMPUTE
        assert "claimed" in again.reason
        assert not again.HasField("lease")

        # The claim (1 s) outlives the TTL; after both, the lease is gone and not offered.
        async def not_offered() -> bool:
            return (await hint(stub, "conv-h", dry_run=True)).decision == (
                registry_pb2.HINT_DECISION_RECOMPUTE
            ) and "claimed" not in (await hint(stub, "conv-h", dry_run=True)).reason

        await eventually(not_offered, within=4)
        final = await hint(stub, "conv-h")
        assert not final.HasField("lease")
        assert "(IDLE)" in final.reason
        assert (await get_lease(stub, lease.lease_id)).state == lease_pb2.LEASE_STATE_EXPIRED


async def test_hint_without_conversation_and_for_unknown_one(stub: RegistryServiceStub) -> None:
    async with Heartbeats(stub, node_spec("decode-0"), node_spec("prefill-0", PREFILL, port=5700)):
        plain = await hint(stub, "")
        assert plain.decision == registry_pb2.HINT_DECISION_MISS
        assert "plain" in plain.reason
        unknown = await hint(stub, "never-seen")
        assert unknown.decision == registry_pb2.HINT_DECISION_MISS
        assert "first turn" in unknown.reason


async def test_batched_hints_answer_each_request_in_order(stub: RegistryServiceStub) -> None:
    decode = node_spec("decode-0")
    async with Heartbeats(stub, decode, node_spec("prefill-0", PREFILL, port=5700)):
        lease = await grant(stub, decode, "conv-b", "req-1")
        requests = [
            registry_pb2.GetRoutingHintRequest(conversation_id="conv-b"),
            registry_pb2.GetRoutingHintRequest(conversation_id="x" * 300),
            registry_pb2.GetRoutingHintRequest(conversation_id="never-seen"),
            registry_pb2.GetRoutingHintRequest(conversation_id="conv-b"),
            registry_pb2.GetRoutingHintRequest(conversation_id="conv-b", model="other-model"),
        ]
        response = await stub.BatchGetRoutingHints(
            registry_pb2.BatchGetRoutingHintsRequest(requests=requests), timeout=5
        )
        reuse, too_long, unknown, claimed, no_model = response.results
        assert reuse.hint.decision == registry_pb2.HINT_DECISION_REUSE
        assert reuse.hint.lease.lease_id == lease.lease_id
        assert too_long.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert "300 characters" in too_long.error.message
        assert unknown.hint.decision == registry_pb2.HINT_DECISION_MISS
        # The first request's claim holds for the later one in the same batch.
        assert claimed.hint.decision == registry_pb2.HINT_DECISION_RECOMPUTE
        assert no_model.error.code == grpc.StatusCode.UNAVAILABLE.value[0]

        too_many = registry_pb2.BatchGetRoutingHintsRequest(requests=requests * 201)
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await stub.BatchGetRoutingHints(too_many, timeout=5)
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_a_hint_for_an_unknown_path_is_refused_alone(stub: RegistryServiceStub) -> None:
    """A turn path the schema does not define (an engine door's ``ResolveHandle`` passes the
    one it is sent) is a bad argument, never answered as a normal hint; in a batch it fails
    alone."""
    async with Heartbeats(stub, node_spec("decode-0"), node_spec("prefill-0", PREFILL, port=5700)):
        unknown = registry_pb2.GetRoutingHintRequest(conversation_id="conv-p", path=99)  # type: ignore[arg-type]
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.GetRoutingHint(unknown, timeout=5)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "path 99" in (refused.value.details() or "")
        known = registry_pb2.GetRoutingHintRequest(conversation_id="conv-q")
        response = await stub.BatchGetRoutingHints(
            registry_pb2.BatchGetRoutingHintsRequest(requests=[unknown, known]), timeout=5
        )
        bad, good = response.results
        assert bad.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert good.hint.decision == registry_pb2.HINT_DECISION_MISS


async def test_hint_batcher_shares_calls_between_concurrent_hints(
    stub: RegistryServiceStub,
) -> None:
    calls = []

    class CountingStub:
        async def BatchGetRoutingHints(self, request, **options):
            calls.append(len(request.requests))
            return await stub.BatchGetRoutingHints(request, **options)

    batcher = HintBatcher(CountingStub(), timeout_s=5)  # type: ignore[arg-type]
    async with Heartbeats(stub, node_spec("decode-0"), node_spec("prefill-0", PREFILL, port=5700)):
        alone = await batcher.hint(registry_pb2.GetRoutingHintRequest(conversation_id="c-1"))
        assert alone.decision == registry_pb2.HINT_DECISION_MISS and calls == [1]
        hints = await asyncio.gather(
            *(
                batcher.hint(registry_pb2.GetRoutingHintRequest(conversation_id=f"c{i}"))
                for i in range(50)
            ),
            batcher.hint(registry_pb2.GetRoutingHintRequest(conversation_id="y" * 300)),
            return_exceptions=True,
        )
    assert sum(calls) == 52 and len(calls) < 10
    assert all(isinstance(h, registry_pb2.RoutingHint) for h in hints[:50])
    refused = hints[50]
    assert isinstance(refused, grpc.aio.AioRpcError)
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_hint_without_ready_nodes_is_unavailable(stub: RegistryServiceStub) -> None:
    await register(stub, node_spec("decode-0"))
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await hint(stub, "c")
    assert error.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "no ready prefill node" in (error.value.details() or "")


async def test_hint_spreads_prefill_by_load(stub: RegistryServiceStub) -> None:
    prefills = [node_spec(f"prefill-{i}", PREFILL, port=5700 + i) for i in range(3)]
    async with Heartbeats(stub, node_spec("decode-0"), *prefills):
        chosen = [(await hint(stub, f"c{i}")).prefill.node_id for i in range(6)]
    assert set(chosen) == {"prefill-0", "prefill-1", "prefill-2"}


async def test_concurrent_renewals_are_consistent(stub: RegistryServiceStub) -> None:
    decode = node_spec("decode-0")
    async with Heartbeats(stub, decode):
        lease = await grant(stub, decode, "conv-c", "req-1")
        request = registry_pb2.RenewLeaseRequest(lease_id=lease.lease_id)
        request.time_to_live.FromSeconds(20)
        results = await asyncio.gather(*(stub.RenewLease(request, timeout=5) for _ in range(64)))
        expiries = sorted(from_timestamp(r.lease.expire_time) for r in results)
        assert all(r.lease.state == lease_pb2.LEASE_STATE_ACTIVE for r in results)
        assert len({r.lease.epoch for r in results}) == 1
        final = await get_lease(stub, lease.lease_id)
        # The stored expiry is the last renewal's, never an earlier one's.
        assert from_timestamp(final.expire_time) == pytest.approx(expiries[-1], abs=1e-6)
        node = await get_node(stub, "decode-0")
        assert node.live_leases == 1


async def test_commands_reach_the_holder(stub: RegistryServiceStub) -> None:
    decode = node_spec("decode-0")
    async with Heartbeats(stub, decode, node_spec("prefill-0", PREFILL, port=5700)):
        watch = stub.WatchLeaseCommands(
            registry_pb2.WatchLeaseCommandsRequest(
                node_id="decode-0", incarnation=decode.incarnation
            )
        )
        lease = await grant(stub, decode, "conv-w", "req-1")
        renew = registry_pb2.RenewLeaseRequest(lease_id=lease.lease_id)
        renew.time_to_live.FromSeconds(90)
        await stub.RenewLease(renew, timeout=5)
        first = (await asyncio.wait_for(watch.read(), 5)).command
        assert first.remote_request_id == "req-1"
        assert 89 < from_duration(first.time_to_live) <= 90
        assert first.state == lease_pb2.LEASE_STATE_ACTIVE

        # Revoking a lease claimed by a read keeps the blocks for the rest of the claim.
        assert (await hint(stub, "conv-w")).decision == registry_pb2.HINT_DECISION_REUSE
        await stub.RevokeLease(registry_pb2.RevokeLeaseRequest(lease_id=lease.lease_id), timeout=5)
        revoke = (await asyncio.wait_for(watch.read(), 5)).command
        assert revoke.state == lease_pb2.LEASE_STATE_REVOKED
        assert 0.5 < from_duration(revoke.time_to_live) <= 1.0  # claim timeout is 1 s
        watch.cancel()


async def test_release_only_by_holder(stub: RegistryServiceStub) -> None:
    a, b = node_spec("decode-a"), node_spec("decode-b", port=5601)
    async with Heartbeats(stub, a, b):
        lease = await grant(stub, a, "conv-r", "req-1")
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await stub.ReleaseLease(
                registry_pb2.ReleaseLeaseRequest(
                    lease_id=lease.lease_id, node_id="decode-b", node_incarnation=b.incarnation
                ),
                timeout=5,
            )
        assert error.value.code() == grpc.StatusCode.PERMISSION_DENIED
        released = (
            await stub.ReleaseLease(
                registry_pb2.ReleaseLeaseRequest(
                    lease_id=lease.lease_id,
                    node_id="decode-a",
                    node_incarnation=a.incarnation,
                    reason="read completed",
                ),
                timeout=5,
            )
        ).lease
        assert released.state == lease_pb2.LEASE_STATE_RELEASED
        assert (await get_node(stub, "decode-a")).live_leases == 0


async def test_node_down_withdraws_its_leases(stub: RegistryServiceStub) -> None:
    decode, prefill = node_spec("decode-0"), node_spec("prefill-0", PREFILL, port=5700)
    await register(stub, decode)
    async with Heartbeats(stub, prefill, node_spec("decode-1", port=5601)):
        lease = await grant(stub, decode, "conv-d", "req-1")

        async def withdrawn() -> bool:
            return (await get_lease(stub, lease.lease_id)).state == lease_pb2.LEASE_STATE_REVOKED

        await eventually(withdrawn, within=3)
        result = await hint(stub, "conv-d")
        assert result.decision == registry_pb2.HINT_DECISION_RECOMPUTE
        assert "(NODE_LOST)" in result.reason
        assert result.decode.node_id == "decode-1"


@pytest.mark.parametrize(
    ("mutate", "code", "phrase"),
    [
        (
            lambda r: r.ClearField("conversation_id"),
            "INVALID_ARGUMENT",
            "conversation_id is required",
        ),
        (lambda r: r.ClearField("node_id"), "INVALID_ARGUMENT", "node_id is required"),
        (
            lambda r: r.handle.ClearField("remote_request_id"),
            "INVALID_ARGUMENT",
            "remote_request_id is required",
        ),
        (
            lambda r: r.block_hashes.extend(block_hashes(16 * 70_000)),
            "INVALID_ARGUMENT",
            "exceed the limit",
        ),
        (lambda r: setattr(r, "token_count", 0), "INVALID_ARGUMENT", "token_count"),
        (lambda r: setattr(r, "node_id", "ghost"), "NOT_FOUND", "not registered"),
        (lambda r: setattr(r, "node_incarnation", "old"), "FAILED_PRECONDITION", "incarnation"),
        (lambda r: setattr(r, "conversation_id", "x" * 300), "INVALID_ARGUMENT", "limit is 256"),
    ],
)
async def test_bad_grants_get_the_right_status(stub: RegistryServiceStub, mutate, code, phrase):  # type: ignore[no-untyped-def]
    spec = node_spec("decode-0")
    await register(stub, spec)
    request = registry_pb2.GrantLeaseRequest(
        conversation_id="c",
        node_id="decode-0",
        node_incarnation=spec.incarnation,
        handle=handle("r", 64, spec),
        block_hashes=block_hashes(64),
        token_count=64,
    )
    mutate(request)
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await stub.GrantLease(request, timeout=5)
    assert error.value.code().name == code
    assert phrase in (error.value.details() or "")
    assert (await get_node(stub, "decode-0")).live_leases == 0


async def test_prefill_node_cannot_hold_leases(stub: RegistryServiceStub) -> None:
    spec = node_spec("prefill-0", PREFILL)
    await register(stub, spec)
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await grant(stub, spec, "c", "r")
    assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "prefill node" in (error.value.details() or "")


async def test_unknown_things_are_not_found(stub: RegistryServiceStub) -> None:
    calls = [
        stub.GetConversation(
            registry_pb2.GetConversationRequest(conversation_id="nope"), timeout=5
        ),
        stub.RenewLease(registry_pb2.RenewLeaseRequest(conversation_id="nope"), timeout=5),
        stub.GetLease(registry_pb2.GetLeaseRequest(lease_id="nope"), timeout=5),
        stub.GetNode(registry_pb2.GetNodeRequest(node_id="nope"), timeout=5),
    ]
    for call in calls:
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await call
        assert error.value.code() == grpc.StatusCode.NOT_FOUND
        assert "nope" in (error.value.details() or "")


async def test_register_rejects_incomplete_specs(stub: RegistryServiceStub) -> None:
    spec = node_spec("n")
    spec.role = node_pb2.NODE_ROLE_UNSPECIFIED
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await register(stub, spec)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "role" in (error.value.details() or "")


async def test_metrics_are_exported(
    stub: RegistryServiceStub, registry_server: RunningRegistry
) -> None:
    async with Heartbeats(stub, node_spec("decode-0"), node_spec("prefill-0", PREFILL, port=5700)):
        spec = node_spec("decode-1", port=5601)
        await register(stub, spec)
        await grant(stub, spec, "conv-m", "req-1", tokens=320)
        await hint(stub, "conv-m")
    async with httpx.AsyncClient() as client:
        text = (await client.get(f"http://{registry_server.metrics_address}/metrics")).text
    assert 'kvbroker_hints_total{consistency="EXACT",decision="REUSE"} 1.0' in text
    assert 'kvbroker_lease_events_total{event="grant"} 1.0' in text
    assert 'kvbroker_retained_blocks{node="decode-1"} 20.0' in text
    assert "kvbroker_hint_latency_seconds_bucket" in text


@pytest.mark.parametrize("caching", [True, False], ids=["prefix-caching", "no-prefix-caching"])
async def test_a_conversation_s_next_turn_goes_to_the_prefill_node_that_caches_it(
    stub: RegistryServiceStub, caching: bool
) -> None:
    """Two ready prefill nodes. The first turn (3,000 tokens) goes to one; its retention
    (prompt and answer, 3,200 tokens) is reported; the second turn brings a bulk suffix (over
    the decode node's local limit). With prefix caching on, the node that prefilled the first
    turn gets the second, and the hint says what its cache holds; with it off, the turn goes
    round robin to the other node, as it would without a planner."""
    decode = node_spec("decode-0")
    prefills = [node_spec(f"prefill-{i}", PREFILL, port=5700 + 2 * i) for i in range(2)]
    for spec in prefills:
        spec.prefix_caching = caching

    async def turn(prompt_tokens: int, new_tokens: int = 0) -> registry_pb2.RoutingHint:
        request = registry_pb2.GetRoutingHintRequest(
            conversation_id="conv-p", prompt_tokens=prompt_tokens, new_tokens=new_tokens
        )
        return (await stub.GetRoutingHint(request, timeout=5)).hint

    async with Heartbeats(stub, decode, *prefills):
        first = await turn(3000)
        assert first.decision == registry_pb2.HINT_DECISION_MISS
        await grant(stub, decode, "conv-p", "req-1", tokens=3200)
        second = await turn(6240, new_tokens=3040)
    assert second.decision == registry_pb2.HINT_DECISION_REUSE
    assert second.path == registry_pb2.TURN_PATH_READ
    other = next(p.node_id for p in prefills if p.node_id != first.prefill.node_id)
    cached = {e.prefill_node_id: e.prefill_cached_tokens for e in second.estimates}
    if caching:
        assert second.prefill.node_id == first.prefill.node_id
        assert cached == {"": 0, other: 0, first.prefill.node_id: 3000 // 16 * 16}
    else:
        assert second.prefill.node_id == other
        assert cached == {"": 0, other: 0}


@pytest.mark.parametrize(
    ("field", "value", "phrase"),
    [
        ("http_base_url", "", "not an http:// or https:// URL"),
        ("http_base_url", "file:///etc/passwd", "not an http:// or https:// URL"),
        ("http_base_url", "gopher://127.0.0.1:70", "not an http:// or https:// URL"),
        ("http_base_url", "http://:8000", "host of spec.http_base_url is required"),
        ("http_base_url", "http://127.0.0.1:0", "port of spec.http_base_url is required"),
        ("http_base_url", "http://127.0.0.1:70000", "is not a URL"),
        ("http_base_url", "http://127.0.0.1:80x", "is not a URL"),
        ("http_base_url", "http://evil host:8000", "whitespace"),
        ("http_base_url", "http://exa\tmple.com", "whitespace"),
        ("http_base_url", "http://user:pw@127.0.0.1:8000", "no more"),
        ("http_base_url", "http://127.0.0.1:8000/?next=x", "no more"),
        ("http_base_url", "http://ex%41mple.com", "not a host name"),
        ("side_channel_host", "", "side_channel_host is required"),
        ("side_channel_host", "-bad-", "not a host name"),
        ("side_channel_host", "a b", "not a host name"),
        ("side_channel_port", 0, "side_channel_port is required"),
        ("side_channel_port", 70_000, "not a port"),
    ],
)
async def test_registrations_with_unusable_addresses_are_refused(
    stub: RegistryServiceStub, field: str, value: object, phrase: str
) -> None:
    """Routers send clients' requests to a node's URL and engines read from its side channel:
    an address no one can (or should) connect to is refused at registration."""
    spec = node_spec("decode-0")
    setattr(spec, field, value)
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await register(stub, spec)
    refusal = from_grpc_error(error.value)
    assert refusal.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refusal.reason == registry_pb2.ERROR_REASON_INVALID_ARGUMENT
    assert phrase in refusal.message, refusal.message
    assert not (await stub.ListNodes(registry_pb2.ListNodesRequest(), timeout=5)).nodes


async def test_usable_addresses_are_registered(stub: RegistryServiceStub) -> None:
    for index, (url, host) in enumerate(
        [
            ("https://decode-0.kvbroker.svc.cluster.local", "10.0.0.7"),
            ("http://[::1]:8000/engine", "::1"),
            ("http://LOCALHOST:8000/", "decode-0.decode.default.svc."),
        ]
    ):
        spec = node_spec(f"decode-{index}", port=5600 + index)
        spec.http_base_url, spec.side_channel_host = url, host
        await register(stub, spec)


async def test_a_burst_of_calls_past_grpcs_default_queue_is_answered_not_cancelled(
    stub: RegistryServiceStub,
) -> None:
    """gRPC's core refuses calls (CANCELLED) once more than 1,000 wait for the server's event
    loop to ask for them, by default; the registry lets a fleet's burst wait instead."""
    calls = 5_000

    async def listing() -> str:
        try:
            await stub.ListNodes(registry_pb2.ListNodesRequest(), timeout=120)
        except grpc.aio.AioRpcError as error:
            return error.code().name
        return "OK"

    codes = await asyncio.gather(*(listing() for _ in range(calls)))
    assert codes.count("OK") == calls, {code: codes.count(code) for code in set(codes)}
