"""Long conversations under concurrency: hints, batches and listings stay small whatever the
context length, through a real registry and a real router (fake engines: the point is the
control plane's messages, not the model).

A 128k-token conversation is 8,192 blocks. Its handle's block ids must travel (P reads them),
but its prefix hashes travel as checkpoints (``kvbroker.common.rules.checkpoints``), and a batch of
hints or a page of leases stops at a byte budget instead of passing gRPC's 4 MiB limit.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace

import httpx
import pytest

from kvbroker.common.client.grpc_client import RegistryEndpoint
from kvbroker.common.process.ports import free_port
from kvbroker.controlplane.config import GRPC_MAX_RECEIVE_BYTES, MAX_HINT_BATCH, RegistryConfig
from kvbroker.controlplane.errors import InvalidArgument
from kvbroker.controlplane.placement.planner import PlannerConfig
from kvbroker.controlplane.records.validation import Validation
from kvbroker.controlplane.server import RunningRegistry
from kvbroker.router.config import RouterConfig
from kvbroker.router.handlers import build_app
from kvbroker.router.proxy import Router
from kvbroker.v1 import lease_pb2, node_pb2, registry_pb2
from kvbroker.v1.registry_pb2_grpc import RegistryServiceStub
from kvbroker_tools.harness.engine import FakeEngine, serving
from kvbroker_tools.harness.factories import Heartbeats, block_hashes, node_spec
from tests.conftest import FAST

MODEL = "tiny-qwen3"


def long_lease_request(
    decode: node_pb2.NodeSpec, conversation: str, tokens: int
) -> registry_pb2.GrantLeaseRequest:
    """What a decode engine reports for a conversation of ``tokens`` tokens: every block's
    prefix hash (an older engine, or a client that does not thin them) and realistic block ids
    (large numbers, as a busy cache hands out)."""
    blocks = tokens // decode.block_size
    return registry_pb2.GrantLeaseRequest(
        conversation_id=conversation,
        node_id=decode.node_id,
        node_incarnation=decode.incarnation,
        handle=lease_pb2.KvHandle(
            remote_engine_id=decode.engine_id,
            remote_request_id=f"req-{conversation}",
            remote_block_groups=[
                lease_pb2.BlockIdGroup(block_ids=range(200_000, 200_000 + blocks))
            ],
            remote_host=decode.side_channel_host,
            remote_port=decode.side_channel_port,
            remote_num_tokens=tokens,
            tp_size=1,
        ),
        block_hashes=block_hashes(tokens, salt=conversation),
        token_count=tokens,
    )


def big_decode_node(name: str, port: int) -> node_pb2.NodeSpec:
    spec = node_spec(name, node_pb2.NODE_ROLE_DECODE, port=port)
    spec.capacity_blocks = spec.retention_budget_blocks = 4_000_000
    return spec


async def grant_all(
    stub: RegistryServiceStub, decode: node_pb2.NodeSpec, prefix: str, n: int, tokens: int
) -> list[str]:
    conversations = [f"{prefix}-{i}" for i in range(n)]
    for conversation in conversations:
        await stub.GrantLease(long_lease_request(decode, conversation, tokens), timeout=10)
    return conversations


@pytest.fixture
def registry_config() -> RegistryConfig:
    """Sessions that survive the seconds this module's shared event loop spends granting and
    serving hundreds of long leases on a busy machine."""
    # Every turn here reads (DECODE_LOCAL off): the handle's size is what is under test.
    return replace(
        FAST,
        heartbeat_interval_s=1.0,
        session_ttl_s=60.0,
        planner=PlannerConfig(max_local_prefill_tokens=0),
    )


@pytest.fixture
async def engines() -> AsyncIterator[tuple[FakeEngine, FakeEngine]]:
    prefill, decode = FakeEngine("prefill-0"), FakeEngine("decode-0")
    async with serving(prefill.app(), prefill.port), serving(decode.app(), decode.port):
        yield prefill, decode


@pytest.mark.parametrize(("conversations", "tokens"), [(120, 32_768), (24, 131_072)])
async def test_concurrent_long_conversations_through_a_router_are_all_answered(
    stub: RegistryServiceStub,
    registry_server: RunningRegistry,
    engines: tuple[FakeEngine, FakeEngine],
    conversations: int,
    tokens: int,
) -> None:
    prefill, decode = engines
    prefill_spec = node_spec("prefill-0", node_pb2.NODE_ROLE_PREFILL, port=prefill.port)
    prefill_spec.http_base_url = prefill.url
    decode_spec = big_decode_node("decode-0", decode.port)
    decode_spec.http_base_url = decode.url
    # Hints may wait: everything here shares one event loop, and the point is their size.
    router = Router(
        RegistryEndpoint.parse(registry_server.address), RouterConfig(hint_timeout_s=10.0)
    )
    port = free_port()
    async with (
        Heartbeats(stub, prefill_spec, decode_spec),
        serving(build_app(router), port),
        httpx.AsyncClient(timeout=60) as client,
    ):
        ids = await grant_all(stub, decode_spec, f"long{tokens}", conversations, tokens)

        async def turn(conversation: str) -> httpx.Response:
            body = {
                "model": MODEL,
                "messages": [{"role": "user", "content": "and then?"}],
                "max_tokens": 3,
                "session_id": conversation,
            }
            return await client.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body)

        responses = await asyncio.gather(*(turn(c) for c in ids))
    assert [(r.status_code, r.text[:200]) for r in responses if r.status_code != 200] == []
    assert {r.headers["x-kvbroker-decision"] for r in responses} == {"REUSE"}
    legs = [leg["kv_transfer_params"] for leg in prefill.received]
    assert len(legs) == conversations
    for params in legs:
        assert len(params["remote_block_ids"][0]) == tokens // 16  # every block id, to read
        assert len(params["kvbroker_block_hashes"]) <= 257  # checkpoints, not 8,192 hashes
        assert params["kvbroker_hash_stride"] == -(-(tokens // 16) // 256)


async def test_a_batch_past_its_byte_budget_answers_the_rest_unclaimed(
    stub: RegistryServiceStub,
) -> None:
    """200 hints of 128k-token conversations are ~5 MiB of answer: the registry answers as many
    as fit under its budget, refuses the rest as BATCH_FULL without claiming their leases, and
    they are answered when sent again."""
    decode = big_decode_node("decode-0", 5600)
    prefill = node_spec("prefill-0", node_pb2.NODE_ROLE_PREFILL, port=5700)
    async with Heartbeats(stub, prefill, decode):
        ids = await grant_all(stub, decode, "batch", 200, 131_072)
        requests = [registry_pb2.GetRoutingHintRequest(conversation_id=c, model=MODEL) for c in ids]
        response = await stub.BatchGetRoutingHints(
            registry_pb2.BatchGetRoutingHintsRequest(requests=requests), timeout=30
        )
        answered = [r for r in response.results if r.HasField("hint")]
        refused = [r for r in response.results if r.HasField("error")]
        assert answered and refused and len(answered) + len(refused) == 200
        assert response.ByteSize() < GRPC_MAX_RECEIVE_BYTES
        assert {r.error.reason for r in refused} == {registry_pb2.ERROR_REASON_BATCH_FULL}
        assert {r.hint.decision for r in answered} == {registry_pb2.HINT_DECISION_REUSE}
        # The refused ones were not claimed: each is still ACTIVE and reusable when asked again.
        for conversation in ids[len(answered) :]:
            (lease,) = (
                await stub.ListLeases(
                    registry_pb2.ListLeasesRequest(conversation_id=conversation), timeout=5
                )
            ).leases
            assert lease.state == lease_pb2.LEASE_STATE_ACTIVE
        again = await stub.BatchGetRoutingHints(
            registry_pb2.BatchGetRoutingHintsRequest(requests=requests[len(answered) :]),
            timeout=30,
        )
        assert all(r.HasField("hint") or r.error.reason == registry_pb2.ERROR_REASON_BATCH_FULL
                   for r in again.results)  # fmt: skip
        assert again.results[0].hint.decision == registry_pb2.HINT_DECISION_REUSE


async def test_listing_many_long_leases_pages_by_bytes(stub: RegistryServiceStub) -> None:
    decode = big_decode_node("decode-0", 5600)
    async with Heartbeats(stub, decode):
        ids = await grant_all(stub, decode, "list", 150, 131_072)
        seen: list[str] = []
        token = ""
        pages = 0
        while True:
            page = await stub.ListLeases(
                registry_pb2.ListLeasesRequest(page_size=1000, page_token=token), timeout=10
            )
            pages += 1
            seen.extend(lease.conversation_id for lease in page.leases)
            token = page.next_page_token
            if not token:
                break
    assert sorted(seen) == sorted(ids)
    assert pages >= 2


# An empty block group in a handle's encoding: field 3, length 0. A handle of such groups holds
# no block, so the registry bounds it only by its record size: the largest hint there is.
EMPTY_GROUP = b"\x1a\x00"


def padded_lease_request(
    decode: node_pb2.NodeSpec, conversation: str, groups: int
) -> registry_pb2.GrantLeaseRequest:
    request = long_lease_request(decode, conversation, 256)
    request.handle.MergeFromString(EMPTY_GROUP * groups)
    return request


def largest_padding(config: RegistryConfig, decode: node_pb2.NodeSpec) -> int:
    """The most empty groups a lease the registry accepts holds (by its own validation)."""
    validate = Validation(config)
    low, high = 0, config.max_record_bytes
    while low < high:
        middle = (low + high + 1) // 2
        request = padded_lease_request(decode, "big-0", middle)
        try:
            validate.retention(request.handle, request.block_hashes, request.token_count)
            low = middle
        except InvalidArgument:
            high = middle - 1
    return low


async def test_no_answer_passes_grpc_s_default_limit_whatever_its_records(
    stub: RegistryServiceStub, registry_config: RegistryConfig
) -> None:
    """The worst batch: hints of the largest records the registry accepts (~1 MB each) up to
    just under the byte budget, then one more of them, then short errors for the rest of 1,000
    requests. Its answer, and a page of the same leases, reach a client with gRPC's default
    4 MiB receive limit (the stub's channel sets none)."""
    decode = big_decode_node("decode-0", 5600)
    prefill = node_spec("prefill-0", node_pb2.NODE_ROLE_PREFILL, port=5700)
    padding = largest_padding(registry_config, decode)
    budget = registry_config.max_answer_bytes
    async with Heartbeats(stub, prefill, decode):
        await stub.GrantLease(padded_lease_request(decode, "big-0", padding), timeout=10)
        probe = registry_pb2.GetRoutingHintRequest(conversation_id="big-0", model=MODEL)
        probe.dry_run = True
        hint = (await stub.GetRoutingHint(probe, timeout=10)).hint
        big = registry_pb2.RoutingHintResult(hint=hint).ByteSize()
        assert big > registry_config.max_record_bytes * 0.98
        fits = budget // big
        bigs = [f"big-{i}" for i in range(fits + 1)]
        for conversation in bigs[1:fits]:
            await stub.GrantLease(padded_lease_request(decode, conversation, padding), timeout=10)
        # A filler that brings the answer to just under the budget before the last big one
        # (a claimed hint is a few bytes longer than the dry run's: 256 bytes of slack).
        filler = padding - (big - (budget - fits * big - 256)) // 2
        await stub.GrantLease(padded_lease_request(decode, "filler", filler), timeout=10)
        await stub.GrantLease(padded_lease_request(decode, bigs[-1], padding), timeout=10)
        conversations = [*bigs[:fits], "filler", bigs[-1]]
        conversations += [f"later-{i:04d}" for i in range(MAX_HINT_BATCH - len(conversations))]
        requests = [registry_pb2.GetRoutingHintRequest(conversation_id=c, model=MODEL)
                    for c in conversations]  # fmt: skip
        response = await stub.BatchGetRoutingHints(
            registry_pb2.BatchGetRoutingHintsRequest(requests=requests), timeout=30
        )
        answered = [r.hint.lease.conversation_id for r in response.results if r.HasField("hint")]
        assert answered == conversations[: fits + 2]  # the last big one crossed the budget
        assert response.results[fits + 2].error.reason == registry_pb2.ERROR_REASON_BATCH_FULL
        assert response.ByteSize() < GRPC_MAX_RECEIVE_BYTES

        page = await stub.ListLeases(
            registry_pb2.ListLeasesRequest(page_size=1000, states=[lease_pb2.LEASE_STATE_CLAIMED]),
            timeout=10,
        )
        assert len(page.leases) == fits + 2 and page.ByteSize() < GRPC_MAX_RECEIVE_BYTES
