"""Hints for turns a router other than kvbroker's already placed (``on_node_id``), on a registry
served for real on loopback: a prefill node gets READ (the lease claimed for it) or RECOMPUTE,
never a path it cannot take; a decode node gets DECODE_LOCAL only on the lease it holds; READ
is never planned between NIXL connectors of different versions; and placing a turn never
lets a node lease a conversation its holder's rules would refuse."""

from __future__ import annotations

import grpc
import pytest

from kvbroker.common.process.tasks import poll_until
from kvbroker.common.rules.routing import can_transfer
from kvbroker.v1 import lease_pb2, node_pb2, registry_pb2
from kvbroker.v1.registry_pb2_grpc import RegistryServiceStub
from kvbroker_tools.harness.factories import Heartbeats, block_hashes, grant, handle, node_spec

PREFILL = node_pb2.NODE_ROLE_PREFILL
READ = registry_pb2.TURN_PATH_READ
RECOMPUTE = registry_pb2.TURN_PATH_RECOMPUTE
DECODE_LOCAL = registry_pb2.TURN_PATH_DECODE_LOCAL
ASK_PLANNER = registry_pb2.TURN_PATH_UNSPECIFIED


async def placed(
    stub: RegistryServiceStub,
    conversation: str,
    node: node_pb2.NodeSpec,
    path: registry_pb2.TurnPath,
    prompt_tokens: int = 0,
) -> registry_pb2.RoutingHint:
    request = registry_pb2.GetRoutingHintRequest(
        conversation_id=conversation,
        on_node_id=node.node_id,
        path=path,
        prompt_tokens=prompt_tokens,
    )
    return (await stub.GetRoutingHint(request, timeout=5)).hint


async def lease_state(stub: RegistryServiceStub, lease_id: str) -> lease_pb2.LeaseState:
    response = await stub.GetLease(registry_pb2.GetLeaseRequest(lease_id=lease_id), timeout=5)
    return response.lease.state


async def test_a_prefill_leg_reads_the_lease_claimed_for_it(stub: RegistryServiceStub) -> None:
    decode, prefill = node_spec("decode-0"), node_spec("prefill-0", PREFILL, port=5700)
    async with Heartbeats(stub, decode, prefill):
        first = await placed(stub, "conv-1", prefill, READ)
        assert first.path == RECOMPUTE
        assert first.no_reuse == registry_pb2.NO_REUSE_REASON_NO_CONVERSATION
        assert not first.HasField("decode")  # the other router picks the decode node
        lease = await grant(stub, decode, "conv-1", "req-1", tokens=512)
        hint = await placed(stub, "conv-1", prefill, READ, prompt_tokens=600)
        assert hint.decision == registry_pb2.HINT_DECISION_REUSE
        assert hint.path == READ
        assert hint.lease.lease_id == lease.lease_id
        assert hint.lease.epoch == lease.epoch
        assert hint.prefill.node_id == "prefill-0"
        assert hint.decode.node_id == "decode-0"  # where the KV is
        assert await lease_state(stub, lease.lease_id) == lease_pb2.LEASE_STATE_CLAIMED


async def test_a_prefill_leg_never_reads_across_connector_versions(
    stub: RegistryServiceStub,
) -> None:
    decode, prefill = node_spec("decode-0"), node_spec("prefill-0", PREFILL, port=5700)
    decode.vllm_version, decode.nixl_connector_version = "0.32.0", 14
    prefill.vllm_version, prefill.nixl_connector_version = "0.33.0", 15
    async with Heartbeats(stub, decode, prefill):
        lease = await grant(stub, decode, "conv-1", "req-1", tokens=512)
        hint = await placed(stub, "conv-1", prefill, READ, prompt_tokens=600)
        assert hint.path == RECOMPUTE
        assert hint.decision == registry_pb2.HINT_DECISION_RECOMPUTE
        assert hint.no_reuse == registry_pb2.NO_REUSE_REASON_VERSION_MISMATCH
        assert not hint.lease.lease_id
        assert await lease_state(stub, lease.lease_id) == lease_pb2.LEASE_STATE_ACTIVE


