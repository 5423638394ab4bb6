"""The rules that make retained KV a cache: value ranking, what a decode engine reclaims under
pressure and over its budget, why a free is reported, and the learned idle TTL. Pure
functions on an injected clock; the end-to-end tests drive the same rules through vLLM."""

from __future__ import annotations

import pytest

from kvbroker.common.rules.retention_value import RetentionValue
from kvbroker.controlplane.config import RegistryConfig
from kvbroker.controlplane.sessions.idle_ttl import IdleTtl
from kvbroker.engine_ext.pressure import (
    BUDGET,
    PRESSURE,
    RetainedRequest,
    admission_shortfall,
    blocks_to_admit,
    choose_reclaims,
    end_cause_of_free,
)
from kvbroker.v1 import lease_pb2

_next_block = iter(range(1_000_000))


def retained(
    request_id: str,
    blocks: int = 10,
    idle_s: float = 0.0,
    ttl_s: float = 60.0,
    now: float = 100,
    shared: frozenset[int] = frozenset(),
) -> RetainedRequest:
    """A retained request holding ``blocks`` blocks of its own, besides any ``shared`` ones."""
    return RetainedRequest(
        request_id=request_id,
        tokens=(blocks + len(shared)) * 128,
        block_ids=shared | {next(_next_block) for _ in range(blocks)},
        hard_cap=now + 480,
        deadline=now - idle_s + ttl_s,
        last_active=now - idle_s,
        ttl_s=ttl_s,
    )


def test_value_falls_with_idle_time_and_is_per_block() -> None:
    fresh = RetentionValue(tokens=1280, blocks=10, idle_s=0, ttl_s=60)
    assert fresh.p_next == 1.0 and fresh.value == 128.0
    half = RetentionValue(tokens=1280, blocks=10, idle_s=30, ttl_s=60)
    assert half.p_next == pytest.approx(0.5) and half.value == pytest.approx(64.0)
    assert RetentionValue(tokens=1280, blocks=10, idle_s=90, ttl_s=60).value == 0.0
    assert RetentionValue(tokens=1280, blocks=10, idle_s=0, ttl_s=0).p_next == 0.0
    # A partly filled last block makes a conversation worth less per block held.
    assert RetentionValue(tokens=1000, blocks=10, idle_s=0, ttl_s=60).value < fresh.value
    # Equal value (both past their TTL): the longer idle goes first.
    stale = RetentionValue(tokens=1280, blocks=10, idle_s=120, ttl_s=60)
    older = RetentionValue(tokens=1280, blocks=10, idle_s=200, ttl_s=60)
    assert older.release_order() < stale.release_order()


def test_pressure_releases_lowest_value_first_until_the_shortfall_is_covered() -> None:
    entries = [retained("fresh", idle_s=1), retained("idle", idle_s=50), retained("mid", idle_s=20)]
    chosen = choose_reclaims(entries, 100, shortfall_blocks=15, budget_blocks=1000, retry_s=1)
    assert [(r.request_id, cause) for r, cause in chosen] == [
        ("idle", PRESSURE),
        ("mid", PRESSURE),
    ]
    assert choose_reclaims(entries, 100, shortfall_blocks=0, budget_blocks=1000, retry_s=1) == []


def test_budget_trims_retention_to_its_share() -> None:
    entries = [retained(f"r{i}", idle_s=i) for i in range(5)]  # 50 blocks
    chosen = choose_reclaims(entries, 100, shortfall_blocks=0, budget_blocks=35, retry_s=1)
    assert [(r.request_id, cause) for r, cause in chosen] == [("r4", BUDGET), ("r3", BUDGET)]
    # Pressure first, then the budget, in one pass.
    chosen = choose_reclaims(entries, 100, shortfall_blocks=5, budget_blocks=35, retry_s=1)
    assert [cause for _, cause in chosen] == [PRESSURE, BUDGET]


def test_reclaims_in_flight_count_as_freed_and_claimed_requests_are_never_chosen() -> None:
    asked, claimed, ended, free = (
        retained(n, idle_s=50) for n in ("asked", "claimed", "ended", "x")
    )
    asked.reclaim_asked_at = 99.5
    claimed.claimed_until = 130
    ended.end_cause = lease_pb2.LEASE_END_CAUSE_IDLE
    entries = [asked, claimed, ended, free]
    # The 10 blocks being reclaimed cover a shortfall of 10: nothing more is asked.
    assert choose_reclaims(entries, 100, shortfall_blocks=10, budget_blocks=1000, retry_s=1) == []
    chosen = choose_reclaims(entries, 100, shortfall_blocks=30, budget_blocks=1000, retry_s=1)
    assert [r.request_id for r, _ in chosen] == ["x"]
    # An unanswered reclaim may be asked again after the retry time.
    later = choose_reclaims(entries, 102, shortfall_blocks=30, budget_blocks=1000, retry_s=1)
    assert {r.request_id for r, _ in later} == {"asked", "x"}


