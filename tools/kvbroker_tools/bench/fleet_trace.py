"""The generated agentic trace of `kvbroker bench fleet`: many live agent conversations whose
turns come after think gaps and tool-call pauses, whose context grows each turn, which end
(another arrives in place of each) and which fork sub-agents that start from the parent's
history.

Apart from the run (``kvbroker_tools.bench.fleet``) because it needs no registry: it is a pure,
seeded generator, so the run is repeatable and the trace's shape can be tested on its own.
The trace's clock only orders the turns; the run plays them at its offered rate (``docs/
benchmarks/fleet.md`` says why and lists the parameters below with their defaults).
"""

from __future__ import annotations

import hashlib
import heapq
import math
import random
from collections.abc import Iterable
from dataclasses import dataclass, field
from itertools import count

from kvbroker.common.rules.checkpoints import BLOCK_HASH_BYTES


@dataclass(frozen=True)
class TraceParams:
    # Live conversations per node of the fleet (both roles): 100 on 1,000 nodes is 100k.
    conversations_per_node: int = 100
    # Turns per conversation: geometric with this mean, at most max_turns.
    mean_turns: float = 8.0
    max_turns: int = 64
    # The agent's instructions and tools: every conversation's first prompt.
    system_tokens: int = 3_000
    # Gaps between a turn's answer and the next prompt, lognormal: the median and sigma.
    gap_median_s: float = 15.0
    gap_sigma: float = 1.0
    # The share of turns that call a tool; the next prompt then waits for it (a longer
    # lognormal pause) and carries its result (more new tokens).
    tool_share: float = 0.4
    tool_pause_median_s: float = 45.0
    tool_pause_sigma: float = 1.0
    # New prompt tokens per turn, lognormal medians (sigma 0.8): a user's message, a tool's
    # result; and the answer's tokens, which the next turn's context holds too.
    user_tokens_median: int = 150
    tool_tokens_median: int = 1_500
    output_tokens: int = 250
    # Context a conversation may reach; past it the conversation ends (compaction).
    max_context_tokens: int = 128_000
    # The share of turns after which the agent forks a sub-agent with its history so far;
    # a sub-agent's turns are geometric with this mean, and none is replaced when it ends.
    fork_share: float = 0.05
    fork_mean_turns: float = 4.0
    seed: int = 0


@dataclass(frozen=True)
class Turn:
    conversation: str
    index: int  # 0: the conversation's first turn
    context_tokens: int  # what earlier turns left (retained, if anything is)
    new_tokens: int  # the prompt's new suffix
    output_tokens: int
    last: bool  # the conversation ends after this turn
    # A sub-agent's first turn: its parent, and the tokens of its prompt that are the parent's.
    parent: str = ""
    shared_tokens: int = 0


@dataclass
class _Conversation:
    name: str
    turns_left: int
    context: int
    # The hash roots of its token stream: (first block, root) from the start; a sub-agent
    # starts with its parent's, so their blocks' hashes agree over the shared prefix.
    roots: list[tuple[int, int]] = field(default_factory=list)
    index: int = 0
    parent: str = ""
    shared: int = 0
    replaced: bool = True  # a top-level conversation: another arrives when it ends
    new_tokens: int = 0  # the next prompt's new suffix


