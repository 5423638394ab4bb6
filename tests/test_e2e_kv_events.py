"""vLLM's KV cache events (``--kv-events-config``, the ZMQ publisher) under kvbroker, on real
vLLM CPU engines: which blocks each node announces, and when, so that what an event-driven
indexer (llm-d's precise prefix-cache scorer, Dynamo's KV indexer) sees of the KV a decode
node retains is settled by a run rather than by reading vLLM. The findings and what they mean
for those indexers: docs/operate/kv-events.md.

One stack, both engines publishing, P's prefix cache on (with it off P caches nothing, so it
announces nothing). One conversation runs three turns, one per path (RECOMPUTE, READ,
DECODE_LOCAL), and each test settles one question on what the engines published meanwhile:

(a) D announces the blocks it retains at the end of a turn, prompt and answer; a lease that
    ends or retention that yields announces nothing, and BlockRemoved comes only when vLLM
    reuses the blocks for other work;
(b) D announces the prompt blocks it pulled from P over NIXL, under P's hashes;
(c) P announces the blocks it read from D (path READ), under D's hashes.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import msgspec
import pytest_asyncio
import zmq
import zmq.asyncio
from vllm.distributed.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)
from vllm.v1.core.kv_cache_utils import ExternalBlockHash

from kvbroker.common.process.tasks import poll_until
from kvbroker.v1 import lease_pb2
from kvbroker_tools.harness.turns import current_lease, retained_after
from kvbroker_tools.stack import EngineSpec, Stack
from tests.e2e_stack import MODEL, e2e_marks, stack_fixture, user_message
from tests.test_e2e import metric

pytestmark = e2e_marks(timeout_s=600)

# Each engine's whole KV cache, in blocks: small enough that one long prompt has to evict what
# earlier turns left cached.
BLOCKS = 80
BLOCK_SIZE = 32
SESSION = "conv-events"
WAIT_S = 30.0

Event = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True)
class Block:
    """One block a BlockStored event announced."""

    hash: ExternalBlockHash
    parent: ExternalBlockHash | None
    tokens: tuple[int, ...]
    session: str | None


class EventFeed:
    """Every KV event one engine publishes, in order, as a ZMQ subscriber receives them."""

    def __init__(self, context: zmq.asyncio.Context, endpoint: str) -> None:
        self.socket = context.socket(zmq.SUB)
        self.socket.setsockopt(zmq.SUBSCRIBE, b"")
        self._monitor = self.socket.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        self.socket.connect(endpoint)
        self.events: list[Event] = []
        self.seqs: list[int] = []
        self._decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Returns once connected to the engine's publisher: what it publishes from then on
        is received (a SUB socket sees nothing published before it connected)."""
        await asyncio.wait_for(self._monitor.recv_multipart(), WAIT_S)
        self.socket.disable_monitor()
        self._monitor.close(linger=0)
        self._task = asyncio.create_task(self._receive())

    async def _receive(self) -> None:
        while True:
            _topic, seq, payload = await self.socket.recv_multipart()
            self.seqs.append(int.from_bytes(seq, "big"))
            self.events.extend(self._decoder.decode(payload).events)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self.socket.close(linger=0)

    def mark(self) -> int:
        return len(self.events)

    def blocks(self, since: int = 0) -> list[Block]:
        """The blocks announced stored since ``since``, one by one, in order."""
        found = []
        for event in self.events[since:]:
            if not isinstance(event, BlockStored):
                continue
            for index, block_hash in enumerate(event.block_hashes):
                size = event.block_size
                parent = event.parent_block_hash if index == 0 else event.block_hashes[index - 1]
                tokens = tuple(event.token_ids[index * size : (index + 1) * size])
                found.append(Block(block_hash, parent, tokens, event.session_id))
        return found

    def session_blocks(self, session: str | None, since: int = 0) -> list[Block]:
        return [block for block in self.blocks(since) if block.session == session]

    def removed(self, since: int = 0) -> list[ExternalBlockHash]:
        return [
            block_hash
            for event in self.events[since:]
            if isinstance(event, BlockRemoved)
            for block_hash in event.block_hashes
        ]

    def lost_none(self) -> bool:
        """No batch was dropped since the first received (the sequence has no gap)."""
        return self.seqs == list(range(self.seqs[0], self.seqs[0] + len(self.seqs)))

    async def wait_blocks(self, session: str | None, count: int, since: int = 0) -> list[Block]:
        """Waits until at least ``count`` blocks of ``session`` were announced since
        ``since``; returns them all."""

        async def enough() -> bool:
            return len(self.session_blocks(session, since)) >= count

        await poll_until(enough, WAIT_S, f"{count} blocks of {session}", every_s=0.05)
        return self.session_blocks(session, since)


