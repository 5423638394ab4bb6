"""Turns in flight: a hint sent a conversation's turn to a decode node (and, unless it is
DECODE_LOCAL, to a prefill node), and the decode node says when the turn ends: it reports
the turn's retention (a grant), or that it did not retain it and why (``TurnNotRetained``).

What hangs on that:
- A hint for the same conversation's next turn waits for the report (``settled``) instead of
  recomputing what the decode node is about to retain, but only for a turn whose decode node
  retains, and never longer than its caller can wait (``wait_budget``): a report that cannot
  come is never waited for.
- The turn's load leaves its nodes when it ends, not at their next heartbeat, so a quick next
  turn is not steered away from the prefill node that caches its conversation.
- Only the node a turn was routed to may lease the conversation (``Leases.require_routed``):
  one node's credential cannot pull another's conversation to itself.
"""

from __future__ import annotations

import asyncio
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field

from kvbroker.common.rules.labels import label
from kvbroker.controlplane.config import RegistryConfig
from kvbroker.controlplane.context import RegistryContext
from kvbroker.controlplane.records.model import ACTIVE
from kvbroker.controlplane.sessions.nodes import NodeRuntime, NodeSessions
from kvbroker.v1 import registry_pb2

# A hint waits for a previous turn's retention at most this share of its caller's deadline:
# the rest is for the hint itself (the lock, the commit, the answer's way back).
_WAIT_SHARE_OF_DEADLINE = 0.5


def wait_budget(config: RegistryConfig, time_remaining: float | None) -> float:
    """How long a hint may wait for a previous turn's retention: the configured settle
    timeout, bounded by the caller's deadline (None: the caller set none)."""
    if time_remaining is None:
        return config.turn_settle_timeout_s
    return max(0.0, min(config.turn_settle_timeout_s, _WAIT_SHARE_OF_DEADLINE * time_remaining))


@dataclass(slots=True)
class Turn:
    started: float
    # "" when a router other than kvbroker's picks the decode node: any node's report ends it.
    decode_node_id: str
    # "" for a DECODE_LOCAL turn (no prefill leg).
    prefill_node_id: str
    # The prefill node's heartbeat count when the turn was sent there: a heartbeat since has
    # reported its load afresh, with this turn's prefill done or counted.
    prefill_heartbeats: int
    # Whether a hint waits for this turn's report: its decode node retains, and no wait for
    # it has timed out yet.
    awaited: bool
    ended: asyncio.Event = field(default_factory=asyncio.Event)


