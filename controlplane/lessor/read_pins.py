"""Read pins: a fork reads a lease without taking it.

A claim hands a conversation's lease to the prefill node of its next turn, and the lease is
CLAIMED: not offered again until the claim ends. A fork (MatchPrefix) must not take its
parent's lease that way: the parent's own next turn still gets it (REUSE), and N forks may read
it at once. So a fork gets a pin instead: the lease's state does not change, and until every
pin has ended the blocks are protected exactly as a claim protects them (``Leases.
reads_protected_until``, the one rule: expiry moved past it, early ends keep the blocks for
it, a reclaim is answered "keep"). A pin ends when its reader says its read has (the fork's
prefill finished: ``EndReadPin``), or at its timeout (the claim timeout); pins are soft state,
as claims are (a successor grants the inherited-claims window instead).
"""

from __future__ import annotations

import itertools


class ReadPins:
    """Each lease's live pins: pin id -> when it ends (the registry's clock); and whose each
    pin is (only its reader may end it early)."""

    def __init__(self) -> None:
        self._pins: dict[str, dict[str, float]] = {}
        self._readers: dict[str, str] = {}
        self._ids = itertools.count(1)

    def pin(self, lease_id: str, until: float, reader: str = "") -> str:
        """A new pin on the lease until ``until`` for the node ``reader``; returns its id."""
        pin_id = f"pin-{next(self._ids)}"
        self._pins.setdefault(lease_id, {})[pin_id] = until
        self._readers[pin_id] = reader
        return pin_id

    def end(self, lease_id: str, pin_id: str, reader: str = "") -> bool:
        """Ends ``reader``'s pin (another node's is left alone); whether one ended."""
        pins = self._pins.get(lease_id)
        if pins is None or pin_id not in pins or self._readers.get(pin_id) != reader:
            return False
        del pins[pin_id]
        self._readers.pop(pin_id, None)
        if not pins:
            del self._pins[lease_id]
        return True

    def until(self, lease_id: str, now: float) -> float | None:
        """When the lease's last live pin ends (None: no live pin); forgets ended pins."""
        pins = self._pins.get(lease_id)
        if not pins:
            return None
        for pin_id in [p for p, until in pins.items() if until <= now]:
            del pins[pin_id]
            self._readers.pop(pin_id, None)
        if not pins:
            del self._pins[lease_id]
            return None
        return max(pins.values())

    def count(self, lease_id: str, now: float) -> int:
        self.until(lease_id, now)
        return len(self._pins.get(lease_id, ()))

    def forget(self, lease_id: str) -> None:
        """The lease ended: its pins go with it (the end's grace already covers them)."""
        for pin_id in self._pins.pop(lease_id, {}):
            self._readers.pop(pin_id, None)

    def clear(self) -> None:
        self._pins.clear()
        self._readers.clear()