stack = stack_fixture(
    kv_events=True,
    prefill_prefix_caching=True,
    # P reads from D what it lacks however little (here an answer block and D's unfinished
    # one) rather than recomputing anything under vLLM's default of 64 tokens.
    recompute_threshold=16,
    block_size=BLOCK_SIZE,
    max_model_len=(BLOCKS - 1) * BLOCK_SIZE,  # vLLM keeps one block aside
    engine_args=("--num-gpu-blocks-override", str(BLOCKS)),
)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def feeds(stack: Stack) -> AsyncIterator[dict[str, EventFeed]]:
    """Each engine's events by role, subscribed before the first turn."""
    context = zmq.asyncio.Context()
    subscribed = {e.role: EventFeed(context, stack.kv_events_endpoint(e)) for e in stack.engines}
    try:
        await asyncio.gather(*(feed.start() for feed in subscribed.values()))
        yield subscribed
    finally:
        await asyncio.gather(*(feed.stop() for feed in subscribed.values()))
        context.term()


@dataclass(frozen=True)
class Turn:
    path: str
    prompt_tokens: int
    completion_tokens: int
    answer: str

    @property
    def full_blocks(self) -> int:
        """Full blocks of KV the turn leaves: prompt and answer but the last token sampled."""
        return (self.prompt_tokens + self.completion_tokens - 1) // BLOCK_SIZE


async def turn(
    stack: Stack,
    http: httpx.AsyncClient,
    messages: list[dict[str, str]],
    session: str | None,
    path: str | None = None,
    max_tokens: int = 48,
) -> Turn:
    """One turn through the router; with a session, returns once D's retention of it has
    reached the registry."""
    before = await current_lease(stack.registry_address, session) if session else None
    body: dict[str, Any] = {"model": MODEL, "messages": messages, "max_tokens": max_tokens,
                            "temperature": 0}  # fmt: skip
    if session is not None:
        body["session_id"] = session
    headers = {"x-kvbroker-path": path} if path else {}
    response = await http.post(f"{stack.router_url}/v1/chat/completions", json=body,
                               headers=headers)  # fmt: skip
    assert response.status_code == 200, response.text
    if session is not None:
        await retained_after(stack.registry_address, session, before.epoch if before else 0)
    answer = response.json()
    return Turn(
        response.headers["x-kvbroker-path"],
        answer["usage"]["prompt_tokens"],
        answer["usage"]["completion_tokens"],
        answer["choices"][0]["message"]["content"],
    )


async def nixl_reads(stack: Stack, http: httpx.AsyncClient, engine: EngineSpec) -> float:
    """NIXL reads the engine initiated: D's pulls of a prompt from P, P's reads from D."""
    return await metric(http, stack.url(engine), "vllm:nixl_xfer_time_seconds_count")


async def loaded_tokens(stack: Stack, http: httpx.AsyncClient, engine: EngineSpec) -> float:
    """Prompt tokens the engine took from the connector (read from another node) rather than
    computing them."""
    return await metric(http, stack.url(engine), "vllm:external_prefix_cache_hits_total")


