"""What decode retention costs and buys on an agentic trace, without engines.

A trace of conversations with heavy-tailed think times between turns is replayed against two
retention policies on the decode node:

* ``fixed TTL`` (vLLM's ``decoder_kv_blocks_ttl``): after every turn D keeps the blocks for a
  fixed time, whether the conversation is alive or not.
* ``kvbroker``: an idle lease of ``timeout`` seconds after every turn, renewed by the agent's
  keep-alive while it waits on a tool call, and released at once when the client closes the
  session.

For each policy: the reuse hit rate (turns after the first whose history is still retained)
and the block-seconds held while no request of that conversation is running (idle).
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from kvbroker_tools.bench.plotting import ready_plotting, save_figure


@dataclass(frozen=True)
class TraceConfig:
    conversations: int = 5000
    mean_turns: float = 8.0
    # New context per turn (prompt growth plus the answer), tokens.
    tokens_per_turn: int = 700
    block_size: int = 16
    # Share of gaps that are tool calls (the agent knows it is busy and keeps the lease alive);
    # the rest are a person thinking, or gone.
    tool_call_share: float = 0.6
    # Tool calls: lognormal seconds (median, sigma). People: Pareto seconds (scale, shape).
    tool_median_s: float = 20.0
    tool_sigma: float = 1.5
    think_scale_s: float = 30.0
    think_shape: float = 0.6
    max_gap_s: float = 4 * 3600.0
    # Share of conversations whose client closes the session when done.
    close_share: float = 0.7
    seed: int = 0


@dataclass(frozen=True)
class Gap:
    seconds: float
    tool_call: bool


@dataclass(frozen=True)
class Conversation:
    gaps: tuple[Gap, ...]  # between consecutive turns
    closes: bool

    @property
    def turns(self) -> int:
        return len(self.gaps) + 1


def make_trace(config: TraceConfig) -> list[Conversation]:
    rng = random.Random(config.seed)
    trace = []
    for _ in range(config.conversations):
        turns = 1 + int(rng.expovariate(1.0 / (config.mean_turns - 1)))
        gaps = []
        for _ in range(turns - 1):
            if rng.random() < config.tool_call_share:
                seconds = rng.lognormvariate(math.log(config.tool_median_s), config.tool_sigma)
                gaps.append(Gap(min(seconds, config.max_gap_s), True))
            else:
                seconds = config.think_scale_s * rng.paretovariate(config.think_shape)
                gaps.append(Gap(min(seconds, config.max_gap_s), False))
        trace.append(Conversation(tuple(gaps), rng.random() < config.close_share))
    return trace


@dataclass(frozen=True)
class Outcome:
    policy: str
    timeout_s: float
    hit_rate: float
    idle_block_hours: float
    hits: int
    reuse_opportunities: int


def _blocks(turn: int, config: TraceConfig) -> int:
    return math.ceil(turn * config.tokens_per_turn / config.block_size)


def fixed_ttl(trace: Sequence[Conversation], ttl_s: float, config: TraceConfig) -> Outcome:
    hits = opportunities = 0
    idle = 0.0
    for conversation in trace:
        for turn, gap in enumerate(conversation.gaps, start=1):
            opportunities += 1
            held = min(gap.seconds, ttl_s)
            hits += gap.seconds <= ttl_s
            idle += _blocks(turn, config) * held
        idle += _blocks(conversation.turns, config) * ttl_s  # after the last turn
    return Outcome("fixed TTL", ttl_s, hits / max(opportunities, 1), idle / 3600, hits,
                   opportunities)  # fmt: skip


def idle_lease(trace: Sequence[Conversation], timeout_s: float, config: TraceConfig) -> Outcome:
    hits = opportunities = 0
    idle = 0.0
    for conversation in trace:
        for turn, gap in enumerate(conversation.gaps, start=1):
            opportunities += 1
            retained = gap.tool_call or gap.seconds <= timeout_s
            hits += retained
            idle += _blocks(turn, config) * (gap.seconds if retained else timeout_s)
        if not conversation.closes:
            idle += _blocks(conversation.turns, config) * timeout_s
    return Outcome("kvbroker", timeout_s, hits / max(opportunities, 1), idle / 3600, hits,
                   opportunities)  # fmt: skip


def simulate(
    config: TraceConfig,
    fixed_ttl_s: float = 480.0,
    timeouts_s: Sequence[float] = (15, 30, 60, 120, 240, 480, 900, 1800),
) -> tuple[Outcome, list[Outcome]]:
    trace = make_trace(config)
    return fixed_ttl(trace, fixed_ttl_s, config), [idle_lease(trace, t, config) for t in timeouts_s]


def at_equal_hit_rate(baseline: Outcome, sweep: Sequence[Outcome]) -> Outcome | None:
    """The cheapest kvbroker setting that reuses at least as often as the baseline."""
    matching = [o for o in sweep if o.hit_rate >= baseline.hit_rate]
    return min(matching, key=lambda o: o.idle_block_hours) if matching else None


def report(
    baseline: Outcome, sweep: Sequence[Outcome], output: Path, console: Console
) -> Outcome | None:
    output.mkdir(parents=True, exist_ok=True)
    table = Table(title="decode retention on an agentic trace", title_justify="left")
    for column in ("policy", "idle timeout", "reuse hit rate", "idle block-hours", "vs fixed TTL"):
        table.add_column(column, justify="right")
    for outcome in (baseline, *sweep):
        saved = 1 - outcome.idle_block_hours / baseline.idle_block_hours
        table.add_row(
            outcome.policy,
            f"{outcome.timeout_s:.0f} s",
            f"{100 * outcome.hit_rate:.1f} %",
            f"{outcome.idle_block_hours:,.0f}",
            "-" if outcome is baseline else f"{100 * saved:+.1f} % saved",
        )
    console.print(table)
    match = at_equal_hit_rate(baseline, sweep)
    if match is not None:
        saved = 1 - match.idle_block_hours / baseline.idle_block_hours
        console.print(
            f"at equal or better reuse ({100 * match.hit_rate:.1f} % vs "
            f"{100 * baseline.hit_rate:.1f} %), kvbroker with a {match.timeout_s:.0f} s idle "
            f"timeout holds {100 * saved:.0f} % fewer idle block-seconds than a fixed "
            f"{baseline.timeout_s:.0f} s TTL"
        )
    (output / "retention.json").write_text(
        json.dumps(
            {
                "baseline": asdict(baseline),
                "sweep": [asdict(o) for o in sweep],
                "equal_hit_rate": asdict(match) if match else None,
            },
            indent=2,
        )
    )
    _plot(baseline, sweep, output / "retention_tradeoff.png")
    return match


def _plot(baseline: Outcome, sweep: Sequence[Outcome], path: Path) -> None:
    ready_plotting()
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot([o.idle_block_hours for o in sweep], [100 * o.hit_rate for o in sweep], "o-",
            label="kvbroker idle lease (keep-alive, close)")  # fmt: skip
    for outcome in sweep:
        ax.annotate(f"{outcome.timeout_s:.0f}s", (outcome.idle_block_hours, 100 * outcome.hit_rate),
                    textcoords="offset points", xytext=(4, -10), fontsize=8)  # fmt: skip
    ax.plot([baseline.idle_block_hours], [100 * baseline.hit_rate], "s", color="#c44e52",
            markersize=9, label=f"fixed TTL {baseline.timeout_s:.0f} s")  # fmt: skip
    ax.set_xlabel("idle block-hours held on decode nodes")
    ax.set_ylabel("reuse hit rate (%)")
    ax.set_title("Retention cost vs reuse")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    save_figure(fig, path)