class Turns:
    def __init__(self, context: RegistryContext, nodes: NodeSessions) -> None:
        self._store = context.store
        self._config = context.config
        self._metrics = context.metrics
        self._nodes = nodes
        self._now = context.now
        self._turns: dict[str, Turn] = {}
        # Each conversation's turns in flight, oldest first, as (decode node, when hinted):
        # its newest turn's, and those of parallel turns it replaced in ``_turns``. A turn
        # that never reaches its decode node (its prefill leg refused, the client gone) stays
        # here until ``turn_timeout_s`` has passed.
        self._routed: dict[str, list[tuple[str, float]]] = {}
        # Until then (a claim's time after a takeover), any decode node may lease a
        # conversation it retained: a takeover's registry does not know the turns its
        # predecessor routed.
        self.inherited_turns_until = 0.0
        self._sweep_at = 1024

    def __bool__(self) -> bool:
        return bool(self._turns)

    def started(
        self, conversation_id: str, decode: NodeRuntime | None, prefill: NodeRuntime | None
    ) -> None:
        """A hint sent a turn of this conversation to ``decode`` (None: another router picks
        it) and ``prefill`` (None for DECODE_LOCAL). Call under the lock. A turn still in
        flight is replaced: the newest turn is the one whose node may lease the conversation.
        A turn with no decode node named restricts no node's lease (``routed_to``): the
        holder's rules apply as with no turn in flight."""
        if len(self._turns) + len(self._routed) >= self._sweep_at:
            self._sweep()
        previous = self._turns.get(conversation_id)
        if previous is not None:
            previous.ended.set()  # nobody waits on a turn a newer one replaced
        now = self._now()
        # Usually the conversation's previous turn has ended: nothing to filter.
        if decode is not None:
            routed = self._live(conversation_id) if conversation_id in self._routed else []
            routed.append((decode.node_id, now))
            self._routed[conversation_id] = routed
        self._turns[conversation_id] = Turn(
            started=now,
            decode_node_id=decode.node_id if decode is not None else "",
            prefill_node_id=prefill.node_id if prefill is not None else "",
            prefill_heartbeats=prefill.heartbeats if prefill is not None else 0,
            # Another router's decode node is unknown: wait for it as if it retained (the
            # wait is bounded, and a node that retains nothing reports that too).
            awaited=decode.retains if decode is not None else True,
        )

    def _live(self, conversation_id: str) -> list[tuple[str, float]]:
        """The conversation's routed turns younger than ``turn_timeout_s``."""
        horizon = self._now() - self._config.turn_timeout_s
        return [turn for turn in self._routed.get(conversation_id, ()) if turn[1] >= horizon]

    def routed_to(self, conversation_id: str) -> Collection[str]:
        """The decode nodes the conversation's turns in flight were routed to (empty: none)."""
        return {node_id for node_id, _ in self._live(conversation_id)}

    def inherited(self) -> bool:
        """Whether this registry took over lately, and may not know every turn in flight."""
        return self._now() < self.inherited_turns_until

    def finished(self, conversation_id: str, node_id: str) -> None:
        """``node_id`` reported the end of a turn of the conversation (its retention, or that
        it retained nothing): waiters go on, and the turn's load leaves its nodes. With several
        of the conversation's turns in flight on that node, the report is the oldest's."""
        self._nodes.turn_finished(node_id)
        routed = self._live(conversation_id)
        on_node = [index for index, (routed_to, _) in enumerate(routed) if routed_to == node_id]
        if on_node:
            del routed[on_node[0]]
        if routed:
            self._routed[conversation_id] = routed
        else:
            self._routed.pop(conversation_id, None)
        turn = self._turns.get(conversation_id)
        if turn is None or turn.decode_node_id not in ("", node_id) or len(on_node) > 1:
            return  # an older turn's report: the newest turn is still in flight
        del self._turns[conversation_id]
        turn.ended.set()
        if turn.prefill_node_id:
            self._nodes.prefill_finished(turn.prefill_node_id, turn.prefill_heartbeats)

    def not_retained(self, node_id: str, report: registry_pb2.TurnNotRetained) -> None:
        """``node_id`` ended a turn of the conversation without retaining it."""
        self._metrics.turns_not_retained.labels(
            label(registry_pb2.NotRetainedReason, report.reason).lower()
        ).inc()
        self.finished(report.conversation_id, node_id)

    def _sweep(self) -> None:
        """Forgets turns that never reported their end (a decode node that went away, or an
        older sidecar that does not report turns it did not retain)."""
        horizon = self._now() - self._config.turn_timeout_s
        for conversation_id, turn in list(self._turns.items()):
            if turn.started < horizon:
                turn.ended.set()
                del self._turns[conversation_id]
        for conversation_id in list(self._routed):
            live = self._live(conversation_id)
            if live:
                self._routed[conversation_id] = live
            else:
                del self._routed[conversation_id]
        self._sweep_at = max(2 * (len(self._turns) + len(self._routed)), 1024)

    async def settled(self, conversation_ids: Iterable[str], budget_s: float) -> None:
        """Waits, up to ``budget_s`` (``wait_budget``), for the retention of previous turns
        still finishing on a decode node that retains: a conversation whose current lease is
        not ACTIVE (consumed by the read that started its last turn, or claimed by it) but
        whose last turn has not reported its end yet."""
        waits: dict[str, Turn] = {}
        for conversation_id in conversation_ids:
            turn = self._turns.get(conversation_id)
            if turn is None or not turn.awaited or conversation_id in waits:
                continue
            conversation = await self._store.get_conversation(conversation_id)
            lease_id = conversation.lease_id if conversation is not None else ""
            lease = await self._store.get_lease(lease_id) if lease_id else None
            if lease is None or lease.state != ACTIVE:
                waits[conversation_id] = turn
        if not waits:
            return
        if budget_s <= 0:
            self._metrics.settle_waits.labels("no_time").inc(len(waits))
            return
        waiters = [asyncio.ensure_future(turn.ended.wait()) for turn in waits.values()]
        try:
            done, pending = await asyncio.wait(waiters, timeout=budget_s)
        finally:
            for waiter in waiters:
                waiter.cancel()  # none is left behind, the caller's cancellation included
        self._metrics.settle_waits.labels("settled").inc(len(done))
        if pending:
            self._metrics.settle_waits.labels("timeout").inc(len(pending))
            for turn in waits.values():
                if not turn.ended.is_set():
                    # That turn will not report in time (or is a parallel request still
                    # running): later hints need not wait for it again.
                    turn.awaited = False
