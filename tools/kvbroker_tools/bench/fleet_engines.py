"""The simulated engines of `kvbroker bench fleet`: what each decode engine retains within its
budget and reports through its sidecar's calls, and what the run counts of the turns.

Apart from the run (``kvbroker_tools.bench.fleet``) because they are the one part of the fleet that
is not kvbroker's: they stand in for vLLM and its connector, keeping the ground truth every
hint is checked against.
"""

from __future__ import annotations

import uuid
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Any

from kvbroker.common.client.batcher import Batcher
from kvbroker.v1 import lease_pb2, node_pb2, registry_pb2
from kvbroker_tools.bench.fleet_heartbeats import HeartbeatFigures

MODEL = "fleet"
BLOCK_SIZE = 16  # vLLM's default on GPUs


@dataclass
class Tally:
    """What the turns saw, for one fleet size."""

    latencies: list[float] = field(default_factory=list)
    turns: int = 0
    later: int = 0  # turns after a conversation's first
    reused: int = 0  # later turns whose hint said READ or DECODE_LOCAL
    held: int = 0  # later turns whose KV an engine still held at the hint
    reused_held: int = 0
    reused_not_held: int = 0  # a hint to reuse what no engine held: must stay 0
    # READs the prefill node's fence declined: the hint's claim lapsed before the check.
    fenced: int = 0
    forks: int = 0
    fork_hits: int = 0  # sub-agents' first turns that found the parent's KV by content
    refused_events: int = 0
    errors: int = 0
    # From the heartbeat process, once it stopped.
    heartbeats: HeartbeatFigures = field(default_factory=HeartbeatFigures)
    sidecar_retries: int = 0  # registrations and replays sent again (``_again_if_away``)


@dataclass
class Engines:
    """What the simulated engines share: which holds each conversation's KV; the
    conversations a hint or a look-up in flight may have handed to a reader (an engine does not
    reclaim those: the registry would answer "keep it for the read"); and those an engine
    asked to reclaim whose report the registry has not answered yet (their blocks are still
    there, and a hint may still offer them)."""

    holders: dict[str, SimDecode] = field(default_factory=dict)
    busy: Counter[str] = field(default_factory=Counter)
    freeing: Counter[str] = field(default_factory=Counter)


class SimDecode:
    """A decode node's engine as far as retention goes: what it holds, within its budget."""

    def __init__(
        self,
        spec: node_pb2.NodeSpec,
        budget: int,
        stub: Any,
        tally: Tally,
        fleet: Engines,
    ) -> None:
        self.spec, self.budget, self.tally, self.fleet = spec, budget, tally, fleet
        self.held: OrderedDict[str, tuple[str, int]] = OrderedDict()  # conv: (request, blocks)
        self.used = 0
        self.reclaiming: dict[str, str] = {}  # request id: conversation, until the word on it
        self._sequence = 0
        self._stub = stub
        self.reports: Batcher[registry_pb2.RetentionEvent, bool] = Batcher(
            self._send, max_batch=512, name=f"reports-{spec.node_id}"
        )

    def retain(self, conversation: str, blocks: int) -> tuple[str, list[Any]]:
        """Retains the conversation's blocks under a new request id; returns it, and the
        reclaims the engine sends to stay within its budget (least recently used first)."""
        request_id = uuid.uuid4().hex
        self.drop(conversation)
        self.held[conversation] = (request_id, blocks)
        self.fleet.holders[conversation] = self
        self.used += blocks
        events = []
        while self.used > self.budget:
            # Not a conversation a read may be reading now (a turn or a sub-agent's look-up in
            # flight): the registry would answer that reclaim "keep it for the read".
            oldest = next(
                (c for c in self.held if c != conversation and not self.fleet.busy[c]), None
            )
            if oldest is None:
                break
            freed, _ = self.drop(oldest) or ("", 0)
            self.fleet.freeing[oldest] += 1
            self.reclaiming[freed] = oldest
            reclaim = registry_pb2.ReclaimRequest(
                remote_request_id=freed, cause=lease_pb2.LEASE_END_CAUSE_BUDGET
            )
            events.append(registry_pb2.RetentionEvent(reclaim=reclaim))
        return request_id, events

    def drop(self, conversation: str) -> tuple[str, int] | None:
        found = self.held.pop(conversation, None)
        if found is not None:
            self.used -= found[1]
            del self.fleet.holders[conversation]
        return found

    def released(self, conversation: str, cause: int) -> list[Any]:
        found = self.drop(conversation)
        if found is None:
            return []
        event = registry_pb2.ReleasedBlocks(remote_request_id=found[0], cause=cause)  # type: ignore[arg-type]
        return [registry_pb2.RetentionEvent(released=event)]

    def number(self, events: list[Any]) -> list[Any]:
        for event in events:
            self._sequence += 1
            event.sequence = self._sequence
        return events

    async def _send(self, events: list[Any]) -> list[bool]:
        response = await self._stub.ReportRetention(
            registry_pb2.ReportRetentionRequest(
                node_id=self.spec.node_id, incarnation=self.spec.incarnation,
                events=self.number(events),
            ),
            timeout=30,
        )  # fmt: skip
        refused = {r.sequence for r in response.refused}
        self.tally.refused_events += len(refused)
        for event in events:
            if event.HasField("reclaim"):  # the registry has its word: freed, or kept for a read
                self.fleet.freeing.subtract([self.reclaiming.pop(event.reclaim.remote_request_id)])
        return [e.sequence not in refused for e in events]


def node_spec(index: int, role: int, capacity_blocks: int) -> node_pb2.NodeSpec:
    name = "prefill" if role == node_pb2.NODE_ROLE_PREFILL else "decode"
    return node_pb2.NodeSpec(
        node_id=f"{name}-{index}", role=role, engine_id=f"engine-{name}-{index}",  # type: ignore[arg-type]
        side_channel_host="10.0.0.1", side_channel_port=5600 + index,
        http_base_url=f"http://10.0.0.1:{8000 + index}", model=MODEL, block_size=BLOCK_SIZE,
        capacity_blocks=capacity_blocks, bytes_per_block=1 << 17, incarnation=uuid.uuid4().hex,
    )  # fmt: skip
