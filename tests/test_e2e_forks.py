"""Forks reuse what their parent retained, found by content (issue 41), end to end on real
vLLM CPU servers through the router.

A parent conversation of two turns (REUSE on the second); then a sub-agent whose messages are
the parent's whole history, its last answer included, plus a task of its own, under a new
session id and no header. Its prefill engine finds the parent's lease by its prompt's prefix
hashes (MatchPrefix, through its sidecar) and reads the parent's KV from the decode node,
computing only what follows the shared prefix; its answer is token for token the same request's
with reuse off (no session id: plain P/D, which is never matched by content); the parent's
lease stays the parent's, and its next turn is REUSE. Four forks at once all read the parent's
KV and answer as with reuse off. A fork under another tenant's scoped id reads nothing. A fork's
read pin ends when its prefill does.

Turns without any session id (plain OpenAI clients, AIPerf at its defaults): the router names
each in kvbroker's namespace, so D retains it and the client's next sessionless turn reads it
by content; the new lease supersedes the one it holds all of, so the conversation keeps one
lease. Two sessionless conversations of one opening each read and keep their own. Reuse off is
a second router on the same fleet with ``--no-retain-sessionless``: its sessionless turns are
plain P/D, never retained nor matched, and every answer is token for token the same.

The observable that P computed only the part past the shared prefix: P's own counters
(``vllm:request_prefill_kv_computed_tokens`` and its NIXL reads, ``bench.turns.
prefill_totals``), per turn, against the prompt's size and the parent's retained tokens.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest_asyncio

from kvbroker.common.process.ports import free_port
from kvbroker.common.process.supervisor import ChildProcess
from kvbroker.common.process.tasks import poll_until
from kvbroker.common.rules.engine_metrics import Totals
from kvbroker.common.rules.sessionless import is_sessionless
from kvbroker.v1 import lease_pb2
from kvbroker_tools.bench.turns import prefill_totals
from kvbroker_tools.harness.turns import current_lease, retained_after
from kvbroker_tools.stack import Stack, router_command, router_routing
from tests.e2e_stack import MODEL, e2e_marks, stack_fixture, user_message

pytestmark = e2e_marks()

LIVE = (lease_pb2.LEASE_STATE_ACTIVE, lease_pb2.LEASE_STATE_CLAIMED)
# The stack's block size (StackConfig's default): the granularity of a verified prefix.
BLOCK = 32


stack = stack_fixture(retain_sessionless=True)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def plain_router(stack: Stack) -> AsyncIterator[str]:
    """A second router on the same fleet with --no-retain-sessionless: reuse off for a turn
    without a session id (plain P/D, retained for nothing and never matched)."""
    listen = f"127.0.0.1:{free_port()}"
    url = f"http://{listen}"
    router = ChildProcess(
        "router-plain",
        [*router_command(stack.registry_address, listen), "--no-retain-sessionless"],
        stack.config.workdir / "router-plain.log",
        ready=[router_routing(url, stack.config.served_model)],
        env=stack.kvbroker_env(),
    )
    await router.start()
    try:
        yield url
    finally:
        await router.stop()


@dataclass(frozen=True)
class Answered:
    text: str
    decision: str
    path: str
    prompt_tokens: int
    # What P did for this turn alone: tokens it computed, and its reads from D.
    computed: float
    reads: float
    # The session id the router named a sessionless turn by ("" when none).
    named: str = ""
    # What the router said P read by content (x-kvbroker-read-by-content; 0: nothing).
    read_by_content: int = 0


async def ask(
    stack: Stack,
    http: httpx.AsyncClient,
    messages: list[dict[str, str]],
    session: str | None,
    router_url: str | None = None,
) -> tuple[str, str, str, int, str, int]:
    """The answer, the router's decision and path (from its headers), the prompt's tokens,
    the session id the router named the turn by (sessionless turns), and the tokens it says P
    read by content."""
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": messages,
        "max_tokens": 12,
        "temperature": 0,
    }
    if session is not None:
        body["session_id"] = session
    url = router_url or stack.router_url
    response = await http.post(f"{url}/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    answer = response.json()
    return (
        answer["choices"][0]["message"]["content"],
        response.headers.get("x-kvbroker-decision", ""),
        response.headers.get("x-kvbroker-path", ""),
        int(answer["usage"]["prompt_tokens"]),
        response.headers.get("x-kvbroker-session-id", ""),
        int(response.headers.get("x-kvbroker-read-by-content", "0")),
    )


async def p_totals(stack: Stack, http: httpx.AsyncClient, after: Totals | None = None) -> Totals:
    """P's totals, once they count every prefill finished since ``after`` (vLLM observes a
    request's histograms when it finishes)."""
    url = stack.url(stack.prefill)
    if after is None:
        return await prefill_totals(http, url)

    async def caught_up() -> Totals | None:
        now = await prefill_totals(http, url)
        return now if now.prefills > after.prefills else None

    now = await poll_until(caught_up, 30, "P's metrics counting the turn's prefill")
    assert now is not None
    return now


