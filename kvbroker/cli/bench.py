"""``kvbroker bench``: the benchmarks. Each imports its code only when it runs, so that the
operator commands start fast; the retention simulation's module is light, so its flags take
their defaults from TraceConfig."""

from __future__ import annotations

import asyncio
import json
import tempfile
from functools import partial
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from kvbroker.bench.plotting import PlottingUnavailable, ready_plotting
from kvbroker.bench.retention import TraceConfig
from kvbroker.cli.bench_fleet import bench_fleet
from kvbroker.cli.options import finite, positive_seconds, seconds
from kvbroker.cli.output import fail, say
from kvbroker.cli.stack import Switch, run_with_stack

bench_app = typer.Typer(help="Benchmarks.", no_args_is_help=True)
bench_app.command("fleet")(bench_fleet)


def _plots_or_fail() -> None:
    """Stops a benchmark that ends in a plot before it runs when matplotlib (the bench extra)
    is missing, rather than after minutes of work."""
    try:
        ready_plotting()
    except PlottingUnavailable as error:
        fail(str(error))


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
    _plots_or_fail()
    from kvbroker.bench.multiturn import (
        MultiturnConfig,
        plot,
        print_table,
        run_multiturn,
        summarise,
        write,
    )
    from kvbroker.bench.routers import arms_of
    from kvbroker.stack import StackConfig

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
    _plots_or_fail()
    from kvbroker.bench.retention import report, simulate

    config = TraceConfig(conversations=conversations, seed=seed)
    baseline, sweep = simulate(config, fixed_ttl)
    report(baseline, sweep, output, Console())


@bench_app.command("registry")
def bench_registry(
    output: Annotated[Path, typer.Option(help="Where the JSON and the plot go.")] = Path(
        "results/registry"
    ),
    rates: Annotated[str, typer.Option(help="Offered turns per second.")] = "250,500,1000",
    live_leases: Annotated[int, typer.Option(help="Live leases during the load.")] = 10_000,
    memory_points: Annotated[
        str, typer.Option(help="Live-lease counts at which RSS is read.")
    ] = "100000,250000,500000,1000000",
    restart_leases: Annotated[int, typer.Option(help="Leases replayed after restart.")] = 100_000,
    seconds: Annotated[
        float, typer.Option(callback=positive_seconds, help="Seconds per load level.")
    ] = 10.0,
    etcd: Annotated[
        bool,
        typer.Option(help="Run the registry as a replica on its own etcd (load levels only)."),
    ] = False,
    replicas: Annotated[
        str,
        typer.Option(
            help="With --etcd: measure dry-run hints spread over each of these numbers of "
            "replicas instead (e.g. 1,3), at the first of --rates and at saturation."
        ),
    ] = "",
    load: Annotated[
        bool, typer.Option(help="Run the latency levels (--no-load: memory and restart only).")
    ] = True,
    baseline: Annotated[
        Path | None,
        typer.Option(help="An earlier run's registry.json, drawn beside this run's memory."),
    ] = None,
) -> None:
    """Registry latency and throughput over gRPC, RSS per lease, and restart recovery."""
    _plots_or_fail()
    try:
        rate_list = [float(r) for r in rates.split(",")]
        points = [int(p) for p in memory_points.split(",") if p]
        counts = [int(c) for c in replicas.split(",") if c]
    except ValueError:
        fail("--rates, --memory-points and --replicas are comma-separated numbers", 2)
    if counts and (not etcd or min(counts) < 1):
        fail("--replicas needs --etcd, and each count is at least 1", 2)
    if counts:
        _bench_replicas(counts, rate_list[0], live_leases, seconds, output)
        return
    from kvbroker.bench.registry_load import run_registry_bench
    from kvbroker.bench.registry_report import write

    console = Console()
    earlier = json.loads(baseline.read_text()) if baseline is not None else None

    async def bench() -> dict[str, Any]:
        progress = partial(say, console)
        if not etcd:
            return await run_registry_bench(
                rate_list, live_leases, points, restart_leases, seconds, progress=progress,
                load=load,
            )  # fmt: skip
        from kvbroker.common.process.local_etcd import LocalEtcd

        with tempfile.TemporaryDirectory(prefix="kvbroker-bench-etcd-") as workdir:
            server = LocalEtcd(Path(workdir))
            await server.start()
            try:
                return await run_registry_bench(
                    rate_list, live_leases, [], 0, seconds, progress=progress, store=server.url
                )
            finally:
                await server.stop()

    result = asyncio.run(bench())
    table = Table(title="registry under load", title_justify="left")
    # Short headers: a console that is not a terminal is 80 columns wide.
    columns = ("rpc", "rate/s", "p50 ms", "p99 ms", "p999 ms", "done/s", "errors", "cores")
    for column in columns:
        table.add_column(column, justify="right")
    for row in result["load"]:
        table.add_row(
            row["rpc"], f"{row['rate']:.0f}" if row["rate"] else "saturation",
            f"{row['p50_ms']:.2f}", f"{row['p99_ms']:.2f}", f"{row['p999_ms']:.2f}",
            f"{row['throughput']:,.0f}", str(row["errors"]), f"{row['registry_cpu']:.2f}",
        )  # fmt: skip
    if result["load"]:
        console.print(table)
    idle = result["idle"]
    if idle:
        console.print(
            f"idle registry, one hint at a time: p50 {idle['p50_ms']:.2f} ms, "
            f"p99 {idle['p99_ms']:.2f} ms"
        )
    for point in result["memory"]:
        console.print(f"RSS {point['rss_mib']:,.0f} MiB with {point['live_leases']:,} live leases")
    for point in result["prefix"]:
        console.print(
            f"prefix index at {point['live_leases']:,} live leases: MatchPrefix "
            f"p50 {point['p50_ms']:.2f} ms, p99 {point['p99_ms']:.2f} ms, "
            f"{point['throughput']:,.0f}/s on {point['registry_cpu']:.2f} cores "
            f"({point['hit_share']:.0%} hits)"
        )
    restart = result["restart"]
    if restart:
        console.print(
            f"restart: {restart['recovered']:,} of {restart['leases']:,} leases back in "
            f"{restart['recovery_s']:.2f} s (process start {restart['startup_s']:.2f} s)"
        )
    paths = write(result, output, earlier)
    console.print(Text(f"written: {', '.join(str(p) for p in paths)}"))


