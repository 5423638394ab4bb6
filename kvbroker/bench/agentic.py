"""Concurrent agent sessions on a decode node whose KV cache is small: what retention policy
costs the requests that need the blocks.

The multi-turn sweep shows what reuse saves one conversation; the retention simulation shows
what a fixed TTL holds idle on a model of a trace. Neither shows the cost that matters once
the decode node is full: retained KV of idle (or abandoned) conversations competing with the
blocks that new turns need. Here the real one-machine stack (vLLM CPU engines, NIXL, registry,
sidecars, router) serves several agent sessions at once, with the engines' KV cache cut to a
few dozen blocks so that five or six idle conversations fill it. The sessions follow the
retention trace (``kvbroker.bench.retention.make_trace``: tool calls, think times, clients
that close and clients that vanish), time-compressed so that all three arms fit in about a
quarter of an hour on 2 cores. Three arms replay the same trace:

* ``reuse-off``: no session id; plain P/D, every turn recomputed, nothing retained.
* ``fixed-ttl``: vLLM's behaviour: every retention is held for the hard cap (480 s, compressed
  like the trace), never released under pressure, no retention budget; clients have no
  keep-alive or close (vLLM offers neither). Turns that need blocks wait until a retention
  expires.
* ``kvbroker``: the defaults: idle leases, keep-alives during tool calls, close on exit,
  release under pressure and a retention budget.

Each request is a streamed chat turn through the router (``kvbroker.bench.turns``); the
client measures TTFT and reads the registry's decision. A request *waited for blocks* when its
decode leg (TTFT minus P's prefill leg, as the router reports it: D admitting the request,
pulling the new KV from P and producing the first token) took longer than ``stall_ms``. With
room on D that leg took 40-700 ms in the smoke runs, up to 1.7 s when six sessions' first
turns reached D's one core at once; waiting for blocks to be freed took 2.3-9.3 s. Every record
keeps ``decode_wait_ms``, so the threshold can be moved afterwards. Beside the requests, D's
own gauges (KV cache usage, requests waiting) are sampled once a second.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import signal
import statistics
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from kvbroker.bench.multiturn import ContextBuilder
from kvbroker.bench.retention import Conversation, Gap, TraceConfig, make_trace
from kvbroker.bench.turns import measured_turn
from kvbroker.stack import Stack, StackConfig

# vLLM's default decoder_kv_blocks_ttl, seconds; the fixed-ttl arm holds it, time-compressed.
VLLM_TTL_S = 480.0
# The compressed cap never goes below this: the stall it causes must stay visible.
MIN_FIXED_CAP_S = 20
# An agent in a tool call renews its lease this often (compressed seconds; the registry's
# shortest idle TTL is 10 s).
KEEPALIVE_EVERY_S = 5.0
# D's gauges, sampled during each arm.
DECODE_GAUGES = {"usage": "vllm:kv_cache_usage_perc", "waiting": "vllm:num_requests_waiting"}


def fixed_ttl_registry_flags(cap_s: int) -> tuple[str, ...]:
    """The fixed-ttl arm's registry: every lease lives for the cap; nothing is learned."""
    return ("--lease-ttl", str(cap_s), "--no-learn-idle-ttl")


# The fixed-ttl arm's connector: no release under pressure, no retention budget.
FIXED_TTL_CONNECTOR: dict[str, object] = {
    "kvbroker_pressure_release": False,
    "kvbroker_retention_max_fraction": 1.0,
}


@dataclass(frozen=True)
class Arm:
    name: str
    # Send a session id (D retains, the next turn may reuse).
    sessions: bool
    # Keep-alives during tool calls and DELETE when the client closes: kvbroker's API.
    keepalive_and_close: bool
    # Which stack serves it: "kvbroker" (defaults) or "fixed-ttl".
    stack: str


ARMS = {
    arm.name: arm
    for arm in (
        Arm("reuse-off", sessions=False, keepalive_and_close=False, stack="kvbroker"),
        Arm("kvbroker", sessions=True, keepalive_and_close=True, stack="kvbroker"),
        Arm("fixed-ttl", sessions=True, keepalive_and_close=False, stack="fixed-ttl"),
    )
}