async def turn(
    stack: Stack,
    http: httpx.AsyncClient,
    messages: list[dict[str, str]],
    session: str | None,
    router_url: str | None = None,
) -> Answered:
    """One turn alone on the stack (through ``router_url``, else the stack's router), with
    what P did for it; with a session id, given or named by the router, until D's retention
    of it has reached the registry."""
    before = await p_totals(stack, http)
    lease = await current_lease(stack.registry_address, session) if session else None
    text, decision, path, prompt_tokens, named, read_by_content = await ask(
        stack, http, messages, session, router_url
    )
    # A turn on the decode node alone has no prefill leg: P did nothing.
    after = await p_totals(stack, http, None if path == "DECODE_LOCAL" else before)
    retained = session or named
    if retained:
        await retained_after(stack.registry_address, retained, lease.epoch if lease else 0)
    return Answered(
        text,
        decision,
        path,
        prompt_tokens,
        after.computed_tokens - before.computed_tokens,
        after.reads - before.reads,
        named,
        read_by_content,
    )


def history(seed: int) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": user_message(seed, lines=30)},
        {"role": "user", "content": user_message(seed + 1, lines=30)},
    ]


def task(n: int) -> dict[str, str]:
    return {"role": "user", "content": f"Sub-task {n}: list the names above, one per line."}


async def parent_of_two_turns(
    stack: Stack, http: httpx.AsyncClient, session: str, seed: int
) -> tuple[list[dict[str, str]], lease_pb2.Lease]:
    """The parent's two turns (the second REUSE); its messages with the last answer, and its
    lease."""
    messages = history(seed)
    first = await turn(stack, http, messages, session)
    messages += [
        {"role": "assistant", "content": first.text},
        {"role": "user", "content": user_message(seed + 2, lines=4)},
    ]
    second = await turn(stack, http, messages, session)
    assert second.decision == "REUSE"
    messages.append({"role": "assistant", "content": second.text})
    lease = await current_lease(stack.registry_address, session)
    assert lease is not None and lease.state in LIVE
    return messages, lease


async def unpinned(stack: Stack, session: str) -> bool:
    """The conversation's lease is live and no fork's read pin holds it any longer (P's
    engine ended its pin when the fork's prefill finished)."""
    lease = await current_lease(stack.registry_address, session)
    return lease is not None and lease.state in LIVE and not lease.HasField("pin_time_to_live")


def assert_read_the_parent(fork: Answered, parent: lease_pb2.Lease) -> None:
    """P read from D once and computed only what follows the shared prefix: at most the
    prompt past the parent's retained tokens, plus the blocks the verified prefix stops short
    of them (the parent's unfinished last block, and the tokens the template re-renders)."""
    assert fork.reads == 1
    past_parent = fork.prompt_tokens - parent.token_count
    assert fork.computed <= past_parent + 2 * BLOCK, (fork, parent.token_count)
    assert fork.computed < fork.prompt_tokens / 2
    # The router says what P read, though it planned the turn as new: what P did not compute.
    assert 0 < fork.read_by_content <= fork.prompt_tokens, fork
    assert fork.read_by_content >= fork.prompt_tokens - fork.computed - BLOCK, fork


