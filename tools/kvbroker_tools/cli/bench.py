"""``kvbroker bench``: the benchmarks (the registry's, the failover soak's and the fleet's
options in modules of their own, registered here). Each imports its code only when it runs, so
that the operator commands start fast; the retention simulation's module is light, so its
flags take their defaults from TraceConfig."""

from __future__ import annotations

import asyncio
from functools import partial
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.text import Text

from kvbroker.cli.options import finite, positive_seconds, seconds
from kvbroker.cli.output import fail, say
from kvbroker_tools.bench.retention import TraceConfig
from kvbroker_tools.cli.bench_failover import bench_failover
from kvbroker_tools.cli.bench_fleet import bench_fleet
from kvbroker_tools.cli.bench_registry import bench_registry
from kvbroker_tools.cli.plots import plots_or_fail
from kvbroker_tools.cli.stack import Switch, run_with_stack

bench_app = typer.Typer(help="Benchmarks.", no_args_is_help=True)
bench_app.command("registry")(bench_registry)
bench_app.command("failover")(bench_failover)
bench_app.command("fleet")(bench_fleet)


@bench_app.command("multiturn")
def bench_multiturn(
    output: Annotated[Path, typer.Option(help="Where records, summary and chart go.")] = Path(
        "results/multiturn"
    ),
    arms: Annotated[
        str,
        typer.Option(
            help="Arms: planner, the fixed paths read, decode-local, recompute, and off "
            "(reuse off: plain P/D)."
        ),
    ] = "planner,read,decode-local,recompute,off",
    router: Annotated[
        str,
        typer.Option(
            help="Routers in front of the engines: kvbroker (its router, with --arms), "
            "vllm-router (the real one) and proxy (vLLM's example P/D proxy); each other "
            "router adds two arms, reuse on and off, compared with kvbroker's planner."
        ),
    ] = "kvbroker",
    suffix: Annotated[
        str, typer.Option(help="New suffix sizes: one-line (a question), bulk (a tool result).")
    ] = "one-line,bulk",
    lengths: Annotated[
        str, typer.Option(help="Context lengths, tokens.")
    ] = "512,1024,2048,4096,6144",
    repeats: Annotated[int, typer.Option(min=1, help="Follow-ups per point and arm.")] = 10,
    max_tokens: Annotated[int, typer.Option(min=1, help="Tokens generated per turn.")] = 16,
    prefill_cache: Annotated[
        Switch, typer.Option(help="The prefill node's own prefix cache.")
    ] = Switch.off,
    calibrate: Annotated[
        bool,
        typer.Option(
            help="Measure the nodes' costs for the planner (kvbroker calibrate) after the "
            "warm-up; without it the planner estimates from default costs."
        ),
    ] = False,
    model: Annotated[Path | None, typer.Option(help="A model directory.")] = None,
    workdir: Annotated[Path, typer.Option(help="Sockets and logs.")] = Path("/tmp/kvbroker-bench"),
) -> None:
    """A follow-up's TTFT by path (the planner, each fixed path, reuse off), context length
    and new suffix size, the arms interleaved: JSON, a chart, a table with the targets."""
    plots_or_fail()
    from kvbroker_tools.bench.multiturn import (
        MultiturnConfig,
        plot,
        print_table,
        run_multiturn,
        summarise,
        write,
    )
    from kvbroker_tools.bench.routers import arms_of
    from kvbroker_tools.stack import StackConfig

    try:
        config = MultiturnConfig(
            lengths=tuple(int(n) for n in lengths.split(",")),
            suffixes=_names(suffix),
            arms=arms_of(_names(router), _names(arms)),
            repeats=repeats,
            max_tokens=max_tokens,
            calibrate=calibrate,
        )
        config.check_fits(StackConfig.max_model_len)
    except ValueError as error:
        fail(
            f"{error} (--lengths {lengths!r}, --suffix {suffix!r}, --arms {arms!r}, "
            f"--router {router!r})",
            2,
        )
    cache = prefill_cache is Switch.on

    async def body(stack: Any, console: Console) -> None:
        records = await run_multiturn(stack, config, console)
        rows = summarise(records)
        print_table(rows, console)
        meta = {
            "prefill_prefix_caching": cache,
            "model_dir": str(stack.model_dir),
            "repeats": config.repeats,
            "max_tokens": config.max_tokens,
            "calibrated": config.calibrate,
            "suffix_tokens": {name: config.suffix_tokens[name] for name in config.suffixes},
            "routers": list(_names(router)),
        }
        written = [*write(records, rows, output, meta)]
        title = f"Follow-up TTFT by path (P's prefix cache {prefill_cache.value}, CPU)"
        written.append(plot(rows, output, title))
        console.print(Text(f"written: {', '.join(str(p) for p in written)}"))

    run_with_stack(True, model, workdir, body, prefill_prefix_caching=cache)


