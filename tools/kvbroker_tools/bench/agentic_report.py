"""What a `kvbroker bench agentic` run yields and what is made of it: the per-request
records, each arm's summary figures, the table, records.jsonl, summary.json and the plot.

Apart from the run (``kvbroker_tools.bench.agentic``) because none of it needs a stack: the unit
tests exercise the figures and the files on records they build themselves.
"""

from __future__ import annotations

import json
import math
import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from kvbroker_tools.bench.agentic_config import (
    FIXED_TTL_CONNECTOR,
    AgenticConfig,
    fixed_ttl_registry_flags,
)
from kvbroker_tools.bench.plotting import ready_plotting, save_figure
from kvbroker_tools.bench.read_shapes import summarise_shapes
from kvbroker_tools.bench.stats import quantile


@dataclass
class AgenticRecord:
    arm: str
    conversation_id: str
    turn: int
    # The (compressed) gap before this turn, and whether it was a tool call; 0 for turn 1.
    gap_s: float
    after_tool_call: bool
    decision: str
    # How the prompt got its KV (READ, DECODE_LOCAL, RECOMPUTE: the router's x-kvbroker-path).
    path: str
    input_num_tokens: int
    output_num_tokens: int
    ttft_ms: float
    e2e_ms: float
    prefill_leg_ms: float
    # TTFT minus P's prefill leg: D's admission, its KV pull from P and the first token.
    decode_wait_ms: float
    waited_for_blocks: bool
    # When the request was sent, seconds since the arm began.
    sent_s: float
    # The NIXL READs issued while it ran, by direction (``bench.read_shapes``): with several
    # sessions at once, other turns' READs too.
    read_shapes: dict[str, dict[str, float]] = field(default_factory=dict)


@dataclass
class ArmResult:
    arm: str
    records: list[AgenticRecord] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    wall_s: float = 0.0
    keepalives: int = 0
    closes: int = 0
    # D's gauges: (seconds since the arm began, KV cache usage 0..1, requests waiting).
    decode_samples: list[tuple[float, float, float]] = field(default_factory=list)


def summarise(result: ArmResult) -> dict[str, Any]:
    """One arm's figures: TTFT percentiles, reuse rate (turns after the first whose decision
    was REUSE), stalls (requests that waited for blocks), turns by path, and D's sampled
    gauges."""
    ttft = [r.ttft_ms for r in result.records]
    later = [r for r in result.records if r.turn > 1]
    usage = [sample[1] for sample in result.decode_samples]
    waits = [r.decode_wait_ms for r in result.records if not math.isnan(r.decode_wait_ms)]
    return {
        "arm": result.arm,
        "requests": len(result.records),
        "errors": len(result.errors),
        "ttft_p50_ms": quantile(ttft, 0.5),
        "ttft_p90_ms": quantile(ttft, 0.9),
        "ttft_p99_ms": quantile(ttft, 0.99),
        "ttft_max_ms": max(ttft, default=math.nan),
        "reuse_opportunities": len(later),
        "reuse_rate": (
            sum(r.decision == "REUSE" for r in later) / len(later) if later else math.nan
        ),
        "stalls": sum(r.waited_for_blocks for r in result.records),
        "paths": dict(sorted(Counter(r.path for r in result.records).items())),
        "decode_wait_p50_ms": quantile(waits, 0.5),
        "decode_wait_max_ms": max(waits, default=math.nan),
        "decode_kv_usage_mean": statistics.fmean(usage) if usage else math.nan,
        "decode_kv_usage_max": max(usage, default=math.nan),
        "read_shapes": summarise_shapes(r.read_shapes for r in result.records),
        "decode_waiting_share": (
            sum(sample[2] > 0 for sample in result.decode_samples) / len(usage)
            if usage
            else math.nan
        ),
        "keepalives": result.keepalives,
        "closes": result.closes,
        "wall_s": result.wall_s,
    }


