"""Turns still finishing: a hint sent a conversation's turn to a decode node, which will report
its retention when the turn ends. A hint for the same conversation's next turn waits for that
report (up to the settle timeout) instead of recomputing what the decode node is about to
report.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable

from kvbroker.controlplane.config import RegistryConfig
from kvbroker.controlplane.metrics import RegistryMetrics
from kvbroker.controlplane.model import ACTIVE
from kvbroker.controlplane.store import Store


class Turns:
    def __init__(
        self,
        store: Store,
        config: RegistryConfig,
        metrics: RegistryMetrics,
        now: Callable[[], float],
    ) -> None:
        self._store = store
        self._config = config
        self._metrics = metrics
        self._now = now
        # Conversations whose turn was hinted and whose retention has not been reported yet:
        # when the turn started, and an event set once it is.
        self._turns: dict[str, tuple[float, asyncio.Event]] = {}
        self._sweep_at = 1024

    def __bool__(self) -> bool:
        return bool(self._turns)

    def started(self, conversation_id: str) -> None:
        """A hint sent a turn of this conversation to a decode node (call under the lock)."""
        if conversation_id not in self._turns:
            if len(self._turns) >= self._sweep_at:
                self._sweep()
            self._turns[conversation_id] = (self._now(), asyncio.Event())

    def settle(self, conversation_id: str) -> None:
        """The conversation's retention was reported: waiters go on."""
        turn = self._turns.pop(conversation_id, None)
        if turn is not None:
            turn[1].set()

    def _sweep(self) -> None:
        """Forgets turns that never reported retention (aborted, failed, not retained)."""
        config = self._config
        horizon = self._now() - config.claim_timeout_s - config.turn_settle_timeout_s
        for conversation_id, (started, _) in list(self._turns.items()):
            if started < horizon:
                self.settle(conversation_id)
        self._sweep_at = max(2 * len(self._turns), 1024)

    async def settled(self, conversation_ids: Iterable[str]) -> None:
        """Waits, up to the settle timeout, for the retention of previous turns still
        finishing: a conversation whose current lease is not ACTIVE (consumed by the read
        that started its last turn, or claimed by it) but whose last turn's retention has not
        been reported yet."""
        waits: dict[str, asyncio.Event] = {}
        for conversation_id in conversation_ids:
            turn = self._turns.get(conversation_id)
            if turn is None or conversation_id in waits:
                continue
            conversation = await self._store.get_conversation(conversation_id)
            lease_id = conversation.lease_id if conversation is not None else ""
            lease = await self._store.get_lease(lease_id) if lease_id else None
            if lease is None or lease.state != ACTIVE:
                waits[conversation_id] = turn[1]
        if not waits:
            return
        done, _ = await asyncio.wait(
            [asyncio.ensure_future(event.wait()) for event in waits.values()],
            timeout=self._config.turn_settle_timeout_s,
        )
        settled = len(done)
        self._metrics.settle_waits.labels("settled").inc(settled)
        if settled < len(waits):
            self._metrics.settle_waits.labels("timeout").inc(len(waits) - settled)
            for conversation_id, event in waits.items():
                if not event.is_set():
                    event.set()  # wakes the waiter task created above
                    # That turn will not report (or is a parallel request still running):
                    # later hints need not wait for it again.
                    self._turns.pop(conversation_id, None)