def _names(value: str) -> tuple[str, ...]:
    """A comma-separated list of names, blanks dropped."""
    return tuple(name.strip() for name in value.split(",") if name.strip())


@bench_app.command("retention")
def bench_retention(
    output: Annotated[Path, typer.Option(help="Where the table's JSON and the plot go.")] = Path(
        "results/retention"
    ),
    conversations: Annotated[
        int, typer.Option(min=1, help="Conversations in the trace.")
    ] = TraceConfig.conversations,
    fixed_ttl: Annotated[
        float, typer.Option(callback=seconds, min=1, help="The fixed TTL to compare, s.")
    ] = 480,
    seed: Annotated[int, typer.Option(help="Trace seed.")] = TraceConfig.seed,
) -> None:
    """Simulate decode retention on an agentic trace: fixed TTL vs kvbroker idle leases."""
    plots_or_fail()
    from kvbroker_tools.bench.retention import report, simulate

    config = TraceConfig(conversations=conversations, seed=seed)
    baseline, sweep = simulate(config, fixed_ttl)
    report(baseline, sweep, output, Console())


@bench_app.command("agentic")
def bench_agentic(
    output: Annotated[Path, typer.Option(help="Where records, summary and chart go.")] = Path(
        "results/agentic"
    ),
    arms: Annotated[
        str, typer.Option(help="Arms to run: reuse-off, fixed-ttl, kvbroker.")
    ] = "reuse-off,fixed-ttl,kvbroker",
    sessions: Annotated[
        int, typer.Option(min=0, help="Agent sessions in the trace (0: the forks alone).")
    ] = 20,
    concurrency: Annotated[int, typer.Option(min=1, help="Sessions running at once.")] = 6,
    time_scale: Annotated[
        float, typer.Option(callback=finite, min=1, help="Trace seconds per wall-clock second.")
    ] = 12.0,
    max_gap: Annotated[
        float | None,
        typer.Option(
            callback=seconds,
            min=0.1,
            help="Longest compressed gap, s [default: 1.2 x the fixed cap].",
        ),
    ] = None,
    mean_turns: Annotated[
        float, typer.Option(callback=finite, min=2, help="Mean turns per session.")
    ] = 6.0,
    max_turns: Annotated[int, typer.Option(min=1, help="Turns per session at most.")] = 12,
    kv_blocks: Annotated[
        int, typer.Option(min=64, help="KV blocks (128 tokens) per engine; 64 fit 8,192 tokens.")
    ] = 72,
    system_tokens: Annotated[int, typer.Option(min=1, help="System prompt, tokens.")] = 500,
    turn_tokens: Annotated[int, typer.Option(min=1, help="New context per turn, tokens.")] = 250,
    max_tokens: Annotated[int, typer.Option(min=1, help="Tokens generated per turn.")] = 16,
    stall_ms: Annotated[
        float,
        typer.Option(
            callback=finite, min=1, help="A decode leg longer than this waited for blocks."
        ),
    ] = 2000.0,
    retention_max_fraction: Annotated[
        float | None,
        typer.Option(
            callback=finite,
            min=0.01,
            max=1.0,
            help="The kvbroker arm's retention budget, a share of D's cache "
            "[default: the connector's, 1.0: none].",
        ),
    ] = None,
    seed: Annotated[int, typer.Option(help="Trace and text seed.")] = 0,
    forks: Annotated[
        int, typer.Option(min=0, help="Sub-agents a parent spawns with its history (0: none).")
    ] = 4,
    rollouts: Annotated[
        int, typer.Option(min=0, help="Rollouts of one prompt in a group (under 2: none).")
    ] = 4,
    model: Annotated[Path | None, typer.Option(help="A model directory.")] = None,
    workdir: Annotated[Path, typer.Option(help="Sockets and logs.")] = Path(
        "/tmp/kvbroker-agentic"
    ),
) -> None:
    """Concurrent agent sessions on a small decode KV cache: no reuse, vLLM's fixed TTL and
    kvbroker on the same trace; TTFT, reuse rate and stalls per arm. Then forks (sub-agents,
    rollouts of one prompt), reuse-off against kvbroker: reuse and TTFT per group."""
    plots_or_fail()
    from kvbroker_tools.bench.agentic import run_agentic
    from kvbroker_tools.bench.agentic_config import ARMS, AgenticConfig
    from kvbroker_tools.bench.agentic_forks import print_forks, summarise_group, write_forks
    from kvbroker_tools.bench.agentic_report import print_table, settings, summarise
    from kvbroker_tools.bench.agentic_report import write as write_agentic

    chosen = _names(arms)
    if not chosen or any(a not in ARMS for a in chosen):
        fail(f"--arms {arms!r}: choose from {', '.join(ARMS)}", 2)
    config = AgenticConfig(
        arms=chosen,
        sessions=sessions,
        concurrency=concurrency,
        mean_turns=mean_turns,
        max_turns=max_turns,
        time_scale=time_scale,
        max_gap_s=max_gap,
        kv_blocks=kv_blocks,
        system_tokens=system_tokens,
        turn_tokens=turn_tokens,
        max_tokens=max_tokens,
        stall_ms=stall_ms,
        retention_max_fraction=retention_max_fraction,
        seed=seed,
        forks=forks,
        rollouts=rollouts,
        model_dir=model,
        workdir=workdir,
    )
    if not sessions and not config.fork_arms:
        fail("nothing to run: no trace (--sessions 0) and no forks", 2)
    console = Console()
    try:
        results, groups = asyncio.run(run_agentic(config, console))
    except (RuntimeError, TimeoutError) as error:
        fail(str(error))
    except (KeyboardInterrupt, asyncio.CancelledError):
        fail("interrupted; every stack was stopped", 130)
    paths: list[Path] = []
    if results:
        print_table([summarise(result) for result in results], stall_ms, console)
        paths += write_agentic(results, config, output)
    if groups:
        print_forks([summarise_group(group) for group in groups], console)
        paths += write_forks(groups, settings(config), output)
    console.print(Text(f"written: {', '.join(str(p) for p in paths)}"))
    errors = [message for result in results for message in result.errors]
    for message in errors[:5]:
        say(console, message, "red")
    if errors:
        fail(f"{len(errors)} sessions ended on a failed request (all in summary.json)")


