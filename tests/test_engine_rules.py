"""The connector's pure rules: the verdict on a remote handle (read, decline, recompute or wait
for the lease check) and the hard-cap deadline rule, on an injected clock. The scheduler-level
tests drive the verdict through vLLM; the failover soak drives the deadline rule."""

from __future__ import annotations

import pytest

from kvbroker.common.client.engine_link import LeaseAnswer
from kvbroker.common.rules.retention_deadline import (
    LeaseDeadline,
    RetentionDeadline,
    first_deadline,
    next_deadline,
)
from kvbroker.engine_ext.verdict import (
    LeaseCheck,
    RemoteOffer,
    Verdict,
    remote_verdict,
    worth_reading,
)

WAIT_S = 0.25


def offer(verified: int = 256, local: int = 0, threshold: int = 64) -> RemoteOffer:
    return RemoteOffer(
        carries_lease=True,
        verified_tokens=verified,
        local_tokens=local,
        recompute_threshold=threshold,
    )


def answered(usable: bool, reason: str = "", from_registry: bool = True) -> LeaseCheck:
    return LeaseCheck(asked_at=10.0, answer=LeaseAnswer(usable, reason, from_registry))


def test_a_usable_lease_on_a_worthwhile_prefix_is_read() -> None:
    decision = remote_verdict(offer(), answered(True, "live at epoch 3"), now=10.1, wait_s=WAIT_S)
    assert decision.verdict is Verdict.READ


def test_a_lease_the_registry_refuses_is_declined_with_its_reason() -> None:
    decision = remote_verdict(offer(), answered(False, "superseded"), now=10.1, wait_s=WAIT_S)
    assert decision.verdict is Verdict.DECLINE and decision.reason == "superseded"


def test_a_check_that_failed_in_transport_means_recompute_not_decline() -> None:
    check = answered(False, "lease check failed: UNAVAILABLE", from_registry=False)
    decision = remote_verdict(offer(), check, now=10.1, wait_s=WAIT_S)
    assert decision.verdict is Verdict.RECOMPUTE and "UNAVAILABLE" in decision.reason


def test_a_check_in_flight_waits_until_its_bound_then_recomputes() -> None:
    in_flight = LeaseCheck(asked_at=10.0)
    assert remote_verdict(offer(), in_flight, now=10.0, wait_s=WAIT_S).verdict is Verdict.WAIT
    assert remote_verdict(offer(), in_flight, now=10.24, wait_s=WAIT_S).verdict is Verdict.WAIT
    late = remote_verdict(offer(), in_flight, now=10.25, wait_s=WAIT_S)
    assert late.verdict is Verdict.RECOMPUTE


def test_no_sidecar_means_recompute() -> None:
    decision = remote_verdict(offer(), None, now=0.0, wait_s=WAIT_S)
    assert decision.verdict is Verdict.RECOMPUTE


@pytest.mark.parametrize(
    ("verified", "local", "threshold", "worth"),
    [
        (256, 0, 64, True),
        (256, 192, 64, True),  # exactly the threshold beyond the local cache
        (256, 193, 64, False),
        (63, 0, 64, False),
        (1, 0, 0, True),  # threshold 0 still needs one token to read
        (0, 0, 0, False),
    ],
)
def test_the_recompute_threshold_counts_tokens_beyond_the_local_cache(
    verified: int, local: int, threshold: int, worth: bool
) -> None:
    candidate = offer(verified, local, threshold)
    assert (worth_reading(candidate) is None) is worth
    # An unworthy offer is recomputed whatever the lease says, without waiting for it.
    decision = remote_verdict(candidate, answered(True), now=10.1, wait_s=WAIT_S)
    assert (decision.verdict is Verdict.READ) is worth
    if not worth:
        in_flight = remote_verdict(candidate, LeaseCheck(asked_at=10.0), now=10.0, wait_s=WAIT_S)
        assert in_flight.verdict is Verdict.RECOMPUTE


def test_a_handle_without_a_lease_is_recomputed() -> None:
    bare = RemoteOffer(
        carries_lease=False, verified_tokens=0, local_tokens=0, recompute_threshold=64
    )
    assert remote_verdict(bare, answered(True), now=10.1, wait_s=WAIT_S).verdict is (
        Verdict.RECOMPUTE
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