@dataclass
class Conversation:
    """The turns, and per turn the blocks each node announced for the conversation."""

    turns: list[Turn] = field(default_factory=list)
    prefill: list[list[Block]] = field(default_factory=list)
    decode: list[list[Block]] = field(default_factory=list)
    # NIXL reads each node made, and tokens P loaded, per turn.
    prefill_reads: list[float] = field(default_factory=list)
    decode_reads: list[float] = field(default_factory=list)
    prefill_loaded: list[float] = field(default_factory=list)
    decode_removed: list[ExternalBlockHash] = field(default_factory=list)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def conversation(
    stack: Stack, http: httpx.AsyncClient, feeds: dict[str, EventFeed]
) -> Conversation:
    """Three turns of one conversation: the first as plain P/D (nothing retained yet), the
    second by READ (P reads the history from D), the third DECODE_LOCAL (D alone)."""
    p, d = feeds["prefill"], feeds["decode"]
    record = Conversation()
    messages = [
        {"role": "system", "content": user_message(10, lines=12)},
        {"role": "user", "content": user_message(11, lines=12)},
    ]
    for path, follow_up in ((None, "and then?"), ("READ", "why?"), ("DECODE_LOCAL", None)):
        marks = p.mark(), d.mark()
        reads = [await nixl_reads(stack, http, e) for e in (stack.prefill, stack.decode)]
        loaded = await loaded_tokens(stack, http, stack.prefill)
        done = await turn(stack, http, messages, SESSION, path)
        # Each node announces a block once: P what its prompt adds to its cache, D what the
        # whole turn adds to its (the turns before are already there); DECODE_LOCAL is D's.
        earlier_p = sum(map(len, record.prefill))
        p_count = 0 if path == "DECODE_LOCAL" else done.prompt_tokens // BLOCK_SIZE - earlier_p
        d_count = done.full_blocks - sum(map(len, record.decode))
        record.prefill.append(await p.wait_blocks(SESSION, p_count, marks[0]))
        record.decode.append(await d.wait_blocks(SESSION, d_count, marks[1]))
        record.turns.append(done)
        record.prefill_reads.append(await nixl_reads(stack, http, stack.prefill) - reads[0])
        record.decode_reads.append(await nixl_reads(stack, http, stack.decode) - reads[1])
        record.prefill_loaded.append(await loaded_tokens(stack, http, stack.prefill) - loaded)
        record.decode_removed += d.removed(marks[1])
        if follow_up is not None:
            messages += [{"role": "assistant", "content": done.answer},
                         {"role": "user", "content": follow_up}]  # fmt: skip
    return record


def hashes(blocks: list[Block]) -> list[ExternalBlockHash]:
    return [block.hash for block in blocks]


def assert_chained(blocks: list[Block]) -> None:
    """Each block's parent is the block before it: one conversation's prefix, in order."""
    for before, after in itertools.pairwise(blocks):
        assert after.parent == before.hash


async def test_decode_announces_the_prompt_blocks_it_pulled_from_prefill(
    stack: Stack, conversation: Conversation
) -> None:
    """(b), the question of llm-d-kv-cache PR #347: yes. On turn 1 (plain P/D) D pulls the
    prompt's KV from P over NIXL and announces those blocks, under the same hashes and tokens
    as P, the first one as a root (no parent)."""
    first = conversation.turns[0]
    assert first.path == "RECOMPUTE"
    assert conversation.decode_reads[0] == 1  # D pulled the prompt from P
    prompt = conversation.prefill[0]
    assert len(prompt) == first.prompt_tokens // BLOCK_SIZE
    pulled = conversation.decode[0][: len(prompt)]
    assert hashes(pulled) == hashes(prompt)
    assert [b.tokens for b in pulled] == [b.tokens for b in prompt]
    assert pulled[0].parent is None


