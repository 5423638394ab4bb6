"""The retention simulation's accounting, on a trace small enough to check by hand."""

from __future__ import annotations

import pytest

from kvbroker_tools.bench.retention import (
    Conversation,
    Gap,
    TraceConfig,
    at_equal_hit_rate,
    fixed_ttl,
    idle_lease,
    make_trace,
)

CONFIG = TraceConfig(tokens_per_turn=16, block_size=16)  # turn k holds k blocks


def test_policies_on_a_hand_made_trace() -> None:
    trace = [
        Conversation((Gap(100, tool_call=False), Gap(1000, tool_call=True)), closes=True),
        Conversation((Gap(600, tool_call=False),), closes=False),
    ]
    fixed = fixed_ttl(trace, 480, CONFIG)
    # Hits: 100 s yes, 1000 s no, 600 s no. Idle: 1*100 + 2*480 + 3*480 (end) + 1*480 + 2*480.
    assert (fixed.hits, fixed.reuse_opportunities) == (1, 3)
    assert fixed.idle_block_hours * 3600 == pytest.approx(100 + 960 + 1440 + 480 + 960)
    lease = idle_lease(trace, 60, CONFIG)
    # 100 s think > 60 s: miss; the tool call is kept alive: hit; 600 s think: miss.
    assert (lease.hits, lease.reuse_opportunities) == (1, 3)
    # Idle: 1*60 + 2*1000 (kept alive) + 0 (closed) + 1*60 + 2*60 (timed out at the end).
    assert lease.idle_block_hours * 3600 == pytest.approx(60 + 2000 + 60 + 120)


def test_trace_is_deterministic_and_equal_hit_rate_is_found() -> None:
    config = TraceConfig(conversations=300)
    assert make_trace(config) == make_trace(config)
    trace = make_trace(config)
    baseline = fixed_ttl(trace, 480, config)
    sweep = [idle_lease(trace, t, config) for t in (30, 240, 480, 1800)]
    match = at_equal_hit_rate(baseline, sweep)
    assert match is not None and match.hit_rate >= baseline.hit_rate
    assert all(
        match.idle_block_hours <= o.idle_block_hours
        for o in sweep
        if o.hit_rate >= baseline.hit_rate
    )