@dataclass(frozen=True)
class AgenticConfig:
    """Sized for a 2-core machine: all three arms in about 15 minutes, stack starts included."""

    arms: tuple[str, ...] = tuple(ARMS)
    sessions: int = 20
    concurrency: int = 6
    mean_turns: float = 6.0
    max_turns: int = 12
    # Trace seconds per wall-clock second.
    time_scale: float = 12.0
    # Longest gap after compression; None: 1.2 x the fixed cap, so some gaps outlast it.
    max_gap_s: float | None = None
    # Blocks of 128 tokens per engine (P gets the same: Stack passes engine_args to both).
    kv_blocks: int = 72
    system_tokens: int = 500
    turn_tokens: int = 250
    max_tokens: int = 16
    stall_ms: float = 2000.0
    # The kvbroker arm's retention budget (kvbroker_retention_max_fraction); None: the
    # connector's default.
    retention_max_fraction: float | None = None
    seed: int = 0
    model_dir: Path | None = None
    workdir: Path = Path("/tmp/kvbroker-agentic")

    @property
    def fixed_cap_s(self) -> int:
        return max(round(VLLM_TTL_S / self.time_scale), MIN_FIXED_CAP_S)

    @property
    def gap_cap_s(self) -> float:
        return self.max_gap_s if self.max_gap_s is not None else 1.2 * self.fixed_cap_s

    def trace(self) -> list[Conversation]:
        full = make_trace(
            TraceConfig(conversations=self.sessions, mean_turns=self.mean_turns, seed=self.seed)
        )
        return compress(full, self.time_scale, self.gap_cap_s, self.max_turns)

    def stack_config(self, stack: str) -> StackConfig:
        config = StackConfig(
            workdir=self.workdir / stack,
            model_dir=self.model_dir,
            # kv_blocks counts blocks of vLLM's CPU default size, as the recorded runs did.
            block_size=128,
            engine_args=("--num-gpu-blocks-override", str(self.kv_blocks)),
        )
        if stack == "kvbroker" and self.retention_max_fraction is not None:
            budget: dict[str, object] = {
                "kvbroker_retention_max_fraction": self.retention_max_fraction
            }
            config = replace(config, connector_extra=budget)
        if stack == "fixed-ttl":
            config = replace(
                config,
                hard_cap_s=self.fixed_cap_s,
                registry_flags=fixed_ttl_registry_flags(self.fixed_cap_s),
                connector_extra=dict(FIXED_TTL_CONNECTOR),
            )
        return config


def compress(
    trace: Sequence[Conversation], time_scale: float, max_gap_s: float, max_turns: int
) -> list[Conversation]:
    """The trace in wall-clock seconds: gaps divided by ``time_scale`` and capped at
    ``max_gap_s``, conversations cut to ``max_turns`` turns."""
    if time_scale <= 0 or max_gap_s <= 0 or max_turns < 1:
        raise ValueError("need a positive time scale and gap cap, and at least one turn")
    return [
        Conversation(
            tuple(
                Gap(min(gap.seconds / time_scale, max_gap_s), gap.tool_call)
                for gap in conversation.gaps[: max_turns - 1]
            ),
            conversation.closes,
        )
        for conversation in trace
    ]


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