def test_why_a_free_happened() -> None:
    entry = retained("r", idle_s=0, ttl_s=60)
    assert end_cause_of_free(entry, 110) == lease_pb2.LEASE_END_CAUSE_READ
    assert end_cause_of_free(entry, 161) == lease_pb2.LEASE_END_CAUSE_IDLE
    assert end_cause_of_free(entry, 581) == lease_pb2.LEASE_END_CAUSE_ENGINE
    entry.end_cause = lease_pb2.LEASE_END_CAUSE_PRESSURE
    assert end_cause_of_free(entry, 110) == lease_pb2.LEASE_END_CAUSE_PRESSURE


def test_idle_ttl_is_the_default_until_learned_then_a_bounded_percentile() -> None:
    config = RegistryConfig(default_lease_ttl_s=60, min_idle_ttl_s=5, max_idle_ttl_s=300)
    ttl = IdleTtl(config.idle_ttl())
    for _ in range(19):
        ttl.observe_gap(2.0)
    assert ttl.ttl() == 60 and ttl.learned is None
    ttl.observe_gap(2.0)
    assert ttl.ttl() == 5  # p95 of 2 s gaps, raised to the floor
    for gap in range(1, 1001):
        ttl.observe_gap(gap / 10)  # 0.1 .. 100 s
    assert ttl.ttl() == pytest.approx(95, abs=1)
    for _ in range(1000):
        ttl.observe_gap(10_000)
    assert ttl.ttl() == 300  # capped
    off = IdleTtl(RegistryConfig(learn_idle_ttl=False, default_lease_ttl_s=45).idle_ttl())
    for _ in range(100):
        off.observe_gap(1.0)
    assert off.ttl() == 45 and off.samples == 0


def test_idle_ttl_settings_are_checked() -> None:
    with pytest.raises(ValueError):
        RegistryConfig(min_idle_ttl_s=100, max_idle_ttl_s=10)
    with pytest.raises(ValueError):
        RegistryConfig(idle_ttl_percentile=1.5)
    with pytest.raises(ValueError):
        RegistryConfig(turn_settle_timeout_s=-1)


def test_a_local_hit_on_free_cached_blocks_still_needs_those_blocks() -> None:
    # 3,300 tokens in 128-token blocks: 26 blocks (the first output token included).
    assert blocks_to_admit(3300, 128, hit_blocks_in_use=0) == 26
    # Hit blocks that another request holds are shared, not allocated.
    assert blocks_to_admit(3300, 128, hit_blocks_in_use=20) == 6
    assert blocks_to_admit(127, 128, hit_blocks_in_use=0) == 1
    assert blocks_to_admit(128, 128, hit_blocks_in_use=0) == 2


def test_blocks_a_conversation_s_turns_share_count_once() -> None:
    """Turn 2 on the same decode engine reuses turn 1's prefix blocks: until turn 1's lease is
    superseded both are retained, holding 12 blocks between them, not 22."""
    turn_1 = retained("turn-1", blocks=1, idle_s=50, shared=frozenset(range(-10, 0)))
    turn_2 = retained("turn-2", blocks=11, shared=frozenset(range(-10, 0)))
    other = retained("other", blocks=10, idle_s=20)
    entries = [turn_1, turn_2, other]
    # 32 distinct blocks within a budget of 32: nothing to trim (counted twice, 42 would be).
    assert choose_reclaims(entries, 100, shortfall_blocks=0, budget_blocks=32, retry_s=1) == []
    # Releasing turn 1 frees its one block of its own: a shortfall of 5 takes "other" too.
    chosen = choose_reclaims(entries, 100, shortfall_blocks=5, budget_blocks=1000, retry_s=1)
    assert [r.request_id for r, _ in chosen] == ["turn-1", "other"]
    # Two requests holding the same blocks free nothing alone: both go.
    copy = retained("copy", blocks=0, idle_s=90, shared=turn_2.block_ids)
    chosen = choose_reclaims([copy, turn_2], 100, shortfall_blocks=5, budget_blocks=1000, retry_s=1)
    assert [r.request_id for r, _ in chosen] == ["copy", "turn-2"]


def test_a_request_an_idle_engine_keeps_waiting_is_short_of_blocks() -> None:
    # By the count: 20 needed, 8 free.
    assert admission_shortfall(20, 8, waited_s=0.0, engine_idle=True, patience_s=1.0) == 12
    # The count says it fits: a busy engine will free blocks as its requests finish...
    assert admission_shortfall(6, 8, waited_s=30.0, engine_idle=False, patience_s=1.0) == -2
    # ... and a request only just asked about may yet be admitted.
    assert admission_shortfall(6, 8, waited_s=0.5, engine_idle=True, patience_s=1.0) == -2
    # An idle engine that kept it waiting past the patience is short, whatever the count.
    assert admission_shortfall(6, 8, waited_s=1.0, engine_idle=True, patience_s=1.0) == 1
    assert admission_shortfall(20, 8, waited_s=5.0, engine_idle=True, patience_s=1.0) == 12