async def test_kvbrokers_router_never_plans_a_read_across_versions(
    stub: RegistryServiceStub,
) -> None:
    """A rolling upgrade: the old decode node holds the lease, the only prefill node is new.
    Neither READ nor RECOMPUTE can hand KV across the versions: the holder computes the turn
    from what it retains."""
    decode, prefill = node_spec("decode-0"), node_spec("prefill-0", PREFILL, port=5700)
    decode.nixl_connector_version, prefill.nixl_connector_version = 14, 15
    async with Heartbeats(stub, decode, prefill):
        await grant(stub, decode, "conv-1", "req-1", tokens=512)
        request = registry_pb2.GetRoutingHintRequest(
            conversation_id="conv-1", prompt_tokens=4000, new_tokens=3488
        )
        hint = (await stub.GetRoutingHint(request, timeout=5)).hint
        assert hint.path == DECODE_LOCAL
        assert hint.decision == registry_pb2.HINT_DECISION_REUSE


async def test_a_decode_node_serves_locally_only_the_lease_it_holds(
    stub: RegistryServiceStub,
) -> None:
    holder, other = node_spec("decode-0"), node_spec("decode-1", port=5650)
    prefill = node_spec("prefill-0", PREFILL, port=5700)
    async with Heartbeats(stub, holder, other, prefill):
        lease = await grant(stub, holder, "conv-1", "req-1", tokens=512)
        local = await placed(stub, "conv-1", holder, DECODE_LOCAL, prompt_tokens=600)
        assert local.path == DECODE_LOCAL
        assert local.lease.lease_id == lease.lease_id
        # DECODE_LOCAL reads nothing: the lease is not claimed.
        assert await lease_state(stub, lease.lease_id) == lease_pb2.LEASE_STATE_ACTIVE
        elsewhere = await placed(stub, "conv-1", other, DECODE_LOCAL, prompt_tokens=600)
        assert elsewhere.path == RECOMPUTE
        assert elsewhere.no_reuse == registry_pb2.NO_REUSE_REASON_NOT_HOLDER
        assert elsewhere.decision == registry_pb2.HINT_DECISION_RECOMPUTE


async def test_a_conditional_turn_is_local_only_when_the_planner_says_so(
    stub: RegistryServiceStub,
) -> None:
    decode, prefill = node_spec("decode-0"), node_spec("prefill-0", PREFILL, port=5700)
    async with Heartbeats(stub, decode, prefill):
        await grant(stub, decode, "conv-1", "req-1", tokens=512)
        short = await placed(stub, "conv-1", decode, ASK_PLANNER, prompt_tokens=540)
        assert short.path == DECODE_LOCAL
        # A suffix over the decode node's local limit goes to a prefill node instead.
        bulk = await placed(stub, "conv-1", decode, ASK_PLANNER, prompt_tokens=512 + 5000)
        assert bulk.path in (READ, RECOMPUTE)
        assert bulk.prefill.node_id == "prefill-0"
        assert bulk.lease.token_count == 512  # what the caller's fallback may read


async def test_placing_a_turn_never_moves_a_conversation(stub: RegistryServiceStub) -> None:
    """A node the turn was placed on by another router may lease a new conversation, and the
    one it held; never one another node holds."""
    holder, other = node_spec("decode-0"), node_spec("decode-1", port=5650)
    prefill = node_spec("prefill-0", PREFILL, port=5700)
    async with Heartbeats(stub, holder, other, prefill):
        await grant(stub, holder, "conv-1", "req-1", tokens=512)
        await placed(stub, "conv-1", other, DECODE_LOCAL)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await grant(stub, other, "conv-1", "req-2", tokens=600)
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        await placed(stub, "conv-new", other, DECODE_LOCAL)
        assert (await grant(stub, other, "conv-new", "req-3", tokens=300)).node_id == "decode-1"


