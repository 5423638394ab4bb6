"""The hard-cap deadline rule: until when a decode engine keeps a retained request's blocks.

The registry's lease decides the deadline (its idle TTL, extended by turns and renewals,
shortened by revocations, ended by expiry), but the engine never keeps blocks longer than
``hard_cap_s`` (vLLM's ``decoder_kv_blocks_ttl``) past the last time the lease was granted or
renewed, so blocks are freed even if the control plane disappears. The vLLM connector applies
this rule each scheduler step and the failover bench's simulated engines apply the same
function, so the soak checks the connector's rule, not a copy of it.

Times are seconds on one clock of the caller's choosing (the connector uses vLLM's
``perf_counter`` deadlines, the bench ``monotonic``); no clock is read here.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RetentionDeadline:
    """When a retained request's blocks are freed."""

    # Never kept past this, whatever the registry says.
    hard_cap: float
    # The deadline the engine applies now (never after ``hard_cap``).
    free_at: float


@dataclass(frozen=True, slots=True)
class LeaseDeadline:
    """What the registry last said about the lease behind the blocks."""

    # ACTIVE or CLAIMED: a grant or renewal, which restarts the hard cap.
    live: bool
    # Keep the blocks this much longer (negative values count as zero).
    time_left_s: float


def first_deadline(now: float, hard_cap_s: float) -> RetentionDeadline:
    """Blocks just retained: kept one hard cap until the registry says otherwise."""
    cap = now + hard_cap_s
    return RetentionDeadline(hard_cap=cap, free_at=cap)


def next_deadline(
    current: RetentionDeadline, lease: LeaseDeadline, now: float, hard_cap_s: float
) -> RetentionDeadline:
    """The deadline after the registry's word on the lease: a live lease may keep the blocks
    up to one hard cap from now; an ended one cannot move the cap, only the free time below
    it."""
    cap = now + hard_cap_s if lease.live else current.hard_cap
    return RetentionDeadline(hard_cap=cap, free_at=min(now + max(lease.time_left_s, 0.0), cap))
