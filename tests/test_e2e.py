"""End to end on real parts: registry, two sidecars, a prefill and a decode vLLM CPU server
with kvbroker's connector, real NIXL reads, and the router in front.

One stack serves the whole module (starting it takes about a minute on 2 cores). The proof
that P read from D is P's own NIXL telemetry (only a D->P read is initiated by P).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import signal
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvbroker.common.client.grpc_client import RegistryEndpoint, open_channel, registry_stub
from kvbroker.common.process.ports import free_port
from kvbroker.common.process.supervisor import Announces, ChildProcess, http_ok
from kvbroker.common.rules.handles import prefill_params
from kvbroker.v1 import lease_pb2, registry_pb2
from kvbroker_tools.harness.turns import retained_after
from kvbroker_tools.stack import KVBROKER, Stack, router_command
from tests.e2e_stack import MODEL, e2e_marks, stack_fixture

# Re-exported: tests/test_e2e_fleets.py takes it from here.
from tests.e2e_stack import user_message as user_message  # noqa: PLC0414

pytestmark = e2e_marks()

stack = stack_fixture(
    # Turns read (the D->P path this module checks); test_e2e_paths covers the others.
    registry_flags=(
        "--revoke-grace",
        "0.5",
        "--claim-timeout",
        "5",
        "--max-local-prefill-tokens",
        "0",
    ),
)


async def metric(client: httpx.AsyncClient, base_url: str, name: str) -> float:
    """Sum of a metric's samples on one vLLM server."""
    text = (await client.get(f"{base_url}/metrics")).text
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                total += sample.value
    return total


async def reads_by_prefill(stack: Stack, client: httpx.AsyncClient) -> float:
    return await metric(client, stack.url(stack.prefill), "vllm:nixl_xfer_time_seconds_count")


