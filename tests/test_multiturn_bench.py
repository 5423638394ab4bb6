"""`kvbroker bench multiturn`'s pure parts on made-up turns: the arms' order, the settings'
checks, each arm's median and spread, the planner's ratios, the targets' verdicts, and the
files written. A real run on vLLM engines is in tests/test_e2e_paths.py."""

from __future__ import annotations

import inspect
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from kvbroker_tools.bench.multiturn import (
    ARMS,
    FIXED_PATHS,
    MultiturnConfig,
    arm_order,
    plot,
    print_table,
    summarise,
    verdict,
    write,
)
from kvbroker_tools.bench.routers import arms_of
from kvbroker_tools.bench.turns import TurnRecord
from kvbroker_tools.cli.bench import bench_multiturn


def record(
    arm: str,
    ttft_ms: float,
    path: str,
    length: int = 1024,
    suffix: str = "one-line",
    kind: str = "follow-up",
) -> TurnRecord:
    return TurnRecord(
        conversation_id=f"c-{arm}", kind=kind, arm=arm, suffix=suffix, repetition=0,
        target_tokens=length, input_num_tokens=length + 30, output_num_tokens=16,
        ttft_ms=ttft_ms, e2e_ms=ttft_ms + 100, prefill_leg_ms=0.0, kv_read_ms=0.0,
        kv_read_bytes=0.0, kv_reads=0, decision="REUSE", path=path,
    )  # fmt: skip


def point(
    ttfts: Mapping[str, tuple[float, ...]], planner_path: str, **where: Any
) -> list[TurnRecord]:
    """Follow-ups of the given TTFTs per arm: a fixed arm on its path, reuse off recomputed."""
    paths = {**FIXED_PATHS, "planner": planner_path, "off": "RECOMPUTE"}
    return [record(arm, ms, paths[arm], **where) for arm, values in ttfts.items() for ms in values]


def test_the_arms_take_every_place_in_turn() -> None:
    orders = [arm_order(ARMS, repetition) for repetition in range(len(ARMS))]
    assert orders[0] == list(ARMS) and orders[1][0] == ARMS[1] and orders[1][-1] == ARMS[0]
    for place in range(len(ARMS)):
        assert sorted(order[place] for order in orders) == sorted(ARMS)
    assert arm_order(("planner", "off"), 3) == ["off", "planner"]


