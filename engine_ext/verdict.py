"""May a prefill engine read a decode engine's retained blocks for this prompt? The rule, apart
from vLLM so it can be tested on a fake clock.

A handle is read only when it carries a kvbroker lease, when the prefix its block hashes verify
leaves at least ``kv_recompute_threshold`` tokens beyond what the local prefix cache already
has, and when the registry (asked through the sidecar) says the lease is still live at the
handle's epoch. The lease check is a multi-hop round trip, so vLLM's scheduler thread never
waits for it: the connector starts it on the first ask and answers "not known yet" (WAIT) until
it completes; a check that has not answered within its bound means recompute, so a dead sidecar
costs one bounded delay, never a stuck request.

Outcomes other than READ strip the handle, so vLLM recomputes and never touches the decode
node: DECLINE when the registry refused the lease, RECOMPUTE when reading is not worth it or
the lease could not be checked.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kvbroker.common.client.engine_link import LeaseAnswer


class Verdict(enum.Enum):
    READ = "read"
    DECLINE = "decline"
    RECOMPUTE = "recompute"
    WAIT = "wait"


@dataclass(frozen=True, slots=True)
class Decision:
    verdict: Verdict
    reason: str


@dataclass(frozen=True, slots=True)
class RemoteOffer:
    """What a handle offers this prompt."""

    # The handle names a lease (id, epoch) and the block hashes to verify the prefix with.
    carries_lease: bool
    # Leading prompt tokens the remote KV verifiably holds (at most the prompt less one: vLLM
    # must compute at least one token to sample from).
    verified_tokens: int
    # Tokens the local prefix cache already has.
    local_tokens: int
    # vLLM's ``kv_recompute_threshold``: fewer remote tokens than this are not worth a read.
    recompute_threshold: int

    @property
    def reusable_tokens(self) -> int:
        return self.verified_tokens - self.local_tokens


@dataclass(frozen=True, slots=True)
class LeaseCheck:
    """A lease check in progress or done (``asked_at`` on the caller's clock)."""

    asked_at: float
    # None while the check is in flight.
    answer: LeaseAnswer | None = None


def worth_reading(offer: RemoteOffer) -> Decision | None:
    """Whether the offer is worth a lease check at all: None if so, otherwise RECOMPUTE."""
    if not offer.carries_lease:
        return Decision(Verdict.RECOMPUTE, "handle carries no kvbroker lease (id, epoch, hashes)")
    if offer.reusable_tokens < max(offer.recompute_threshold, 1):
        return Decision(
            Verdict.RECOMPUTE,
            f"verified prefix {offer.verified_tokens} tokens, {offer.local_tokens} cached "
            f"locally: below the recompute threshold {offer.recompute_threshold}",
        )
    return None


def remote_verdict(
    offer: RemoteOffer, check: LeaseCheck | None, now: float, wait_s: float
) -> Decision:
    """The verdict on ``offer`` now. ``check`` is None when no sidecar is configured to check
    the lease; a check still in flight ``wait_s`` after it was asked means recompute."""
    unworthy = worth_reading(offer)
    if unworthy is not None:
        return unworthy
    if check is None:
        return Decision(Verdict.RECOMPUTE, "no sidecar configured to check the lease")
    answer = check.answer
    if answer is None:
        if now - check.asked_at < wait_s:
            return Decision(Verdict.WAIT, "lease check in flight")
        return Decision(Verdict.RECOMPUTE, f"lease check unanswered after {wait_s:g}s")
    if answer.usable:
        return Decision(Verdict.READ, answer.reason)
    if not answer.from_registry:
        return Decision(Verdict.RECOMPUTE, answer.reason)
    return Decision(Verdict.DECLINE, answer.reason)