async def run_agentic(config: AgenticConfig, console: Console) -> list[ArmResult]:
    """Every selected arm, one stack at a time (the kvbroker stack first: reuse-off, then
    kvbroker); each stack is stopped before the next starts, and on failure or SIGTERM."""
    task = asyncio.current_task()
    assert task is not None
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, task.cancel)
    trace = config.trace()
    gaps = [gap.seconds for conversation in trace for gap in conversation.gaps]
    console.print(
        f"[dim]·[/] trace: {len(trace)} sessions, {sum(c.turns for c in trace)} turns, "
        f"{sum(gaps):.0f} s of gaps (x{config.time_scale:g} compressed, capped at "
        f"{config.gap_cap_s:.0f} s); fixed-ttl cap {config.fixed_cap_s} s"
    )
    arms = [ARMS[name] for name in ARMS if name in config.arms]
    results: list[ArmResult] = []
    try:
        for stack_name in dict.fromkeys(arm.stack for arm in arms):
            stack = Stack(
                config.stack_config(stack_name),
                progress=lambda message: console.print(f"[dim]·[/] {message}"),
            )
            try:
                with console.status(f"starting the {stack_name} stack"):
                    await stack.start()
                    await _warm_up(stack)
                for arm in (a for a in arms if a.stack == stack_name):
                    results.append(await run_arm(stack, arm, trace, config, console))
            finally:
                console.print(f"[dim]·[/] stopping the {stack_name} stack")
                await stack.stop()
    finally:
        loop.remove_signal_handler(signal.SIGTERM)
    return results


async def _warm_up(stack: Stack) -> None:
    """The engines' first request is slow (README); it is not part of any arm."""
    async with httpx.AsyncClient(timeout=600) as client:
        await measured_turn(
            client,
            stack,
            [{"role": "user", "content": ContextBuilder(-1).text(200)}],
            None,
            4,
        )


async def run_arm(
    stack: Stack,
    arm: Arm,
    trace: Sequence[Conversation],
    config: AgenticConfig,
    console: Console,
) -> ArmResult:
    """The trace's sessions, ``concurrency`` at a time: a session starts when one ends."""
    result = ArmResult(arm.name)
    started = time.perf_counter()
    sessions = iter(enumerate(trace))
    async with httpx.AsyncClient(timeout=600) as client:
        sampler = asyncio.create_task(_sample_decode(client, stack.url(stack.decode), result))
        with Progress(console=console, transient=False) as progress:
            task = progress.add_task(arm.name, total=sum(c.turns for c in trace))

            async def worker() -> None:
                for index, conversation in sessions:
                    await _session(
                        stack, client, arm, index, conversation, config, result, started,
                        lambda turns: progress.advance(task, turns),
                    )  # fmt: skip

            try:
                async with asyncio.TaskGroup() as workers:  # one failing cancels the rest
                    for _ in range(config.concurrency):
                        workers.create_task(worker())
            finally:
                sampler.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await sampler
    result.wall_s = time.perf_counter() - started
    return result


async def _session(
    stack: Stack,
    client: httpx.AsyncClient,
    arm: Arm,
    index: int,
    conversation: Conversation,
    config: AgenticConfig,
    result: ArmResult,
    arm_started: float,
    advance: Callable[[int], None],
) -> None:
    conversation_id = f"agentic-{arm.name}-{index}"
    session = conversation_id if arm.sessions else None
    # Seeded by the session alone: every arm replays the same conversation (at temperature
    # 0 the answers match too). Each session has its own system text, so no KV is shared
    # between sessions and the cache holds one copy per conversation.
    builder = ContextBuilder(config.seed * 100_003 + index)
    system = "You are a coding agent. " + builder.text(config.system_tokens)
    messages = [
        {"role": "system", "content": system},
        {"role": "user", "content": builder.text(config.turn_tokens)},
    ]
    gaps = (Gap(0.0, tool_call=False), *conversation.gaps)
    for turn, gap in enumerate(gaps, start=1):
        if turn > 1:
            await _idle(client, stack.router_url, session, gap, arm, result)
            prefix = "Tool output:\n" if gap.tool_call else ""
            messages.append({"role": "user", "content": prefix + builder.text(config.turn_tokens)})
        sent = time.perf_counter() - arm_started
        try:
            answer, measured = await measured_turn(
                client,
                stack,
                messages,
                session,
                config.max_tokens,
            )
        except (RuntimeError, httpx.HTTPError) as error:
            # The history is broken from here on: the session ends, counted as an error.
            result.errors.append(f"{conversation_id} turn {turn}: {error!r}")
            advance(conversation.turns - turn + 1)
            return
        messages.append({"role": "assistant", "content": answer})
        builder.learn(sum(len(m["content"]) for m in messages[:-1]), measured["input_num_tokens"])
        decode_wait = measured["ttft_ms"] - measured["prefill_leg_ms"]
        result.records.append(
            AgenticRecord(
                arm=arm.name,
                conversation_id=conversation_id,
                turn=turn,
                gap_s=round(gap.seconds, 3),
                after_tool_call=gap.tool_call,
                decision=measured["decision"],
                path=measured["path"],
                input_num_tokens=measured["input_num_tokens"],
                output_num_tokens=measured["output_num_tokens"],
                ttft_ms=measured["ttft_ms"],
                e2e_ms=measured["e2e_ms"],
                prefill_leg_ms=measured["prefill_leg_ms"],
                decode_wait_ms=decode_wait,
                waited_for_blocks=decode_wait > config.stall_ms,
                sent_s=round(sent, 3),
            )
        )
        advance(1)
    if conversation.closes and session is not None and arm.keepalive_and_close:
        with contextlib.suppress(httpx.HTTPError):
            await client.delete(f"{stack.router_url}/v1/sessions/{session}")
            result.closes += 1
    # Otherwise the client is gone: whatever D retains stays until its lease or TTL ends.