async def chat(
    stack: Stack,
    client: httpx.AsyncClient,
    messages: list[dict[str, str]],
    session: str | None,
    stream: bool = False,
    max_tokens: int = 12,
    router_url: str | None = None,
) -> tuple[str, httpx.Headers]:
    router_url = router_url or stack.router_url
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    if session is not None:
        body["session_id"] = session
    if not stream:
        response = await client.post(f"{router_url}/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["message"]["content"], response.headers
    body["stream"] = True
    parts: list[str] = []
    async with client.stream("POST", f"{router_url}/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[6:])
                assert "error" not in event, event
                delta = event["choices"][0]["delta"]
                parts.append(delta.get("content") or "")
        return "".join(parts), response.headers


async def conversation(
    stack: Stack,
    client: httpx.AsyncClient,
    session: str | None,
    turns: int,
    stream: bool = False,
    seed: int = 99,
) -> tuple[list[str], list[float]]:
    """A growing conversation; returns each answer and P's read count after each turn. Its
    system prompt comes from ``seed``: a conversation that starts as another one still
    retained does is a fork, whose first turn reads that one's KV by content."""
    messages = [{"role": "system", "content": user_message(seed, lines=10)}]
    answers, reads = [], []
    epoch = 0
    for turn in range(turns):
        messages.append({"role": "user", "content": user_message(turn)})
        answer, _ = await chat(stack, client, messages, session, stream=stream)
        messages.append({"role": "assistant", "content": answer})
        answers.append(answer)
        reads.append(await reads_by_prefill(stack, client))
        if session is not None:  # D's retention report has reached the registry
            epoch = await retained_after(stack.registry_address, session, epoch)
    return answers, reads


async def current_lease(stack: Stack, session: str) -> lease_pb2.Lease:
    async with open_channel(RegistryEndpoint.parse(stack.registry_address)) as channel:
        conversation = (
            await registry_stub(channel).GetConversation(
                registry_pb2.GetConversationRequest(conversation_id=session), timeout=5
            )
        ).conversation
        response = await registry_stub(channel).GetLease(
            registry_pb2.GetLeaseRequest(lease_id=conversation.lease_id), timeout=5
        )
        return response.lease


async def test_prefill_reads_history_from_decode_and_outputs_match(
    stack: Stack, http: httpx.AsyncClient
) -> None:
    start = await reads_by_prefill(stack, http)
    with_reuse, reads = await conversation(stack, http, "conv-e2e", turns=4)
    # Turn 1 has nothing to read; every later turn reads the history from D.
    assert reads[0] == start
    assert [b - a for a, b in zip([start, *reads], reads, strict=False)][1:] == [1, 1, 1]
    bytes_read = await metric(http, stack.url(stack.prefill), "vllm:nixl_bytes_transferred_sum")
    assert bytes_read > 0

    before_plain = await reads_by_prefill(stack, http)
    without_reuse, plain_reads = await conversation(stack, http, None, turns=4)
    assert plain_reads[-1] == before_plain  # reuse off: no read at all
    assert with_reuse == without_reuse


async def test_two_router_replicas_serve_alternate_turns_with_reuse(
    stack: Stack, http: httpx.AsyncClient
) -> None:
    port = free_port()
    second = f"http://127.0.0.1:{port}"
    replica = ChildProcess(
        "router-2",
        router_command(stack.registry_address, f"127.0.0.1:{port}"),
        stack.config.workdir / "router-2.log",
        ready=[http_ok(f"{second}/health", within_s=10, every_s=0.1)],
    )
    try:
        await replica.start()
        messages = [{"role": "system", "content": user_message(60, lines=10)}]
        reads = [await reads_by_prefill(stack, http)]
        epoch = 0
        for turn in range(4):
            messages.append({"role": "user", "content": user_message(61 + turn)})
            router = (stack.router_url, second)[turn % 2]
            answer, headers = await chat(stack, http, messages, "conv-replicas", router_url=router)
            assert headers["x-kvbroker-decision"] == ("MISS" if turn == 0 else "REUSE")
            messages.append({"role": "assistant", "content": answer})
            reads.append(await reads_by_prefill(stack, http))
            epoch = await retained_after(stack.registry_address, "conv-replicas", epoch)
        assert [b - a for a, b in itertools.pairwise(reads)] == [0, 1, 1, 1]
    finally:
        await replica.stop()


async def test_streaming_turns_are_retained_and_reused(
    stack: Stack, http: httpx.AsyncClient
) -> None:
    start = await reads_by_prefill(stack, http)
    streamed, reads = await conversation(stack, http, "conv-stream", 3, stream=True, seed=98)
    assert reads[-1] - start == 2  # turns 2 and 3 read from D
    plain, _ = await conversation(stack, http, None, turns=3, seed=98)
    assert streamed == plain


async def test_stripped_reasoning_gets_partial_reuse_and_same_output(
    stack: Stack, http: httpx.AsyncClient
) -> None:
    system = {"role": "system", "content": user_message(50, lines=20)}
    first = [system, {"role": "user", "content": user_message(51)}]
    answer, _ = await chat(stack, http, first, "conv-strip", max_tokens=24)
    await retained_after(stack.registry_address, "conv-strip", 0)
    held = await current_lease(stack, "conv-strip")
    # The client drops the first half of the answer (as clients drop reasoning traces).
    edited = [*first, {"role": "assistant", "content": answer[len(answer) // 2 :]},
              {"role": "user", "content": user_message(52)}]  # fmt: skip
    bytes_before = await metric(http, stack.url(stack.prefill), "vllm:nixl_bytes_transferred_sum")
    reused, headers = await chat(stack, http, edited, "conv-strip")
    assert headers["x-kvbroker-decision"] == "REUSE"
    bytes_read = (
        await metric(http, stack.url(stack.prefill), "vllm:nixl_bytes_transferred_sum")
        - bytes_before
    )
    full_bytes = sum(len(g.block_ids) for g in held.handle.remote_block_groups) * (
        await _bytes_per_block(stack)
    )
    # Only the verified prefix (system prompt and first question) may be read, never all.
    assert bytes_read < full_bytes
    plain, _ = await chat(stack, http, edited, None)
    assert reused == plain


async def _bytes_per_block(stack: Stack) -> int:
    async with open_channel(RegistryEndpoint.parse(stack.registry_address)) as channel:
        node = (
            await registry_stub(channel).GetNode(
                registry_pb2.GetNodeRequest(node_id="decode-0"), timeout=5
            )
        ).node
    return int(node.spec.bytes_per_block)


async def kv_usage(stack: Stack, client: httpx.AsyncClient) -> float:
    return await metric(client, stack.url(stack.decode), "vllm:kv_cache_usage_perc")


async def test_closing_a_session_frees_decode_blocks_within_seconds(
    stack: Stack, http: httpx.AsyncClient
) -> None:
    baseline = await kv_usage(stack, http)  # other tests' conversations are still retained
    messages = [{"role": "user", "content": user_message(70, lines=40)}]
    await chat(stack, http, messages, "conv-close")
    await retained_after(stack.registry_address, "conv-close", 0)
    assert await kv_usage(stack, http) > baseline  # D retains the turn
    closed = await http.delete(f"{stack.router_url}/v1/sessions/conv-close")
    assert closed.status_code == 200 and closed.json()["state"] == "REVOKED"
    loop = asyncio.get_running_loop()
    started = loop.time()
    while await kv_usage(stack, http) > baseline:
        assert loop.time() - started < 5.0, "blocks still held 5 s after the close"
        await asyncio.sleep(0.1)


async def test_stale_handles_are_declined_and_the_turn_recomputes(
    stack: Stack, http: httpx.AsyncClient
) -> None:
    messages = [{"role": "user", "content": user_message(80, lines=30)}]
    first_answer, _ = await chat(stack, http, messages, "conv-stale")
    await retained_after(stack.registry_address, "conv-stale", 0)
    turn1 = await current_lease(stack, "conv-stale")
    messages += [{"role": "assistant", "content": first_answer},
                 {"role": "user", "content": user_message(81)}]  # fmt: skip
    await chat(stack, http, messages, "conv-stale")
    await retained_after(stack.registry_address, "conv-stale", turn1.epoch)
    turn2 = await current_lease(stack, "conv-stale")
    assert turn2.epoch == turn1.epoch + 1

    messages += [{"role": "user", "content": user_message(82)}]
    stale_epoch = lease_pb2.Lease()
    stale_epoch.CopyFrom(turn2)
    stale_epoch.epoch = turn1.epoch
    for handle in (turn1, stale_epoch):  # a superseded lease; a live lease at an old epoch
        reads = await reads_by_prefill(stack, http)
        body = {"model": MODEL, "messages": messages, "max_tokens": 1, "temperature": 0,
                "kv_transfer_params": prefill_params(handle)}  # fmt: skip
        response = await http.post(f"{stack.url(stack.prefill)}/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        assert await reads_by_prefill(stack, http) == reads  # declined: nothing read
        plain = {**body, "kv_transfer_params": prefill_params(None)}
        recomputed = await http.post(f"{stack.url(stack.prefill)}/v1/chat/completions", json=plain)
        assert (
            response.json()["choices"][0]["message"]["content"]
            == recomputed.json()["choices"][0]["message"]["content"]
        )


async def test_params_without_transfer_flags_do_not_leak_blocks(
    stack: Stack, http: httpx.AsyncClient
) -> None:
    baseline = await kv_usage(stack, http)
    body = {"model": MODEL, "prompt": user_message(90, lines=30), "max_tokens": 4,
            "temperature": 0, "kv_transfer_params": {"note": "neither flag"}}  # fmt: skip
    response = await http.post(f"{stack.url(stack.decode)}/v1/completions", json=body)
    assert response.status_code == 200, response.text
    for _ in range(50):
        if await kv_usage(stack, http) <= baseline:
            break
        await asyncio.sleep(0.1)
    assert await kv_usage(stack, http) <= baseline


def _processes() -> list[tuple[int, int, int]]:
    """(pid, parent pid, process group) of every process."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                stat = (entry / "stat").read_text()
                fields = stat[stat.rindex(")") + 2 :].split()
                found.append((int(entry.name), int(fields[1]), int(fields[2])))
    return found


async def test_up_prints_its_addresses_and_stops_everything(tmp_path: Path) -> None:
    """`kvbroker up` as a user runs it: ready line, a working router, SIGTERM, nothing left."""
    up = ChildProcess(
        "up", [KVBROKER, "up", "--workdir", str(tmp_path / "up")], None,
        ready=[Announces(within_s=600)],
    )  # fmt: skip
    try:
        await up.start()
        ready = up.announced
        async with httpx.AsyncClient(timeout=60) as client:
            models = (await client.get(f"{ready['router']}/v1/models")).json()
        assert [m["id"] for m in models["data"]] == [MODEL]
        # Each part runs in its own process group, led by a child of `kvbroker up`.
        groups = {pid for pid, parent, _ in _processes() if parent == up.pid}
        assert len(groups) == 6  # registry, 2 sidecars, 2 vLLM servers, router
    finally:
        up.kill(signal.SIGTERM)
        assert await asyncio.wait_for(up.wait(), 60) == 0
    assert [pid for pid, _, group in _processes() if group in groups] == []


async def test_back_to_back_turns_of_concurrent_conversations_find_the_latest_kv(
    stack: Stack, http: httpx.AsyncClient
) -> None:
    """Each turn is sent the moment the previous answer arrives, four conversations at once:
    the registry must know of each turn's retention before the next turn's hint (it waits for
    a turn still finishing), so every turn after the first reuses, with reuse-off output."""

    async def agent(index: int, session: str | None) -> tuple[list[str], list[str]]:
        messages = [{"role": "system", "content": user_message(120 + index, lines=10)}]
        answers, decisions = [], []
        for turn in range(3):
            messages.append({"role": "user", "content": user_message(130 + 3 * index + turn)})
            answer, headers = await chat(stack, http, messages, session)
            messages.append({"role": "assistant", "content": answer})
            answers.append(answer)
            decisions.append(headers["x-kvbroker-decision"])
        return answers, decisions

    with_reuse = await asyncio.gather(*(agent(i, f"conv-b2b-{i}") for i in range(4)))
    for _, decisions in with_reuse:
        assert decisions == ["MISS", "REUSE", "REUSE"], decisions
    without = await asyncio.gather(*(agent(i, None) for i in range(4)))
    assert [answers for answers, _ in with_reuse] == [answers for answers, _ in without]


async def test_a_decode_node_vanishing_before_the_read_means_recompute(
    stack: Stack, http: httpx.AsyncClient
) -> None:
    """Runs last: it kills the module's decode server."""
    messages = [{"role": "user", "content": user_message(95, lines=30)}]
    answer, _ = await chat(stack, http, messages, "conv-vanish")
    await retained_after(stack.registry_address, "conv-vanish", 0)
    held = await current_lease(stack, "conv-vanish")
    messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "so?"}]
    await stack.kill_engine(stack.decode)
    # Within the node's session TTL the lease still checks out, so P tries to read from a
    # node that is gone; the failed read must turn into a recompute, not a failed request.
    body = {"model": MODEL, "messages": messages, "max_tokens": 1, "temperature": 0}
    reuse = {**body, "kv_transfer_params": prefill_params(held)}
    response = await http.post(f"{stack.url(stack.prefill)}/v1/chat/completions", json=reuse)
    assert response.status_code == 200, response.text
    plain = {**body, "kv_transfer_params": prefill_params(None)}
    recomputed = await http.post(f"{stack.url(stack.prefill)}/v1/chat/completions", json=plain)
    assert (
        response.json()["choices"][0]["message"]["content"]
        == recomputed.json()["choices"][0]["message"]["content"]
    )
