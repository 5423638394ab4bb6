"""Retained KV yields to new work, end to end on real vLLM CPU engines.

The decode engine gets a small KV cache (70 blocks of 128 tokens) and no retention budget, so
only memory pressure releases: more idle conversations than it can hold must each be served
promptly (the lowest-value retained ones are reclaimed through the registry), the released
conversations recompute with the same output, their leases say PRESSURE, and once the idle TTL
passes every lease has ended and the engine's KV usage is back to its baseline.
"""

from __future__ import annotations

import asyncio
import statistics
import time

import httpx

from kvbroker.common.client.grpc_client import RegistryEndpoint, open_channel, registry_stub
from kvbroker.v1 import lease_pb2, registry_pb2
from kvbroker_tools.harness.turns import retained_after
from kvbroker_tools.stack import Stack
from tests.e2e_stack import e2e_marks, stack_fixture, user_message
from tests.test_e2e import chat, metric

pytestmark = e2e_marks()

IDLE_TTL_S = 45
# ~1,450 prompt tokens: 12 blocks a conversation, so five fill most of the 70 blocks.
LINES = 60
CONVERSATIONS = 7


stack = stack_fixture(
    # The cache is sized in blocks of vLLM's CPU default, 128 tokens (12 a conversation).
    block_size=128,
    engine_args=("--num-gpu-blocks-override", "70"),
    registry_flags=(
        "--lease-ttl",
        str(IDLE_TTL_S),
        "--no-learn-idle-ttl",
        "--max-local-prefill-tokens",
        "0",  # turns read, as this module measures
    ),
    connector_extra={"kvbroker_retention_max_fraction": 1.0},
)


def opening(index: int) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": user_message(90 + index, lines=4)},
        {"role": "user", "content": user_message(index * 7, lines=LINES)},
    ]


async def timed_chat(
    stack: Stack, http: httpx.AsyncClient, messages: list[dict[str, str]], session: str | None
) -> tuple[str, str, float]:
    started = time.perf_counter()
    answer, headers = await chat(stack, http, messages, session)
    return answer, headers.get("x-kvbroker-decision", ""), time.perf_counter() - started


async def leases(stack: Stack, states: list[lease_pb2.LeaseState]) -> list[lease_pb2.Lease]:
    async with open_channel(RegistryEndpoint.parse(stack.registry_address)) as channel:
        response = await registry_stub(channel).ListLeases(
            registry_pb2.ListLeasesRequest(states=states, page_size=1000), timeout=5
        )
        return list(response.leases)


async def decode_usage(stack: Stack, http: httpx.AsyncClient) -> float:
    return await metric(http, stack.url(stack.decode), "vllm:kv_cache_usage_perc")


async def test_more_idle_conversations_than_the_cache_holds_never_stall(
    stack: Stack, http: httpx.AsyncClient
) -> None:
    await timed_chat(stack, http, opening(50), None)  # the engines' first request warms them
    baseline = statistics.median(
        [(await timed_chat(stack, http, opening(60 + i), None))[2] for i in range(2)]
    )
    answers: dict[int, str] = {}
    for index in range(CONVERSATIONS):
        answer, decision, took = await timed_chat(stack, http, opening(index), f"p-{index}")
        answers[index] = answer
        assert decision == "MISS"
        # The issue measured 468 s here: D full of idle retention, waiting for the hard cap.
        assert took < 3 * baseline + 1.0, (index, took, baseline)
        await retained_after(stack.registry_address, f"p-{index}", 0)

    released = await leases(stack, [lease_pb2.LEASE_STATE_RELEASED])
    under_pressure = [
        lease for lease in released if lease.end_cause == lease_pb2.LEASE_END_CAUSE_PRESSURE
    ]
    assert under_pressure, [(lease.conversation_id, lease.end_reason) for lease in released]
    assert all("memory pressure" in lease.end_reason for lease in under_pressure)
    live = await leases(stack, [])
    assert f"p-{CONVERSATIONS - 1}" in {lease.conversation_id for lease in live}

    # The first conversation was released (lowest value: idle longest): its next turn
    # recomputes, announced as such, with the output reuse off gives.
    first = under_pressure[0].conversation_id
    index = int(first.removeprefix("p-"))
    follow_up = [
        *opening(index),
        {"role": "assistant", "content": answers[index]},
        {"role": "user", "content": user_message(200, lines=3)},
    ]
    recomputed, decision, _ = await timed_chat(stack, http, follow_up, first)
    assert decision == "RECOMPUTE"
    plain, _, _ = await timed_chat(stack, http, follow_up, None)
    assert recomputed == plain

    # The newest conversation is still retained and is read back, with the same output.
    last = CONVERSATIONS - 1
    follow_up = [
        *opening(last),
        {"role": "assistant", "content": answers[last]},
        {"role": "user", "content": user_message(201, lines=3)},
    ]
    reused, decision, _ = await timed_chat(stack, http, follow_up, f"p-{last}")
    assert decision == "REUSE"
    plain, _, _ = await timed_chat(stack, http, follow_up, None)
    assert reused == plain


async def test_idle_leases_end_and_the_cache_returns_to_baseline(
    stack: Stack, http: httpx.AsyncClient
) -> None:
    await timed_chat(stack, http, opening(30), "p-idle")
    await retained_after(stack.registry_address, "p-idle", 0)
    assert "p-idle" in {lease.conversation_id for lease in await leases(stack, [])}
    assert await decode_usage(stack, http) > 0
    deadline = time.monotonic() + IDLE_TTL_S + 30
    while await leases(stack, []) or await decode_usage(stack, http) > 0:
        assert time.monotonic() < deadline, "retained KV outlived the idle TTL"
        await asyncio.sleep(1)
    expired = await leases(stack, [lease_pb2.LEASE_STATE_EXPIRED])
    idle = {lease.conversation_id for lease in expired}
    assert "p-idle" in idle
    assert all(lease.end_cause == lease_pb2.LEASE_END_CAUSE_IDLE for lease in expired)
