"""The fault matrix, end to end on real vLLM CPU servers with reuse on: every turn of a
conversation that meets a fault is still served, token-identical with reuse off, a 2xx with
the right decision headers, and no hint of it cut short waiting for a retention report
(``kvbroker_tools.harness.turns``).

The faults: a first turn too short to read back followed by a long one; a client that goes
away mid-stream and sends its next turn; a registry (memory store) restarted between two
turns; a registry that hangs (SIGSTOP) through a turn; the decode engine restarted between two
turns (its leases end, the next turn recomputes); the prefill engine killed while it serves a
READ (the decode node computes the turn itself).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvbroker.common.process.tasks import poll_until
from kvbroker.router.config import RouterConfig
from kvbroker.v1 import lease_pb2
from kvbroker_tools.harness.turns import ask, checked_turn, current_lease, retained_after
from kvbroker_tools.stack import Stack
from tests.e2e_stack import e2e_marks, stack_fixture, user_message
from tests.test_e2e import metric

# The stack's router runs at its default hint deadline.
HINT_TIMEOUT_S = RouterConfig.hint_timeout_s

pytestmark = e2e_marks(timeout_s=1200)


stack = stack_fixture()


def opening(seed: int, lines: int = 20) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": user_message(seed, lines=lines)},
        {"role": "user", "content": user_message(seed + 1, lines=lines)},
    ]


def follow_up(messages: list[dict[str, str]], answer: str, question: str) -> None:
    messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": question}]


async def first_turn(
    stack: Stack, http: httpx.AsyncClient, session: str, seed: int
) -> tuple[list[dict[str, str]], int]:
    """A conversation's first turn, checked; returns its messages so far and the epoch of
    the lease its retention was granted."""
    messages = opening(seed)
    answer = await checked_turn(stack, http, messages, session)
    assert (answer.decision, answer.consistency) == ("MISS", "EXACT")
    epoch = await retained_after(stack.registry_address, session, 0)
    follow_up(messages, answer.text, "and what follows from that?")
    return messages, epoch


async def routed_by_the_registry(stack: Stack, http: httpx.AsyncClient) -> None:
    """Waits until the router gets hints from the registry again (after it came back)."""

    async def exact() -> bool:
        answer = await ask(stack, http, [{"role": "user", "content": "ping"}], None, 1)
        return answer.status == 200 and answer.consistency == "EXACT"

    await poll_until(exact, 30, "the router getting hints again", every_s=0.2)


async def test_a_turn_too_short_to_read_back_then_a_long_one(
    stack: Stack, http: httpx.AsyncClient
) -> None:
    messages = [{"role": "user", "content": "hi"}]
    short = await checked_turn(stack, http, messages, "conv-short", max_tokens=4)
    assert short.consistency == "EXACT"
    follow_up(messages, short.text, user_message(40, lines=30))
    long = await checked_turn(stack, http, messages, "conv-short")
    assert long.consistency == "EXACT"
    follow_up(messages, long.text, "and then?")
    assert (await checked_turn(stack, http, messages, "conv-short")).consistency == "EXACT"


async def test_a_client_gone_mid_stream_then_its_next_turn(
    stack: Stack, http: httpx.AsyncClient
) -> None:
    """The client reads one event of its second turn and hangs up: the decode engine aborts
    the turn (and says it retained nothing), and the third turn is served without waiting
    for that turn's retention."""
    messages, _ = await first_turn(stack, http, "conv-gone", seed=50)
    body = {
        "model": stack.config.served_model,
        "messages": messages,
        "max_tokens": 400,
        "temperature": 0,
        "stream": True,
        "session_id": "conv-gone",
    }
    url = f"{stack.router_url}/v1/chat/completions"
    async with http.stream("POST", url, json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                break  # hang up after the first event
    # The client never saw an answer: it asks anew.
    messages[-1] = {"role": "user", "content": "let me ask that differently: why?"}
    answer = await checked_turn(stack, http, messages, "conv-gone")
    assert answer.consistency == "EXACT"


async def test_the_registry_restarted_between_two_turns(
    stack: Stack, http: httpx.AsyncClient
) -> None:
    """A memory-store registry forgets everything when it restarts; the sidecars register
    again and replay what their engines retain, and the next turn reuses it."""
    messages, epoch = await first_turn(stack, http, "conv-restart", seed=60)
    await stack.restart_registry()
    replayed = await current_lease(stack.registry_address, "conv-restart")
    assert replayed is not None and replayed.epoch == epoch
    await routed_by_the_registry(stack, http)
    answer = await checked_turn(stack, http, messages, "conv-restart")
    assert (answer.decision, answer.consistency) == ("REUSE", "EXACT")


@dataclass(frozen=True)
class Observed:
    count: float
    seconds: float


async def router_overhead(stack: Stack, http: httpx.AsyncClient) -> Observed:
    """The router's overhead histogram (parsing and the routing hint, per turn) so far."""
    text = (await http.get(f"{stack.router_url}/metrics")).text
    totals = {"_count": 0.0, "_sum": 0.0}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            for suffix in totals:
                if sample.name == f"kvbroker_router_overhead_seconds{suffix}":
                    totals[suffix] += sample.value
    return Observed(totals["_count"], totals["_sum"])


async def test_a_registry_that_hangs_through_a_turn(stack: Stack, http: httpx.AsyncClient) -> None:
    """SIGSTOPped, the registry keeps its port and answers nothing: the router's hint deadline
    passes and the turn is served plain P/D (DEGRADED) at once; resumed, the next turn is
    routed by it again."""
    messages, _ = await first_turn(stack, http, "conv-hung", seed=70)
    off = await ask(stack, http, messages, None)

    async def both_listed() -> bool:
        # What the router routes by while the registry hangs: its last node list, read again
        # when a hint named nodes it lacked (its list may date from the registry's restart).
        ready = (await http.get(f"{stack.router_url}/health")).json()["ready_nodes"]
        return bool(ready == {"prefill": 1, "decode": 1})

    await poll_until(both_listed, 30, "the router's list to hold both nodes", every_s=0.1)
    waited_before = await router_overhead(stack, http)
    stack.pause_registry(True)
    try:
        # Served while the registry is still stopped: the router waited for nothing of it
        # but its deadline.
        hung = await ask(stack, http, messages, "conv-hung")
    finally:
        stack.pause_registry(False)
    assert hung.status == 200, hung.text
    assert hung.text == off.text
    assert (hung.decision, hung.consistency, hung.path) == ("MISS", "DEGRADED", "RECOMPUTE")
    # The router's own wait before the prefill leg (its overhead histogram: engine time, which
    # a busy machine stretches, is not in it) is the hint's deadline, at most twice over when
    # the hint queued behind a batch in flight (``Router._plan_once``), and no more.
    waited = await router_overhead(stack, http)
    assert waited.count == waited_before.count + 1
    assert waited.seconds - waited_before.seconds <= 2 * HINT_TIMEOUT_S + 0.5
    follow_up(messages, hung.text, "one more thing?")
    await routed_by_the_registry(stack, http)
    assert (await checked_turn(stack, http, messages, "conv-hung")).consistency == "EXACT"


async def test_the_decode_engine_restarted_between_two_turns(
    stack: Stack, http: httpx.AsyncClient
) -> None:
    """The engine comes back with nothing retained: its sidecar's replay ends the
    conversation's lease, and the next turn recomputes instead of reading blocks that are
    gone."""
    messages, epoch = await first_turn(stack, http, "conv-d-restart", seed=80)
    await stack.restart_engine(stack.decode)

    async def lease_ended() -> bool:
        lease = await current_lease(stack.registry_address, "conv-d-restart")
        assert lease is not None and lease.epoch == epoch
        return lease.state not in (lease_pb2.LEASE_STATE_ACTIVE, lease_pb2.LEASE_STATE_CLAIMED)

    await poll_until(lease_ended, 30, "the restarted decode engine's lease ended")
    answer = await checked_turn(stack, http, messages, "conv-d-restart")
    assert answer.decision != "REUSE"
    assert answer.consistency == "EXACT"


async def test_the_prefill_engine_killed_during_a_read(
    stack: Stack, http: httpx.AsyncClient
) -> None:
    """The only prefill node dies while it serves a turn that reads the history from the
    decode node: the decode node computes the turn itself, and the client gets the same
    answer. (Last: the prefill engine stays dead.)"""
    messages, _ = await first_turn(stack, http, "conv-p-dies", seed=90)
    messages[-1] = {"role": "user", "content": user_message(91, lines=200)}  # a bulk suffix
    off = await ask(stack, http, messages, None)
    prefill_url = stack.url(stack.prefill)
    assert await metric(http, prefill_url, "vllm:num_requests_running") == 0
    turn = asyncio.create_task(ask(stack, http, messages, "conv-p-dies", path="READ"))

    async def prefilling() -> bool:
        return await metric(http, prefill_url, "vllm:num_requests_running") > 0

    await poll_until(prefilling, 30, "the prefill engine serving the turn", every_s=0.005)
    await stack.kill_engine(stack.prefill)
    answer = await turn
    assert answer.status == 200, answer.text
    assert answer.text == off.text
    assert answer.path == "DECODE_LOCAL"
