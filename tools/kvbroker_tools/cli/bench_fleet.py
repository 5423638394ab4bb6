"""``kvbroker bench fleet``: its options, apart from ``kvbroker_tools.cli.bench`` (which only
registers it) so that file stays a list of the other benchmarks; the run is imported only
when the command runs."""

from __future__ import annotations

import asyncio
from functools import partial
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.text import Text

from kvbroker.cli.options import positive_seconds
from kvbroker.cli.output import fail, say
from kvbroker_tools.cli.plots import plots_or_fail


def bench_fleet(
    output: Annotated[Path, typer.Option(help="Where fleet.json and fleet.png go.")] = Path(
        "results/fleet"
    ),
    sizes: Annotated[
        str, typer.Option(help="Fleet sizes, nodes (half prefill, half decode).")
    ] = "10,100,1000",
    rate: Annotated[float, typer.Option(min=1, help="Offered turns per second.")] = 300.0,
    seconds: Annotated[
        float, typer.Option(callback=positive_seconds, help="Seconds of turns per size.")
    ] = 10.0,
    replicas: Annotated[int, typer.Option(min=1, help="Registry replicas on the etcd.")] = 2,
    per_node: Annotated[
        int, typer.Option(min=1, help="Live conversations per node (100 on 1,000: 100k).")
    ] = 100,
    seed: Annotated[int, typer.Option(help="Trace seed.")] = 0,
) -> None:
    """The control plane at fleet scale: registry replicas on etcd serve simulated sidecars and
    routers for fleets of each size, turns of a generated agentic trace; hint latency, hints
    per registry core, retained-KV hit rate, registry CPU and RSS. A table, JSON, a plot."""
    plots_or_fail()
    try:
        size_list = tuple(int(n) for n in sizes.split(","))
    except ValueError:
        fail(f"--sizes {sizes!r}: comma-separated numbers of nodes", 2)
    if any(n < 2 for n in size_list):
        fail("a fleet needs 2 nodes at least (a prefill and a decode node)", 2)
    from kvbroker_tools.bench.fleet import run_fleet
    from kvbroker_tools.bench.fleet_config import FleetConfig
    from kvbroker_tools.bench.fleet_report import print_table, write
    from kvbroker_tools.bench.fleet_trace import TraceParams

    config = FleetConfig(sizes=size_list, rate=rate, seconds=seconds, replicas=replicas,
                         trace=TraceParams(conversations_per_node=per_node, seed=seed))  # fmt: skip
    # The table is wider than the 80 columns of a console that is not a terminal.
    console = Console(width=max(Console().width, 150))
    try:
        points = asyncio.run(run_fleet(config, partial(say, console)))
    except (RuntimeError, TimeoutError) as error:  # etcd or a replica did not start or lead
        fail(str(error))
    print_table(points, console)
    console.print(Text(f"written: {', '.join(str(p) for p in write(points, config, output))}"))