async def test_a_placed_turn_names_a_node_serving_the_model(stub: RegistryServiceStub) -> None:
    decode, prefill = node_spec("decode-0"), node_spec("prefill-0", PREFILL, port=5700)
    async with Heartbeats(stub, decode, prefill):
        for node, path, code in (
            (node_spec("ghost"), READ, grpc.StatusCode.NOT_FOUND),
            (decode, READ, grpc.StatusCode.FAILED_PRECONDITION),
            (prefill, DECODE_LOCAL, grpc.StatusCode.FAILED_PRECONDITION),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await placed(stub, "conv-1", node, path)
            assert refused.value.code() == code


@pytest.mark.parametrize(
    ("reader", "owner", "transfers"),
    [
        (("0.32.0", 14), ("0.32.0", 14), True),
        (("0.32.0", 14), ("0.33.0", 15), False),
        (("0.33.0", 15), ("0.33.1", 15), False),  # vLLM's handshake hashes its version too
        (("", 0), ("0.33.0", 15), True),  # an older sidecar reports nothing
    ],
)
def test_which_connectors_transfer(
    reader: tuple[str, int], owner: tuple[str, int], transfers: bool
) -> None:
    specs = []
    for version, connector in (reader, owner):
        spec = node_spec("n")
        spec.vllm_version, spec.nixl_connector_version = version, connector
        specs.append(spec)
    assert can_transfer(*specs) is transfers


async def test_a_fleet_mid_upgrade_pairs_nodes_that_can_transfer(
    stub: RegistryServiceStub,
) -> None:
    """Half the fleet on the new vLLM: a turn's prefill node is one its decode node can read
    from, even when a node of the other version is less loaded."""
    decode = node_spec("decode-0")
    decode.vllm_version, decode.nixl_connector_version = "0.32.0", 14
    old, new = (
        node_spec("prefill-old", PREFILL, port=5700),
        node_spec("prefill-new", PREFILL, port=5800),
    )
    old.vllm_version, old.nixl_connector_version = "0.32.0", 14
    new.vllm_version, new.nixl_connector_version = "0.33.0", 15
    async with Heartbeats(stub, decode, old, new):
        for turn in range(4):
            request = registry_pb2.GetRoutingHintRequest(conversation_id=f"conv-{turn}")
            hint = (await stub.GetRoutingHint(request, timeout=5)).hint
            assert (hint.decode.node_id, hint.prefill.node_id) == ("decode-0", "prefill-old")


def versioned(spec: node_pb2.NodeSpec, vllm: str, connector: int) -> node_pb2.NodeSpec:
    spec.vllm_version, spec.nixl_connector_version = vllm, connector
    return spec


async def test_a_turn_with_no_pair_that_can_transfer_is_served_on_its_decode_node(
    stub: RegistryServiceStub,
) -> None:
    """A fleet of 0.32 prefill nodes and decode nodes on 0.34 and 0.32: a new conversation
    goes to the decode node a prefill node can hand KV to, even when the other is less
    loaded; a conversation held on the 0.34 node is never paired with a 0.32 prefill node (vLLM
    refuses the handshake): the decode node computes its turn alone, from what it retains; and
    where only 0.34 decode nodes serve a model, a new conversation is served on one alone."""
    old_decode = versioned(node_spec("decode-old"), "0.32.0", 14)
    new_decode = versioned(node_spec("decode-new", port=5900), "0.34.0", 16)
    prefill = versioned(node_spec("prefill-old", PREFILL, port=5700), "0.32.0", 14)
    lone_decode = versioned(node_spec("decode-lone", port=6100, model="lone"), "0.34.0", 16)
    lone_prefill = versioned(node_spec("prefill-lone", PREFILL, 6200, "lone"), "0.32.0", 14)
    async with (
        Heartbeats(stub, old_decode) as busy,
        Heartbeats(stub, new_decode, prefill, lone_decode, lone_prefill),
    ):
        busy.load = node_pb2.NodeLoad(running_requests=3)

        async def busy_reported() -> bool:
            nodes = (await stub.ListNodes(registry_pb2.ListNodesRequest(), timeout=5)).nodes
            return any(n.spec.node_id == "decode-old" and n.load.running_requests for n in nodes)

        await poll_until(busy_reported, 10, "decode-old's load reported")
        for turn in range(4):
            request = registry_pb2.GetRoutingHintRequest(
                conversation_id=f"conv-{turn}", model=prefill.model
            )
            hint = (await stub.GetRoutingHint(request, timeout=5)).hint
            assert (hint.decode.node_id, hint.prefill.node_id) == ("decode-old", "prefill-old")
            assert hint.path != DECODE_LOCAL
        held = await grant(stub, new_decode, "conv-held", "req-held", tokens=512)
        request = registry_pb2.GetRoutingHintRequest(
            conversation_id="conv-held", model=prefill.model
        )
        hint = (await stub.GetRoutingHint(request, timeout=5)).hint
        assert (hint.decode.node_id, hint.path) == ("decode-new", DECODE_LOCAL)
        assert hint.decision == registry_pb2.HINT_DECISION_REUSE
        assert hint.lease.lease_id == held.lease_id
        request = registry_pb2.GetRoutingHintRequest(conversation_id="conv-lone", model="lone")
        hint = (await stub.GetRoutingHint(request, timeout=5)).hint
        assert (hint.decode.node_id, hint.path) == ("decode-lone", DECODE_LOCAL)
        assert hint.decision == registry_pb2.HINT_DECISION_MISS


async def test_a_lease_from_an_older_kv_registration_is_declined(
    stub: RegistryServiceStub,
) -> None:
    """vLLM 0.33+: blocks retained under an older registration of the holder's KV cache than
    its current one are declined like a stale epoch."""
    decode, prefill = node_spec("decode-0"), node_spec("prefill-0", PREFILL, port=5700)
    decode.registration_generation = 2
    async with Heartbeats(stub, decode, prefill):
        for conversation, generation, decision in (
            ("conv-old", 1, registry_pb2.HINT_DECISION_RECOMPUTE),
            ("conv-now", 2, registry_pb2.HINT_DECISION_REUSE),
        ):
            request = registry_pb2.GrantLeaseRequest(
                conversation_id=conversation,
                node_id=decode.node_id,
                node_incarnation=decode.incarnation,
                handle=handle(f"req-{conversation}", 512, decode),
                block_hashes=block_hashes(512),
                token_count=512,
            )
            request.handle.remote_registration_generation = generation
            await stub.GrantLease(request, timeout=5)
            hint = await placed(stub, conversation, prefill, READ, prompt_tokens=600)
            assert hint.decision == decision, (conversation, hint.reason)
            if decision == registry_pb2.HINT_DECISION_RECOMPUTE:
                assert hint.no_reuse == registry_pb2.NO_REUSE_REASON_LEASE_NOT_LIVE
                assert "registration generation 1" in hint.reason


async def test_an_uncalibrated_gpu_fleet_weighs_reads_at_gpu_costs(
    stub: RegistryServiceStub,
) -> None:
    """Until calibrated, the planner's READ cost is the GPU one for nodes whose KV is in GPU
    memory (NIXL's per-descriptor cost, not a CPU copy's per-block one)."""
    estimates = {}
    for device in (node_pb2.KV_DEVICE_CPU, node_pb2.KV_DEVICE_CUDA):
        decode = node_spec(f"decode-{device}")
        prefill = node_spec(f"prefill-{device}", PREFILL, port=5700 + device)
        decode.kv_device = prefill.kv_device = device
        decode.model = prefill.model = f"model-{device}"
        async with Heartbeats(stub, decode, prefill):
            await grant(stub, decode, f"conv-{device}", "req-1", tokens=4096)
            request = registry_pb2.GetRoutingHintRequest(
                conversation_id=f"conv-{device}",
                model=f"model-{device}",
                prompt_tokens=4200,
                dry_run=True,
            )
            hint = (await stub.GetRoutingHint(request, timeout=5)).hint
            (read,) = [e for e in hint.estimates if e.path == READ]
            estimates[device] = read.ttft_ms
    assert estimates[node_pb2.KV_DEVICE_CUDA] < estimates[node_pb2.KV_DEVICE_CPU]