class FleetTrace:
    """The trace, generated as it is read: ``next_turn`` gives the turns in trace-time order."""

    def __init__(self, params: TraceParams, nodes: int, block_size: int) -> None:
        self.params = params
        self.block_size = block_size
        self._random = random.Random(params.seed)
        self._ids = count()
        self._heap: list[tuple[float, int, str]] = []
        self.live: dict[str, _Conversation] = {}
        self._roots: dict[str, list[tuple[int, int]]] = {}
        self.now = 0.0
        for _ in range(params.conversations_per_node * nodes):
            self._start(self._random.uniform(0, params.gap_median_s), in_progress=True)

    # ---------------------------------------------------------------- reading it

    def next_turn(self) -> Turn:
        """The next turn of the trace; schedules what follows it."""
        self.now, _, name = heapq.heappop(self._heap)
        conv = self.live[name]
        p = self.params
        tool = self._random.random() < p.tool_share
        output = p.output_tokens
        conv.turns_left -= 1
        last = (
            conv.turns_left <= 0 or conv.context + conv.new_tokens + output > p.max_context_tokens
        )
        turn = Turn(
            name, conv.index, conv.context, conv.new_tokens, output, last,
            conv.parent if conv.index == 0 else "", conv.shared if conv.index == 0 else 0,
        )  # fmt: skip
        conv.context += conv.new_tokens + output
        conv.index += 1
        conv.new_tokens = self._new_tokens(tool)
        if last:
            del self.live[name]
            if conv.replaced:
                self._start(self.now + self._random.expovariate(1 / p.gap_median_s))
        else:
            pause = self._lognormal(p.tool_pause_median_s if tool else p.gap_median_s,
                                    p.tool_pause_sigma if tool else p.gap_sigma)  # fmt: skip
            self._push(self.now + pause, name)
        if not last and self._random.random() < p.fork_share:
            self._fork(conv)
        return turn

    def hashes(self, conversation: str, blocks: Iterable[int]) -> list[bytes]:
        """The prefix hashes of the conversation's blocks at the indexes ``blocks`` (until
        ``forget``): equal for two conversations up to the block where they part."""
        roots = self._roots[conversation]
        return [
            hashlib.blake2b(
                next(r for start, r in reversed(roots) if start <= block).to_bytes(8, "big")
                + block.to_bytes(8, "big"),
                digest_size=BLOCK_HASH_BYTES,
            ).digest()
            for block in blocks
        ]

    def forget(self, conversation: str) -> None:
        """Its hashes are no longer asked for (it ended and its last turn was reported)."""
        self._roots.pop(conversation, None)

    # ---------------------------------------------------------------- generating it

    def _start(self, at: float, in_progress: bool = False) -> None:
        """A new top-level conversation; ``in_progress``: already some turns in, as the
        conversations live when the run starts are."""
        p = self.params
        turns = min(self._geometric(p.mean_turns), p.max_turns)
        conv = _Conversation(f"conv-{next(self._ids)}", turns, 0)
        conv.new_tokens = p.system_tokens + self._new_tokens(False)
        if in_progress and turns > 1:
            for _ in range(self._random.randrange(turns)):
                conv.context += conv.new_tokens + p.output_tokens
                conv.new_tokens = self._new_tokens(self._random.random() < p.tool_share)
                conv.index += 1
                conv.turns_left -= 1
            conv.context = min(conv.context, p.max_context_tokens // 2)
        self._begin(conv, [(0, self._random.getrandbits(63))], at)

    def _fork(self, parent: _Conversation) -> None:
        p = self.params
        turns = min(self._geometric(p.fork_mean_turns), p.max_turns)
        child = _Conversation(f"conv-{next(self._ids)}", turns, 0, parent=parent.name)
        child.shared = parent.context  # its prompt starts with the parent's history so far
        child.new_tokens = child.shared + self._new_tokens(False)
        child.replaced = False
        shared_blocks = child.shared // self.block_size
        roots = [(s, r) for s, r in self._roots[parent.name] if s < shared_blocks]
        # The parent's tool call starts it at once: its first turn is the trace's next.
        self._begin(child, [*roots, (shared_blocks, self._random.getrandbits(63))], self.now)

    def _begin(self, conv: _Conversation, roots: list[tuple[int, int]], at: float) -> None:
        self.live[conv.name] = conv
        self._roots[conv.name] = roots
        self._push(at, conv.name)

    def _push(self, at: float, name: str) -> None:
        heapq.heappush(self._heap, (at, next(self._ids), name))

    def _new_tokens(self, tool: bool) -> int:
        p = self.params
        return max(
            1, round(self._lognormal(p.tool_tokens_median if tool else p.user_tokens_median, 0.8))
        )

    def _lognormal(self, median: float, sigma: float) -> float:
        return self._random.lognormvariate(math.log(median), sigma)

    def _geometric(self, mean: float) -> int:
        """At least 1, mean ``mean``."""
        q = 1 - 1 / mean
        return 1 + int(math.log(1 - self._random.random()) / math.log(q)) if q > 0 else 1