async def test_a_fork_reads_its_parent_s_kv_and_answers_as_with_reuse_off(
    stack: Stack, http: httpx.AsyncClient, plain_router: str
) -> None:
    messages, parent = await parent_of_two_turns(stack, http, "acme/parent", seed=3)
    fork_messages = [*messages, task(1)]

    fork = await turn(stack, http, fork_messages, "acme/sub-agent-1")
    assert fork.decision == "MISS"  # the router knows nothing of it: the engine found it
    assert_read_the_parent(fork, parent)
    await poll_until(
        lambda: unpinned(stack, "acme/parent"), 10, "the fork's pin ended with its prefill"
    )

    # Reuse off: the same request without a session id through the router that retains no
    # sessionless turn is plain P/D, never matched by content.
    off = await turn(stack, http, fork_messages, None, plain_router)
    assert off.reads == 0 and off.computed == off.prompt_tokens == fork.prompt_tokens
    assert fork.text == off.text

    # The parent's lease is still the parent's, and its next turn is REUSE.
    still = await current_lease(stack.registry_address, "acme/parent")
    assert still is not None and still.lease_id == parent.lease_id and still.state in LIVE
    nxt = await turn(stack, http, [*messages, task(2)], "acme/parent")
    assert nxt.decision == "REUSE"


async def test_four_forks_at_once_all_read_the_parent_s_kv(
    stack: Stack, http: httpx.AsyncClient, plain_router: str
) -> None:
    messages, parent = await parent_of_two_turns(stack, http, "acme/parent-4", seed=11)
    forks = [[*messages, task(n)] for n in range(4)]
    before = await p_totals(stack, http)
    answers = await asyncio.gather(
        *(ask(stack, http, fork, f"acme/sub-agent-4-{n}") for n, fork in enumerate(forks))
    )

    async def all_four() -> Totals | None:
        now = await prefill_totals(http, stack.url(stack.prefill))
        return now if now.prefills >= before.prefills + 4 else None

    after = await poll_until(all_four, 30, "P's metrics counting four prefills")
    assert after is not None
    prompts = sum(prompt for _, _, _, prompt, _, _ in answers)
    assert after.reads - before.reads == 4
    # Each fork's answer says P read the parent's KV by content.
    assert all(read > 0 for *_, read in answers), answers
    assert after.computed_tokens - before.computed_tokens <= (
        prompts - 4 * parent.token_count + 4 * 2 * BLOCK
    )
    for fork, (text, *_) in zip(forks, answers, strict=True):
        off = await turn(stack, http, fork, None, plain_router)
        assert text == off.text  # no stale block read: every answer as with reuse off
    still = await current_lease(stack.registry_address, "acme/parent-4")
    assert still is not None and still.lease_id == parent.lease_id and still.state in LIVE
    nxt = await turn(stack, http, [*messages, task(9)], "acme/parent-4")
    assert nxt.decision == "REUSE"


async def test_a_fork_under_another_tenant_resolves_nothing_of_the_parent_s(
    stack: Stack, http: httpx.AsyncClient
) -> None:
    """Scoped ids as the router's ``--api-keys`` makes them (``TENANT/SESSION``): the same
    history under another tenant is computed whole."""
    messages, parent = await parent_of_two_turns(stack, http, "acme/parent-t", seed=19)
    other = await turn(stack, http, [*messages, task(1)], "evil/sub-agent")
    assert other.reads == 0 and other.computed == other.prompt_tokens
    still = await current_lease(stack.registry_address, "acme/parent-t")
    assert still is not None and still.lease_id == parent.lease_id and still.state in LIVE


SUPERSEDED = lease_pb2.LEASE_END_CAUSE_SUPERSEDED


async def sessionless_turns(
    stack: Stack, http: httpx.AsyncClient, opening: list[dict[str, str]], seed: int, turns: int
) -> tuple[list[list[dict[str, str]]], list[Answered]]:
    """A conversation sent with no session id anywhere: each turn's messages (the history
    with the previous answer, then a short new message), and what each turn got."""
    sent: list[list[dict[str, str]]] = []
    answered: list[Answered] = []
    messages = opening
    for n in range(turns):
        sent.append(messages)
        answer = await turn(stack, http, messages, None)
        assert is_sessionless(answer.named)
        answered.append(answer)
        messages = [
            *messages,
            {"role": "assistant", "content": answer.text},
            {"role": "user", "content": user_message(seed + n, lines=4)},
        ]
    return sent, answered


