"""The connector's pure rules on an injected clock: the hard-cap deadline rule (the failover
soak drives the same function)."""

from __future__ import annotations

from kvbroker.common.retention_deadline import (
    LeaseDeadline,
    RetentionDeadline,
    first_deadline,
    next_deadline,
)

# ---------------------------------------------------------------------- the deadline rule

CAP_S = 480.0


def test_retained_blocks_start_with_one_hard_cap() -> None:
    assert first_deadline(100.0, CAP_S) == RetentionDeadline(hard_cap=580.0, free_at=580.0)


def test_a_live_lease_sets_the_deadline_and_restarts_the_hard_cap() -> None:
    start = first_deadline(100.0, CAP_S)
    granted = next_deadline(start, LeaseDeadline(live=True, time_left_s=60.0), 110.0, CAP_S)
    assert granted == RetentionDeadline(hard_cap=590.0, free_at=170.0)


def test_no_lease_keeps_blocks_past_the_hard_cap() -> None:
    start = first_deadline(100.0, CAP_S)
    long_lease = next_deadline(start, LeaseDeadline(live=True, time_left_s=10_000.0), 110.0, CAP_S)
    assert long_lease.free_at == long_lease.hard_cap == 590.0


def test_an_ended_lease_moves_the_free_time_but_never_the_cap() -> None:
    held = RetentionDeadline(hard_cap=590.0, free_at=170.0)
    revoked = next_deadline(held, LeaseDeadline(live=False, time_left_s=0.5), 500.0, CAP_S)
    assert revoked == RetentionDeadline(hard_cap=590.0, free_at=500.5)
    # A grace longer than what the cap leaves is cut at the cap.
    graced = next_deadline(held, LeaseDeadline(live=False, time_left_s=200.0), 500.0, CAP_S)
    assert graced == RetentionDeadline(hard_cap=590.0, free_at=590.0)


def test_a_deadline_already_past_frees_now() -> None:
    held = first_deadline(100.0, CAP_S)
    expired = next_deadline(held, LeaseDeadline(live=False, time_left_s=-3.0), 200.0, CAP_S)
    assert expired.free_at == 200.0