def _bench_replicas(
    counts: list[int], rate: float, live_leases: int, seconds: float, output: Path
) -> None:
    from kvbroker.bench.registry_load import run_replica_hints
    from kvbroker.bench.registry_report import write_replicas
    from kvbroker.common.process.local_etcd import LocalEtcd

    console = Console()

    async def bench() -> dict[str, Any]:
        with tempfile.TemporaryDirectory(prefix="kvbroker-bench-etcd-") as workdir:
            server = LocalEtcd(Path(workdir))
            await server.start()
            try:
                return await run_replica_hints(
                    server.url, counts, live_leases, rate, seconds, progress=partial(say, console)
                )
            finally:
                await server.stop()

    result = asyncio.run(bench())
    table = Table(title="dry-run hints over registry replicas", title_justify="left")
    columns = ("replicas", "rpc", "rate/s", "p50 ms", "p99 ms", "done/s", "errors", "cores")
    for column in columns:
        table.add_column(column, justify="right")
    for configuration in result["configurations"]:
        for row in configuration["load"]:
            table.add_row(
                str(configuration["replicas"]), row["rpc"],
                f"{row['rate']:.0f}" if row["rate"] else "saturation",
                f"{row['p50_ms']:.2f}", f"{row['p99_ms']:.2f}", f"{row['throughput']:,.0f}",
                str(row["errors"]), f"{row['registry_cpu']:.2f}",
            )  # fmt: skip
    console.print(table)
    paths = write_replicas(result, output)
    console.print(Text(f"written: {', '.join(str(p) for p in paths)}"))


@bench_app.command("failover")
def bench_failover(
    output: Annotated[Path, typer.Option(help="Where failover.json goes.")] = Path(
        "results/failover"
    ),
    seconds: Annotated[
        float, typer.Option(callback=seconds, min=10, help="How long the load and kills last.")
    ] = 120,
    replicas: Annotated[int, typer.Option(min=2, help="Registry replicas.")] = 3,
    conversations: Annotated[int, typer.Option(min=1, help="Concurrent conversations.")] = 8,
    kill_every: Annotated[
        float, typer.Option(callback=seconds, min=2, help="Seconds between kills.")
    ] = 8,
    restart_etcd: Annotated[
        bool, typer.Option(help="Restart etcd once, a third of the way in.")
    ] = True,
    hang_etcd: Annotated[
        float,
        typer.Option(
            callback=seconds,
            min=0,
            help="Hang etcd (SIGSTOP) this long once, two thirds of the way in; 0: never.",
        ),
    ] = 8,
    seed: Annotated[int, typer.Option(help="Seed for think times and victims.")] = 7,
) -> None:
    """Soak: replicas on a real etcd killed under a steady load of turns through the router.
    Exits 1 if any request failed, any lease was lost, any hint or read was stale,
    or a replica did not lead or follow again soon after etcd hung."""
    from kvbroker.bench.failover import SoakConfig, run_soak
    from kvbroker.bench.failover_report import summary_rows, write_report

    console = Console()
    config = SoakConfig(
        replicas=replicas,
        conversations=conversations,
        duration_s=seconds,
        kill_every_s=kill_every,
        restart_etcd=restart_etcd,
        hang_etcd_s=hang_etcd,
        seed=seed,
    )
    try:
        report = asyncio.run(run_soak(config, progress=partial(say, console)))
    except (RuntimeError, TimeoutError) as error:
        fail(str(error))
    table = Table(title="registry replicas under kills", title_justify="left")
    for column, justify in (("figure", "left"), ("value", "right"), ("must be", "right")):
        table.add_column(column, justify=justify)  # type: ignore[arg-type]
    for row in summary_rows(report):
        table.add_row(*row)
    console.print(table)
    for failure in report.failures:
        say(console, failure, "red")
    console.print(Text(f"written: {write_report(report, output)}"))
    bad = (
        report.failed_requests
        + report.leases_lost
        + report.stale_hints
        + report.stale_reads
        + report.replicas_stuck
    )
    raise typer.Exit(1 if bad else 0)


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
    _plots_or_fail()
    from kvbroker.bench.agentic import run_agentic
    from kvbroker.bench.agentic_config import ARMS, AgenticConfig
    from kvbroker.bench.agentic_forks import print_forks, summarise_group, write_forks
    from kvbroker.bench.agentic_report import print_table, settings, summarise
    from kvbroker.bench.agentic_report import write as write_agentic

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
    from kvbroker.bench.nixl_layout import ReadConfig, parse_shapes
    from kvbroker.bench.nixl_read import print_table, run_reads, tokens_list, write

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
    from kvbroker.bench.placement import (
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
    _plots_or_fail()
    from kvbroker.bench.aiperf import ARMS, AiperfConfig, plot, print_table, run_stack_arms, write

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