async def _idle(
    client: httpx.AsyncClient,
    router_url: str,
    session: str | None,
    gap: Gap,
    arm: Arm,
    result: ArmResult,
) -> None:
    """Waits out a gap; an agent on kvbroker keeps its lease alive while a tool runs."""
    if not (gap.tool_call and session is not None and arm.keepalive_and_close):
        await asyncio.sleep(gap.seconds)
        return
    loop = asyncio.get_running_loop()
    end = loop.time() + gap.seconds
    while (left := end - loop.time()) > 0:
        await asyncio.sleep(min(KEEPALIVE_EVERY_S, left))
        if end - loop.time() > 0:
            # A refused keep-alive (no live lease) is not an error: the turn just misses.
            with contextlib.suppress(httpx.HTTPError):
                await client.post(f"{router_url}/v1/sessions/{session}/keepalive")
                result.keepalives += 1


async def _sample_decode(
    client: httpx.AsyncClient, decode_url: str, result: ArmResult, every_s: float = 1.0
) -> None:
    started = time.perf_counter()
    wanted = {name: key for key, name in DECODE_GAUGES.items()}
    while True:
        with contextlib.suppress(httpx.HTTPError):
            text = (await client.get(f"{decode_url}/metrics", timeout=5)).text
            values = dict.fromkeys(DECODE_GAUGES, 0.0)
            for family in text_string_to_metric_families(text):
                for sample in family.samples:
                    if sample.name in wanted:
                        values[wanted[sample.name]] += sample.value
            result.decode_samples.append(
                (round(time.perf_counter() - started, 2), values["usage"], values["waiting"])
            )
        await asyncio.sleep(every_s)


# ---------------------------------------------------------------------- summary and output


def quantile(values: Sequence[float], q: float) -> float:
    """The q-quantile (0 < q < 1, in hundredths) of the values, interpolated; NaN if none."""
    if not values:
        return math.nan
    if len(values) == 1:
        return float(values[0])
    return statistics.quantiles(values, n=100, method="inclusive")[round(100 * q) - 1]


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


def write(results: Sequence[ArmResult], config: AgenticConfig, output: Path) -> list[Path]:
    output.mkdir(parents=True, exist_ok=True)
    records = output / "records.jsonl"
    records.write_text(
        "".join(json.dumps(asdict(r)) + "\n" for result in results for r in result.records)
    )
    summary = output / "summary.json"
    settings = {
        key: value for key, value in asdict(config).items() if key not in ("model_dir", "workdir")
    }
    summary.write_text(
        json.dumps(
            {
                "config": {
                    **settings,
                    "fixed_cap_s": config.fixed_cap_s,
                    "gap_cap_s": config.gap_cap_s,
                    "fixed_ttl_registry_flags": fixed_ttl_registry_flags(config.fixed_cap_s),
                    "fixed_ttl_connector": FIXED_TTL_CONNECTOR,
                    "model_dir": str(config.model_dir) if config.model_dir else None,
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
    import matplotlib

    matplotlib.use("Agg")
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
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
