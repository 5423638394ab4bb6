"""`kvbroker bench aiperf`'s figures from a recorded AIPerf 0.13 export (six requests of the
kvbroker arm's first run, trimmed to the fields read, and one failed request in AIPerf's
error shape), P's content-match log lines and the router's turns by path. The real run needs
AIPerf and two vLLM engines; it is the documented command, not a test."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from kvbroker_tools.bench.aiperf import (
    ARMS,
    AiperfConfig,
    Counters,
    count_matches,
    read_export,
    router_paths,
    summarise,
)

EXPORT = Path(__file__).parent / "fixtures" / "aiperf_profile_export.jsonl"


def test_export_is_read_by_conversation_and_turn() -> None:
    requests = read_export(EXPORT)
    assert [(r.conversation, r.turn) for r in requests] == [
        ("session_000000", 0), ("session_000001", 0), ("session_000000", 1),
        ("session_000001", 1), ("session_000000", 2), ("session_000000", 3),
        ("session_000001", 2),
    ]  # fmt: skip
    failed = requests[-1]
    assert failed.error == "Bad Gateway" and math.isnan(failed.ttft_ms)
    assert requests[2].input_tokens == 617 and requests[2].prompt_tokens == 650


def test_summary_splits_first_and_later_turns_and_leaves_failures_out() -> None:
    counters = Counters({"READ": 0, "DECODE_LOCAL": 0, "RECOMPUTE": 7}, 4, 1500, 4246)
    row = summarise(ARMS["kvbroker"], read_export(EXPORT), counters, {"matched": 4})
    assert (row.requests, row.errors, row.first_turns, row.later_turns) == (7, 1, 2, 4)
    # Two first turns: the median is their mean; four later: the mean of the middle two.
    assert row.ttft_first_p50_ms == pytest.approx((1082.8927979999999 + 1893.240045) / 2)
    assert row.ttft_later_p50_ms == pytest.approx((2432.03598 + 2458.37034) / 2)
    assert row.ttft_first_p50_ms < row.ttft_first_p99_ms < 1893.240045
    assert row.prompt_tokens == 316 + 316 + 650 + 652 + 989 + 1323
    assert row.reused_later == 4
    assert row.to_json()["reused_later"] == 4


def test_turns_reused_by_id_are_the_routers_read_and_decode_local() -> None:
    counters = Counters({"READ": 3, "DECODE_LOCAL": 1, "RECOMPUTE": 3}, 3, 0, 0)
    row = summarise(ARMS["session-header"], read_export(EXPORT), counters, {"matched": 0})
    assert row.reused_later == 4 and row.session_header == "X-Session-ID"


def test_counters_move_by_their_difference() -> None:
    before = Counters({"READ": 1}, 2, 100, 300)
    after = Counters({"READ": 4, "RECOMPUTE": 2}, 5, 150, 900)
    moved = after.minus(before)
    assert moved.paths == {"READ": 3, "DECODE_LOCAL": 0, "RECOMPUTE": 2}
    assert (moved.reads, moved.computed_tokens, moved.prompt_tokens) == (3, 50, 600)


def test_router_paths_and_p_matches_are_counted() -> None:
    metrics = (
        "# TYPE kvbroker_router_ttft_seconds histogram\n"
        'kvbroker_router_ttft_seconds_bucket{le="+Inf",path="READ"} 5.0\n'
        'kvbroker_router_ttft_seconds_count{path="READ"} 5.0\n'
        'kvbroker_router_ttft_seconds_sum{path="READ"} 1.0\n'
        'kvbroker_router_ttft_seconds_count{path="RECOMPUTE"} 2.0\n'
        'kvbroker_router_ttft_seconds_sum{path="RECOMPUTE"} 1.0\n'
    )
    assert router_paths(metrics) == {"READ": 5, "DECODE_LOCAL": 0, "RECOMPUTE": 2}
    log = (
        "INFO [prefix_match.py:128] kvbroker prefix match for chatcmpl-a: lease 1a of another "
        "conversation, 16 blocks shared\n"
        "INFO [prefix_match.py:147] kvbroker prefix match not made: no lease shares a block\n"
        "INFO [prefix_match.py:141] kvbroker prefix match unanswered after 0.05s: computed here\n"
        "INFO [prefix_match.py:128] kvbroker prefix match for chatcmpl-b: lease 1b of another "
        "conversation, 8 blocks shared\n"
    )
    assert count_matches(log) == {"matched": 2, "not_made": 1, "unanswered": 1}


def test_aiperf_is_run_at_its_default_session_handling() -> None:
    config = AiperfConfig()
    argv = config.command(ARMS["kvbroker"], "http://r", "m", Path("/model"), 0, Path("/out"))
    assert "--session-header" not in argv and "--streaming" in argv
    assert argv[argv.index("--request-count") + 1] == str(config.conversations * config.turns)
    with_header = config.command(ARMS["session-header"], "http://r", "m", Path("/m"), 1, Path("/o"))
    assert with_header[-2:] == ["--session-header", "X-Session-ID"]