async def assert_read_its_last_turn(
    stack: Stack, previous: Answered, answer: Answered
) -> lease_pb2.Lease:
    """The turn read what the previous sessionless turn retained and computed only past it
    (as a fork does); returns that lease."""
    held = await current_lease(stack.registry_address, previous.named)
    assert held is not None
    assert answer.reads == 1, (answer, held.token_count)
    assert answer.computed <= answer.prompt_tokens - held.token_count + 2 * BLOCK, (
        answer,
        held.token_count,
    )
    return held


async def assert_one_live_lease(stack: Stack, answered: list[Answered]) -> None:
    """Only the last turn's lease is live; each earlier one was superseded by its next."""
    *earlier, last = answered
    for answer in earlier:
        lease = await current_lease(stack.registry_address, answer.named)
        assert lease is not None and lease.end_cause == SUPERSEDED, (answer.named, lease)
    lease = await current_lease(stack.registry_address, last.named)
    assert lease is not None and lease.state in LIVE


async def assert_as_with_reuse_off(
    stack: Stack,
    http: httpx.AsyncClient,
    plain_router: str,
    sent: list[list[dict[str, str]]],
    answered: list[Answered],
) -> None:
    """Every turn's answer is the plain router's for the same messages, and there each turn
    is MISS, P reads nothing and computes the whole prompt: the switch off is today's."""
    for messages, answer in zip(sent, answered, strict=True):
        off = await turn(stack, http, messages, None, plain_router)
        assert off.named == "" and off.decision == "MISS"
        assert off.reads == 0 and off.computed == off.prompt_tokens
        assert off.text == answer.text


async def test_a_sessionless_conversation_reads_its_last_turn_and_keeps_one_lease(
    stack: Stack, http: httpx.AsyncClient, plain_router: str
) -> None:
    sent, answered = await sessionless_turns(stack, http, history(41), seed=61, turns=3)
    first = answered[0]
    assert first.reads == 0 and first.computed == first.prompt_tokens
    for previous, answer in itertools.pairwise(answered):
        await assert_read_its_last_turn(stack, previous, answer)
    assert len({answer.named for answer in answered}) == 3
    await assert_one_live_lease(stack, answered)
    await assert_as_with_reuse_off(stack, http, plain_router, sent, answered)


async def test_two_sessionless_conversations_of_one_opening_keep_their_own_leases(
    stack: Stack, http: httpx.AsyncClient, plain_router: str
) -> None:
    system = {"role": "system", "content": user_message(45, lines=30)}
    a = [system, {"role": "user", "content": user_message(46, lines=10)}]
    b = [system, {"role": "user", "content": user_message(47, lines=10)}]
    sent_a, answered_a = await sessionless_turns(stack, http, a, seed=71, turns=1)
    sent_b, answered_b = await sessionless_turns(stack, http, b, seed=81, turns=1)
    # B's first turn shares only A's opening: it may read that much, and takes nothing.
    lease_a = await current_lease(stack.registry_address, answered_a[0].named)
    assert lease_a is not None and lease_a.state in LIVE
    # Each conversation's next turn reads its own last turn, and supersedes only that.
    for sent, answered, seed in ((sent_a, answered_a, 72), (sent_b, answered_b, 82)):
        messages = [
            *sent[-1],
            {"role": "assistant", "content": answered[-1].text},
            {"role": "user", "content": user_message(seed, lines=4)},
        ]
        sent.append(messages)
        answer = await turn(stack, http, messages, None)
        answered.append(answer)
        # It reads by content, but not always its own last turn: the match tells leases apart
        # only at blocks 2^k - 1, and the other conversation's newer lease shares the opening
        # up to the same one (docs/design.md, sessionless turns).
        assert answer.reads == 1 and answer.computed < answer.prompt_tokens, answer
        await assert_one_live_lease(stack, answered)
    # A's lease now is still A's after B's turn.
    lease_a = await current_lease(stack.registry_address, answered_a[-1].named)
    assert lease_a is not None and lease_a.state in LIVE
    await assert_as_with_reuse_off(stack, http, plain_router, sent_a, answered_a)
    await assert_as_with_reuse_off(stack, http, plain_router, sent_b, answered_b)