@bench_app.command("nixl-read")
def bench_nixl_read(
    output: Annotated[Path, typer.Option(help="Where the JSON and the plot go.")] = Path(
        "results/nixl-read"
    ),
    device: Annotated[
        str,
        typer.Option(help="cuda: both processes' caches in GPU 0's memory; cpu: in DRAM."),
    ] = "cuda",
    tokens: Annotated[
        str, typer.Option(help="Tokens per READ, comma-separated (2k = 2048).")
    ] = "2k,4k,8k,16k,24k",
    layouts: Annotated[
        str, typer.Option(help="Cache layouts: split (vLLM 0.32), packed (vLLM 0.33).")
    ] = "split,packed",
    forms: Annotated[
        str, typer.Option(help="Descriptor forms: scattered, adjacent, strided, contiguous.")
    ] = "scattered,adjacent,strided,contiguous",
    layers: Annotated[int, typer.Option(min=1, help="Layers (Qwen2.5-32B: 64).")] = 64,
    kv_heads: Annotated[int, typer.Option(min=1, help="KV heads per layer.")] = 8,
    head_dim: Annotated[int, typer.Option(min=1, help="Head dimension.")] = 128,
    block_size: Annotated[int, typer.Option(min=1, help="Tokens per KV block.")] = 16,
    warmup: Annotated[int, typer.Option(min=0, help="Untimed READs per point.")] = 2,
    repeats: Annotated[int, typer.Option(min=1, help="Timed READs per point.")] = 7,
    seed: Annotated[int, typer.Option(help="Seed for block ids and cache contents.")] = 0,
    loopback: Annotated[
        bool,
        typer.Option(
            help="One NIXL agent in one process READing from its own memory (UCX cuda_copy "
            "on one GPU), instead of a reader and an owner process."
        ),
    ] = False,
    shapes: Annotated[
        str,
        typer.Option(
            help="Also READs of TOKENS:RUNS, comma-separated (24k:120): per-block "
            "descriptors whose ids come in that many runs on both sides."
        ),
    ] = "",
) -> None:
    """One NIXL READ of a conversation's KV blocks between two processes (or one agent, in
    loopback), by cache layout and descriptor form (bf16, needs torch and nixl, not vLLM): a
    table, JSON and a plot."""
    from kvbroker_tools.bench.nixl_layout import ReadConfig, parse_shapes
    from kvbroker_tools.bench.nixl_read import print_table, run_reads, tokens_list, write

    try:
        config = ReadConfig(
            device=device,
            tokens=tokens_list(tokens),
            layouts=_names(layouts),
            forms=_names(forms),
            layers=layers,
            kv_heads=kv_heads,
            head_dim=head_dim,
            block_size=block_size,
            warmup=warmup,
            repeats=repeats,
            seed=seed,
            loopback=loopback,
            shapes=parse_shapes(shapes),
        )
    except ValueError as error:
        fail(str(error), 2)
    console = Console()
    try:
        report = run_reads(config, partial(say, console), output)
    except (ValueError, RuntimeError, TimeoutError) as error:
        fail(str(error))
    print_table(report, console)
    console.print(Text(f"written: {', '.join(str(p) for p in write(report, output))}"))


