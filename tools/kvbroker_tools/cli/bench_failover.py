"""``kvbroker bench failover``: the soak of registry replicas killed under load, apart from
``kvbroker_tools.cli.bench`` (which only registers it); its run is imported only when the
command runs."""

from __future__ import annotations

import asyncio
from functools import partial
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from kvbroker.cli.options import seconds
from kvbroker.cli.output import fail, say


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
    from kvbroker_tools.bench.failover import SoakConfig, run_soak
    from kvbroker_tools.bench.failover_report import summary_rows, write_report

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