async def test_decode_announces_every_block_it_retains_prompt_and_answer(
    stack: Stack, conversation: Conversation, feeds: dict[str, EventFeed]
) -> None:
    """(a), the retained KV: yes. At the end of each turn D has announced every full block it
    retains (prompt and answer, the unfinished last block aside: a block gets a hash once
    full), each once, as one chain under the conversation's session id; nothing it retains is
    announced removed."""
    decode = [block for blocks in conversation.decode for block in blocks]
    assert len(decode) == conversation.turns[-1].full_blocks
    # Turn 1's answer filled at least one block P never computed.
    assert conversation.turns[0].full_blocks > len(conversation.prefill[0])
    assert len(set(hashes(decode))) == len(decode)
    assert_chained(decode)
    assert {block.session for block in decode} == {SESSION}
    # A DECODE_LOCAL turn: D computes the new suffix and answer itself, and announces them.
    assert conversation.turns[2].path == "DECODE_LOCAL"
    assert conversation.decode[2]
    assert conversation.decode_removed == []
    lease = await current_lease(stack.registry_address, SESSION)
    assert lease is not None and lease.state == lease_pb2.LEASE_STATE_ACTIVE
    assert all(feed.lost_none() for feed in feeds.values())


async def test_prefill_announces_the_blocks_it_read_from_decode(
    stack: Stack, conversation: Conversation
) -> None:
    """(c): yes, with P's prefix cache on. On turn 2 (READ) P reads from D the blocks of the
    history it lacks (turn 1's answer: P computed only the prompt) and announces them, under
    D's hashes, with the blocks it computes for the new suffix."""
    assert conversation.turns[1].path == "READ"
    assert conversation.prefill_reads[1] == 1
    had = set(hashes(conversation.prefill[0]))
    lacked = [block for block in conversation.decode[0] if block.hash not in had]
    announced = conversation.prefill[1][: len(lacked)]
    assert lacked and hashes(announced) == hashes(lacked)
    assert [b.tokens for b in announced] == [b.tokens for b in lacked]
    # Loaded through the connector, not computed: at least those blocks' tokens.
    assert conversation.prefill_loaded[1] >= len(lacked) * BLOCK_SIZE


async def test_a_lease_end_or_yield_announces_nothing_and_eviction_announces_removal(
    stack: Stack, http: httpx.AsyncClient, feeds: dict[str, EventFeed], conversation: Conversation
) -> None:
    """(a), the frees: a freed block stays in vLLM's prefix cache, so neither the end of a
    lease nor retention yielding to new work announces anything; BlockRemoved comes when vLLM
    reuses a block for another request (here a prompt longer than the free cache)."""
    d = feeds["decode"]
    retained = {block.hash for blocks in conversation.decode for block in blocks}
    closed = await http.delete(f"{stack.router_url}/v1/sessions/{SESSION}")
    assert closed.status_code == 200 and closed.json()["state"] == "REVOKED"
    freed_at = d.mark()

    async def freed() -> bool:
        return await metric(http, stack.url(stack.decode), "vllm:kv_cache_usage_perc") == 0.0

    await poll_until(freed, WAIT_S, "D freeing the closed conversation")
    # Another conversation, retained: events come in order, so any the free caused are in.
    other = f"{SESSION}-b"
    opened = await turn(stack, http, [{"role": "user", "content": user_message(40, lines=30)}],
                        other, max_tokens=8)  # fmt: skip
    kept = await d.wait_blocks(other, opened.full_blocks, freed_at)
    assert d.removed(freed_at) == []  # the lease's end announced nothing

    # A prompt longer than D's free cache: D's retention of the other conversation yields,
    # and vLLM reuses the least recently freed blocks first, the closed conversation's.
    evicted_at = d.mark()
    long = await turn(stack, http, [{"role": "user", "content": user_message(60, lines=85)}],
                      None, max_tokens=2)  # fmt: skip
    assert long.prompt_tokens // BLOCK_SIZE > BLOCKS - len(kept) - 1, long
    await d.wait_blocks(None, long.prompt_tokens // BLOCK_SIZE, evicted_at)
    yielded = await current_lease(stack.registry_address, other)
    assert yielded is not None and yielded.end_cause == lease_pb2.LEASE_END_CAUSE_PRESSURE
    removed = set(d.removed(evicted_at))
    announced = {block.hash for block in d.blocks(0)}
    assert removed <= announced  # only blocks D had announced
    assert retained <= removed  # every block of the closed conversation, on its reuse
    assert removed & set(hashes(kept))  # the yielded conversation's, once reused too
    assert d.lost_none()