@bench_app.command("placement")
def bench_placement(
    output: Annotated[Path, typer.Option(help="Where the JSON and the plot go.")] = Path(
        "results/placement"
    ),
    rate: Annotated[
        float, typer.Option(min=1, help="Offered requests per second, open loop, per arm.")
    ] = 200.0,
    seconds: Annotated[
        float, typer.Option(callback=positive_seconds, help="Seconds of load per arm.")
    ] = 20.0,
    hint_timeout: Annotated[
        float,
        typer.Option(callback=positive_seconds, help="The hop's registry deadline, s."),
    ] = 0.02,
    upstream: Annotated[
        str,
        typer.Option(
            help="direct: Envoy answers each request itself after the hop (what the hop alone "
            "adds); picker: a picker stand-in and fake engines behind Envoy, llm-d's chain."
        ),
    ] = "direct",
) -> None:
    """Latency a request gains from the placement hop (kvbroker's Envoy ext_proc): Envoy with
    and without it, on loopback, the arms interleaved."""
    from kvbroker_tools.bench.placement import (
        UPSTREAMS,
        PlacementBenchConfig,
        print_table,
        run,
        write,
    )

    console = Console()
    if upstream not in UPSTREAMS:
        fail(f"--upstream must be one of {', '.join(UPSTREAMS)}, not {upstream!r}")
    config = PlacementBenchConfig(
        rate=rate, seconds=seconds, hint_timeout_s=hint_timeout, upstream=upstream
    )
    report = run(config, progress=partial(say, console))
    print_table(report, console)
    paths = write(report, output)
    console.print(Text(f"written: {', '.join(str(p) for p in paths)}"))