@pytest.mark.parametrize(
    "settings",
    [
        {"arms": ("planner", "turbo")},
        {"arms": ()},
        {"arms": ("read", "read")},
        {"suffixes": ("huge",)},
        {"lengths": (0,)},
        {"lengths": (512, 512)},
        {"repeats": 0},
    ],
)
def test_bad_settings_are_refused(settings: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        MultiturnConfig(**settings)  # type: ignore[arg-type]


def test_the_largest_follow_up_must_fit_the_context() -> None:
    MultiturnConfig().check_fits(8192)  # the defaults fit the stack's engines
    with pytest.raises(ValueError, match="does not fit"):
        MultiturnConfig(lengths=(6500,)).check_fits(8192)
    MultiturnConfig(lengths=(6500,), suffixes=("one-line",)).check_fits(8192)


def test_summary_spread_ratios_and_targets() -> None:
    records = point(
        {
            "planner": (100, 110, 120, 130, 140),
            "read": (300, 320, 340),
            "decode-local": (90, 100, 110),
            "recompute": (900, 1000, 1100),
            "off": (800, 900, 1000),
        },
        "DECODE_LOCAL",
    )
    records.append(record("planner", 5000, "READ", kind="opening"))  # not a measured point
    (row,) = summarise(records)
    planner, decode_local = row["arms"]["planner"], row["arms"]["decode-local"]
    assert planner["n"] == 5 and planner["median_ms"] == 120
    assert (planner["q1_ms"], planner["q3_ms"]) == (110, 130)
    assert (planner["min_ms"], planner["max_ms"]) == (100, 140)
    assert planner["paths"] == {"DECODE_LOCAL": 5}
    assert decode_local["median_ms"] == 100 and (decode_local["q1_ms"], decode_local["q3_ms"]) == (
        95,
        105,
    )
    assert row["best_fixed_arm"] == "decode-local" and row["planner_took_best_path"]
    assert row["planner_vs_best"] == pytest.approx(1.2)
    assert row["planner_vs_off"] == pytest.approx(120 / 900)
    assert row["read_vs_planner"] == pytest.approx(320 / 120)
    # 1.2x the best is over 10 %; the only point is the longest, so the READ target counts.
    assert row["targets"] == {
        "within_best": False,
        "not_slower_than_off": True,
        "speedup_over_read": True,
    }
    assert verdict([row]) == {
        "within_best": False,
        "not_slower_than_off": True,
        "speedup_over_read": True,
    }


def test_targets_by_point() -> None:
    fast = {
        "planner": (105,),
        "read": (200,),
        "decode-local": (100,),
        "recompute": (400,),
        "off": (400,),
    }
    slow_read = {
        "planner": (105,),
        "read": (150,),
        "decode-local": (100,),
        "recompute": (90,),
        "off": (95,),
    }
    records = [
        *point(fast, "DECODE_LOCAL", length=4096, suffix="one-line"),
        *point(slow_read, "DECODE_LOCAL", length=1024, suffix="one-line"),
        *point(slow_read, "DECODE_LOCAL", length=4096, suffix="bulk"),
    ]
    rows = summarise(records)
    assert [(r["length"], r["suffix"]) for r in rows] == [
        (1024, "one-line"), (4096, "one-line"), (4096, "bulk"),
    ]  # fmt: skip
    short, longest, bulk = rows
    # Within 10 % (105/100), faster than off, and 200/105 >= 1.8 at the longest one-liner.
    assert longest["targets"] == {
        "within_best": True,
        "not_slower_than_off": True,
        "speedup_over_read": True,
    }
    # RECOMPUTE is best here (90): 105/90 is over 10 %, and off (95) beats the planner; the
    # READ target is judged only at the longest one-line point.
    assert short["best_fixed_arm"] == "recompute" and not short["planner_took_best_path"]
    assert short["targets"] == {"within_best": False, "not_slower_than_off": False}
    assert "speedup_over_read" not in bulk["targets"]
    assert verdict(rows) == {
        "within_best": False,
        "not_slower_than_off": False,
        "speedup_over_read": True,
    }


def test_targets_without_their_arms_are_not_judged() -> None:
    """--arms planner,off (the reuse on/off comparison): no fixed path, no READ."""
    (row,) = summarise(point({"planner": (100,), "off": (300,)}, "DECODE_LOCAL"))
    assert row["best_fixed_arm"] is None and row["planner_vs_best"] is None
    assert not row["planner_took_best_path"]
    assert row["targets"] == {
        "within_best": None,
        "not_slower_than_off": True,
        "speedup_over_read": None,
    }
    assert verdict([row]) == {
        "within_best": None,
        "not_slower_than_off": True,
        "speedup_over_read": None,
    }
    (fixed_only,) = summarise(point({"read": (100,), "recompute": (300,)}, "READ"))
    assert fixed_only["planner_vs_off"] is None and fixed_only["best_fixed_arm"] == "read"


def test_table_json_and_chart(tmp_path: Path) -> None:
    ttfts = {
        "planner": (100, 120),
        "read": (300,),
        "decode-local": (95,),
        "recompute": (900,),
        "off": (880,),
    }
    records = [
        *point(ttfts, "DECODE_LOCAL", length=1024, suffix="one-line"),
        *point(ttfts, "DECODE_LOCAL", length=1024, suffix="bulk"),
        *point(ttfts, "READ", length=2048, suffix="bulk"),
    ]
    rows = summarise(records)
    console = Console(record=True, width=250)
    print_table(rows, console)
    text = console.export_text()
    assert "DECODE_LOCAL 2" in text and "READ 2" in text and "1.16x (same path)" in text
    assert "within_best NO" in text and "not_slower_than_off yes" in text
    written = write(records, rows, tmp_path, {"prefill_prefix_caching": True})
    assert [p.name for p in written] == ["records.jsonl", "summary.json"]
    assert len(written[0].read_text().splitlines()) == len(records)
    summary = json.loads(written[1].read_text())
    assert summary["prefill_prefix_caching"] is True
    assert summary["verdict"]["within_best"] is False
    assert [row["suffix"] for row in summary["rows"]] == ["one-line", "bulk", "bulk"]
    chart = plot(rows, tmp_path, "test")
    assert chart == tmp_path / "ttft_by_path.png" and chart.stat().st_size > 0


def test_cli_defaults_match_the_config() -> None:
    defaults = MultiturnConfig()
    options = inspect.signature(bench_multiturn).parameters
    assert tuple(options["arms"].default.split(",")) == defaults.arms
    assert tuple(options["suffix"].default.split(",")) == defaults.suffixes
    assert tuple(int(n) for n in options["lengths"].default.split(",")) == defaults.lengths
    assert options["repeats"].default == defaults.repeats
    assert options["max_tokens"].default == defaults.max_tokens
    assert options["calibrate"].default == defaults.calibrate


def test_routers_add_their_arms_and_targets(tmp_path: Path) -> None:
    """Behind other routers: each adds its reuse and reuse-off arms; its reuse arm is judged
    against kvbroker's planner (within 15 %) and against its own reuse off (never slower)."""
    assert arms_of(["kvbroker", "vllm-router"], ["planner", "off"]) == (
        "planner",
        "off",
        "vllm-router",
        "vllm-router-off",
    )
    assert arms_of(["proxy"], ["planner", "off"]) == ("proxy", "proxy-off")
    with pytest.raises(ValueError, match="routers"):
        arms_of(["envoy"], ["planner"])
    assert MultiturnConfig(arms=arms_of(["kvbroker", "proxy"], ["planner", "off"])).arms
    records = [
        *(record("planner", ms, "DECODE_LOCAL") for ms in (60, 70, 80)),
        *(record("read", ms, "READ") for ms in (100, 110, 120)),
        *(record("off", ms, "RECOMPUTE") for ms in (400, 420, 440)),
        *(record("vllm-router", ms, "?") for ms in (125, 130, 135)),
        *(record("vllm-router-off", ms, "?") for ms in (410, 430, 450)),
        *(record("proxy", ms, "?") for ms in (150, 160, 170)),
        *(record("proxy-off", ms, "?") for ms in (100, 110, 120)),
    ]
    (row,) = summarise(records)
    assert row["vllm-router_vs_read"] == pytest.approx(130 / 110)
    assert row["vllm-router_vs_planner"] == pytest.approx(130 / 70)
    assert row["vllm-router_vs_off"] == pytest.approx(130 / 430)
    assert row["targets"]["vllm-router_within_kvbroker"] is False  # 1.18x
    assert row["targets"]["vllm-router_not_slower_than_off"] is True
    assert row["targets"]["proxy_not_slower_than_off"] is False
    assert verdict([row])["proxy_within_kvbroker"] is False
    console = Console(record=True, width=200)
    print_table([row], console)
    shown = console.export_text()
    assert "vllm-router/kvbroker-read 1.18x" in shown and "proxy/off 1.45x" in shown
    assert "vllm-router/kvbroker 1.86x" in shown  # shown beside the planner, not judged
    assert plot([row], tmp_path, "routers").exists()
