"""``kvbroker bench registry``: its options, apart from ``kvbroker_tools.cli.bench`` (which only
registers it) because the command is four runs in one: the load levels with memory and
restart (``--no-load``: those two only), the same on a replica on its own etcd (``--etcd``),
dry-run hints spread over several replicas (``--etcd --replicas``), and dry-run hints by who
answers them: the leader, a follower, a router's own copy (``--etcd --hint-sources``). The
runs are imported only when the command runs."""

from __future__ import annotations

import asyncio
import json
import tempfile
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from kvbroker.cli.options import positive_seconds
from kvbroker.cli.output import fail, say
from kvbroker_tools.cli.plots import plots_or_fail

# The replicas bench's load processes: two leave a 2-core machine's other core to the replicas.
REPLICA_LOAD_PROCESSES = 2


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
        typer.Option(
            help="Run the registry as a replica on its own etcd (load levels and restart)."
        ),
    ] = False,
    replicas: Annotated[
        str,
        typer.Option(
            help="With --etcd: measure dry-run hints spread over each of these numbers of "
            "replicas instead (e.g. 1,3), at the first of --rates and at saturation."
        ),
    ] = "",
    load_processes: Annotated[
        int,
        typer.Option(
            min=1,
            help="With --replicas: the load processes sending the hints (2 leave a 2-core "
            "machine's other core to the replicas; more cores need more to saturate them).",
        ),
    ] = REPLICA_LOAD_PROCESSES,
    hint_sources: Annotated[
        bool,
        typer.Option(
            help="With --etcd: measure dry-run hints answered by the leader, a follower and a "
            "router's own copy, at the first of --rates and at saturation, instead."
        ),
    ] = False,
    load: Annotated[
        bool, typer.Option(help="Run the latency levels (--no-load: memory and restart only).")
    ] = True,
    baseline: Annotated[
        Path | None,
        typer.Option(help="An earlier run's registry.json, drawn beside this run's memory."),
    ] = None,
) -> None:
    """Registry latency and throughput over gRPC, RSS per lease, and restart recovery."""
    plots_or_fail()
    try:
        rate_list = [float(r) for r in rates.split(",")]
        points = [int(p) for p in memory_points.split(",") if p]
        counts = [int(c) for c in replicas.split(",") if c]
    except ValueError:
        fail("--rates, --memory-points and --replicas are comma-separated numbers", 2)
    if counts and (not etcd or min(counts) < 1):
        fail("--replicas needs --etcd, and each count is at least 1", 2)
    if load_processes != REPLICA_LOAD_PROCESSES and not counts:
        fail("--load-processes goes with --replicas", 2)
    if hint_sources and not etcd:
        fail("--hint-sources needs --etcd", 2)
    if counts:
        bench_replicas(counts, rate_list[0], live_leases, seconds, output, load_processes)
        return
    if hint_sources:
        bench_hint_sources(rate_list[0], live_leases, seconds, output)
        return
    from kvbroker_tools.bench.registry_load import run_registry_bench
    from kvbroker_tools.bench.registry_report import write

    console = Console()
    earlier = json.loads(baseline.read_text()) if baseline is not None else None

    async def bench() -> dict[str, Any]:
        progress = partial(say, console)
        if not etcd:
            return await run_registry_bench(
                rate_list, live_leases, points, restart_leases, seconds, progress=progress,
                load=load,
            )  # fmt: skip
        return await on_local_etcd(
            lambda url: run_registry_bench(
                rate_list,
                live_leases,
                [],
                restart_leases,
                seconds,
                progress=progress,
                store=url,
                load=load,
            )
        )

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


def bench_replicas(
    counts: list[int],
    rate: float,
    live_leases: int,
    seconds: float,
    output: Path,
    load_processes: int,
) -> None:
    from kvbroker_tools.bench.registry_load import run_replica_hints
    from kvbroker_tools.bench.registry_report import write_replicas

    console = Console()

    result = asyncio.run(
        on_local_etcd(
            lambda url: run_replica_hints(
                url,
                counts,
                live_leases,
                rate,
                seconds,
                progress=partial(say, console),
                load_processes=load_processes,
            )
        )
    )
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


def bench_hint_sources(rate: float, live_leases: int, seconds: float, output: Path) -> None:
    from kvbroker_tools.bench.hint_sources import run_hint_sources, write_sources

    console = Console()

    result = asyncio.run(
        on_local_etcd(
            lambda url: run_hint_sources(
                url, live_leases, rate, seconds, progress=partial(say, console)
            )
        )
    )
    table = Table(title="dry-run hints by who answers them", title_justify="left")
    columns = ("source", "rpc", "rate/s", "p50 ms", "p99 ms", "done/s", "err", "cores", "/core")
    for column in columns:
        table.add_column(column, justify="right")
    for row in result["rows"]:
        table.add_row(
            row["source"], row["rpc"], f"{row['rate']:.0f}" if row["rate"] else "saturation",
            f"{row['p50_ms']:.3f}", f"{row['p99_ms']:.3f}", f"{row['throughput']:,.0f}",
            str(row["errors"]), f"{row['registry_cpu']:.2f}", f"{row['per_core']:,.0f}",
        )  # fmt: skip
    console.print(table)
    load = ", ".join(f"{x:.1f}" for x in result["load_average"])
    console.print(f"load average at the end: {load}")
    paths = write_sources(result, output)
    console.print(Text(f"written: {', '.join(str(p) for p in paths)}"))


async def on_local_etcd(run: Callable[[str], Awaitable[dict[str, Any]]]) -> dict[str, Any]:
    """``run``'s result, given the URL of an etcd of its own in a temporary folder, stopped
    after it whatever happens."""
    from kvbroker.common.process.local_etcd import LocalEtcd

    with tempfile.TemporaryDirectory(prefix="kvbroker-bench-etcd-") as workdir:
        server = LocalEtcd(Path(workdir))
        await server.start()
        try:
            return await run(server.url)
        finally:
            await server.stop()