@bench_app.command("aiperf")
def bench_aiperf(
    output: Annotated[Path, typer.Option(help="Where AIPerf's artifacts, summary and plot go.")] = (
        Path("results/aiperf")
    ),
    arms: Annotated[
        str,
        typer.Option(
            help="Arms: kvbroker (sessionless turns retained), reuse-off (plain P/D), "
            "session-header (AIPerf sends X-Session-ID)."
        ),
    ] = "kvbroker,reuse-off",
    conversations: Annotated[int, typer.Option(min=1, help="AIPerf's conversations.")] = 6,
    turns: Annotated[int, typer.Option(min=2, help="Turns per conversation.")] = 4,
    concurrency: Annotated[int, typer.Option(min=1, help="Conversations at once.")] = 2,
    input_tokens: Annotated[int, typer.Option(min=1, help="New prompt tokens per turn.")] = 300,
    output_tokens: Annotated[int, typer.Option(min=1, help="Tokens generated per turn.")] = 16,
    seed: Annotated[int, typer.Option(help="AIPerf's --random-seed.")] = 0,
    aiperf: Annotated[
        Path, typer.Option(help="The aiperf executable, in its own venv (make aiperf).")
    ] = Path(".venv-aiperf/bin/aiperf"),
    model: Annotated[Path | None, typer.Option(help="A model directory.")] = None,
    workdir: Annotated[Path, typer.Option(help="Sockets and logs, a folder per stack.")] = Path(
        "/tmp/kvbroker-aiperf"
    ),
) -> None:
    """NVIDIA AIPerf's multi-turn workload at its default session handling (no session
    header) through the router, retaining sessionless turns or not: TTFT of first and later
    turns, later turns READ, prompt tokens P computed. A table, JSON and a plot."""
    plots_or_fail()
    from kvbroker_tools.bench.aiperf import (
        ARMS,
        AiperfConfig,
        plot,
        print_table,
        run_stack_arms,
        write,
    )

    chosen = _names(arms)
    if not chosen or any(a not in ARMS for a in chosen):
        fail(f"--arms {arms!r}: choose from {', '.join(ARMS)}", 2)
    if not aiperf.exists():
        fail(f"{aiperf} does not exist: make aiperf installs AIPerf in .venv-aiperf", 2)
    config = AiperfConfig(
        arms=chosen, conversations=conversations, turns=turns, concurrency=concurrency,
        input_tokens=input_tokens, output_tokens=output_tokens, seed=seed,
        aiperf=aiperf.absolute(),
    )  # fmt: skip
    # The table is wider than the 80 columns of a console that is not a terminal.
    console = Console(width=max(Console().width, 120))
    rows: list[Any] = []
    meta: dict[str, Any] = {}
    for retain in (True, False):
        stack_arms = [ARMS[a] for a in chosen if ARMS[a].retain_sessionless is retain]
        if not stack_arms:
            continue

        async def body(stack: Any, console: Console, stack_arms: Any = stack_arms) -> None:
            rows.extend(await run_stack_arms(stack, stack_arms, config, output, console))
            meta["model_dir"] = str(stack.model_dir)

        # A folder per stack: its logs outlive the next stack's start.
        folder = workdir / ("retaining" if retain else "not-retaining")
        run_with_stack(True, model, folder, body, console, retain_sessionless=retain)
    rows.sort(key=lambda row: chosen.index(row.arm))
    print_table(rows, console)
    written = [write(rows, config, output, meta), plot(rows, output)]
    console.print(Text(f"written: {', '.join(str(p) for p in written)}"))