def print_table(rows: Sequence[dict[str, Any]], stall_ms: float, console: Console) -> None:
    table = Table(title="agent sessions on a small decode KV cache", title_justify="left")
    # Short headers: a console that is not a terminal is 80 columns wide.
    for column in ("arm", "reqs", "p50", "p90", "p99", "max", "reuse", "stalls", "D KV", "err"):
        table.add_column(column, justify="right")

    def seconds(ms: float) -> str:
        return f"{ms / 1000:.2f} s"

    for row in rows:
        table.add_row(
            row["arm"],
            str(row["requests"]),
            seconds(row["ttft_p50_ms"]),
            seconds(row["ttft_p90_ms"]),
            seconds(row["ttft_p99_ms"]),
            seconds(row["ttft_max_ms"]),
            "-" if math.isnan(row["reuse_rate"]) else f"{100 * row['reuse_rate']:.0f} %",
            str(row["stalls"]),
            f"{100 * row['decode_kv_usage_mean']:.0f} %",
            str(row["errors"]),
        )
    console.print(table)
    console.print(
        f"TTFT percentiles over every request; reuse: turns after the first whose decision "
        f"was REUSE; stalls: requests whose decode leg (TTFT minus P's prefill leg) took over "
        f"{stall_ms / 1000:g} s; D KV: the decode engine's mean KV cache usage"
    )


def settings(config: AgenticConfig) -> dict[str, Any]:
    """The run's settings as its JSON records them (the model by its directory, if given; the
    workdir, which holds only sockets and logs, not at all)."""
    found = {key: value for key, value in asdict(config).items() if key != "workdir"}
    found["model_dir"] = str(config.model_dir) if config.model_dir else None
    return found


def write(results: Sequence[ArmResult], config: AgenticConfig, output: Path) -> list[Path]:
    output.mkdir(parents=True, exist_ok=True)
    records = output / "records.jsonl"
    records.write_text(
        "".join(json.dumps(asdict(r)) + "\n" for result in results for r in result.records)
    )
    summary = output / "summary.json"
    summary.write_text(
        json.dumps(
            {
                "config": {
                    **settings(config),
                    "fixed_cap_s": config.fixed_cap_s,
                    "gap_cap_s": config.gap_cap_s,
                    "fixed_ttl_registry_flags": fixed_ttl_registry_flags(config.fixed_cap_s),
                    "fixed_ttl_connector": FIXED_TTL_CONNECTOR,
                },
                "arms": [summarise(result) for result in results],
                "errors": {result.arm: result.errors for result in results},
                "decode_samples": {result.arm: result.decode_samples for result in results},
            },
            indent=2,
        )
    )
    return [records, summary, plot(results, output / "agentic.png")]


def plot(results: Sequence[ArmResult], path: Path) -> Path:
    ready_plotting()
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    colors = {"reuse-off": "#c44e52", "fixed-ttl": "#dd8452", "kvbroker": "#4c72b0"}
    fig, (cdf, bars, usage) = plt.subplots(1, 3, figsize=(15, 4.2))
    for result in results:
        if result.records:
            ttft = [r.ttft_ms / 1000 for r in result.records]
            cdf.ecdf(ttft, label=result.arm, color=colors.get(result.arm))
        if result.decode_samples:
            usage.plot(
                [s[0] for s in result.decode_samples],
                [100 * s[1] for s in result.decode_samples],
                label=result.arm,
                color=colors.get(result.arm),
                linewidth=1,
            )
    cdf.set_xscale("log")
    cdf.xaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    cdf.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}"))
    cdf.xaxis.set_minor_formatter(NullFormatter())
    cdf.set_xlabel("TTFT (s, log scale)")
    cdf.set_ylabel("share of requests")
    cdf.set_title("TTFT CDF")
    cdf.grid(alpha=0.3, which="both")
    cdf.legend(loc="lower right")

    rows = [summarise(result) for result in results]
    positions = range(len(rows))
    rates = [100 * row["reuse_rate"] if not math.isnan(row["reuse_rate"]) else 0 for row in rows]
    bars.bar(positions, rates, color=[colors.get(row["arm"], "#55a868") for row in rows])
    for position, rate, row in zip(positions, rates, rows, strict=True):
        bars.annotate(f"{rate:.0f} %\n{row['stalls']} stalls", (position, rate), ha="center",
                      va="bottom", fontsize=8)  # fmt: skip
    bars.set_xticks(list(positions), [row["arm"] for row in rows])
    bars.set_ylim(0, 115)
    bars.set_ylabel("turns after the first reusing KV (%)")
    bars.set_title("Reuse rate")
    bars.grid(axis="y", alpha=0.3)

    usage.set_xlabel("seconds into the arm")
    usage.set_ylabel("decode KV cache used (%)")
    usage.set_ylim(0, 105)
    usage.set_title("Decode KV cache usage")
    usage.grid(alpha=0.3)
    usage.legend(loc="lower right")
    return save_figure(fig, path)
