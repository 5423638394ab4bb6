"""The paths benchmark's summary (``kvbroker.bench.paths``) on made-up records: medians per
arm, the planner's paths, and its ratio to the best fixed path."""

from __future__ import annotations

from pathlib import Path

from kvbroker.bench.paths import PathPoint, plot, summarise
from kvbroker.bench.turns import TurnRecord


def record(ttft_ms: float, path: str) -> TurnRecord:
    return TurnRecord(
        conversation_id="c", turn=2, kind="follow-up", reuse=True, target_tokens=1024,
        input_num_tokens=1050, output_num_tokens=16, ttft_ms=ttft_ms, e2e_ms=ttft_ms + 100,
        prefill_leg_ms=0.0, kv_read_ms=0.0, kv_read_bytes=0.0, kv_reads=0, decision="REUSE",
        path=path,
    )  # fmt: skip


def test_summary_compares_the_planner_with_the_best_fixed_path(tmp_path: Path) -> None:
    ttfts = {"READ": (300, 340), "DECODE_LOCAL": (100, 120), "RECOMPUTE": (900, 1000)}
    results = [
        (PathPoint(1024, "one-line", arm), record(ms, arm))
        for arm, values in ttfts.items()
        for ms in values
    ] + [
        (PathPoint(1024, "one-line", "planner"), record(105, "DECODE_LOCAL")),
        (PathPoint(1024, "one-line", "planner"), record(125, "DECODE_LOCAL")),
    ]
    (row,) = summarise(results)
    assert row["READ_ms"] == 320 and row["DECODE_LOCAL_ms"] == 110
    assert row["best_fixed_ms"] == 110 and row["planner_ms"] == 115
    assert row["planner_paths"] == ["DECODE_LOCAL"]
    assert abs(row["planner_vs_best"] - 115 / 110) < 1e-9  # type: ignore[operator]
    both = [*results, *((PathPoint(1024, "bulk", p.arm), r) for p, r in results)]
    chart = plot(summarise(both), tmp_path, "test")
    assert chart.exists() and chart.stat().st_size > 0
