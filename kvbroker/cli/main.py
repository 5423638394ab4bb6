"""``kvbroker``: run each part and manage leases and nodes.

Every flag has an environment variable of the same name (``--registry`` is
``KVBROKER_REGISTRY``), so deployments configure with either.
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import tempfile
from collections.abc import Awaitable, Callable
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, TypeVar, cast

import grpc
import typer
import uvloop
from rich.console import Console
from rich.table import Table

from controlplane.config import RegistryConfig
from kvbroker.cli.output import (
    OutputFormat,
    emit_fields,
    emit_table,
    fail,
    fail_rpc,
    render,
    seconds_left,
    to_dict,
    when,
)
from kvbroker.common import retention_value
from kvbroker.common.clock import to_duration
from kvbroker.common.grpc_client import RegistryEndpoint, open_channel, registry_stub
from kvbroker.common.logging import LogFormat, configure_logging
from kvbroker.v1 import lease_pb2, node_pb2, registry_pb2
from router.config import RouterConfig
from sidecar.config import SidecarConfig

app = typer.Typer(
    name="kvbroker",
    help="Control plane for multi-turn KV reuse in P/D disaggregated vLLM serving.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
registry_app = typer.Typer(help="Run the registry.", no_args_is_help=True)
lease_app = typer.Typer(help="Inspect and manage leases.", no_args_is_help=True)
node_app = typer.Typer(help="Inspect and manage nodes.", no_args_is_help=True)
sidecar_app = typer.Typer(help="Run the agent beside a vLLM server.", no_args_is_help=True)
router_app = typer.Typer(help="Run the KV-aware OpenAI-compatible proxy.", no_args_is_help=True)
app.add_typer(registry_app, name="registry")
app.add_typer(lease_app, name="lease")
app.add_typer(node_app, name="node")
app.add_typer(sidecar_app, name="sidecar")
app.add_typer(router_app, name="router")

RegistryOpt = Annotated[
    str,
    typer.Option(
        "--registry",
        envvar="KVBROKER_REGISTRY",
        help="Registry address HOST:PORT (several, comma-separated, to fail over).",
    ),
]
TokenOpt = Annotated[
    str | None,
    typer.Option("--token", envvar="KVBROKER_TOKEN", help="Bearer token for the registry."),
]
TlsCaOpt = Annotated[
    Path | None,
    typer.Option(
        "--tls-ca", envvar="KVBROKER_TLS_CA", help="CA bundle to verify the registry's TLS."
    ),
]
OutputOpt = Annotated[
    OutputFormat,
    typer.Option("--output", "-o", envvar="KVBROKER_OUTPUT", help="table for people, json."),
]
TimeoutOpt = Annotated[
    float,
    typer.Option("--timeout", envvar="KVBROKER_TIMEOUT", help="Deadline per call, seconds."),
]
TargetArg = Annotated[
    str, typer.Argument(help="Lease id (or conversation id with --conversation).")
]
ConversationFlag = Annotated[
    bool, typer.Option("--conversation", help="TARGET is a conversation id.")
]
LogLevelOpt = Annotated[str, typer.Option(envvar="KVBROKER_LOG_LEVEL")]
LogFormatOpt = Annotated[
    str, typer.Option(envvar="KVBROKER_LOG_FORMAT", help="auto, json or console.")
]
DEFAULT_REGISTRY = "127.0.0.1:7070"

T = TypeVar("T")


def _configure_logging(level: str, fmt: str) -> None:
    if fmt not in ("auto", "json", "console"):
        fail("--log-format is auto, json or console", 2)
    if level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
        fail("--log-level is debug, info, warning, error or critical", 2)
    configure_logging(level, cast(LogFormat, fmt))


def _call(
    registry: str,
    token: str | None,
    tls_ca: Path | None,
    rpc: Callable[[Any], Awaitable[T]],
) -> T:
    """Runs one registry call with clear errors for bad addresses and unreachable servers."""
    try:
        endpoint = RegistryEndpoint.parse(registry, token, tls_ca)
    except ValueError as error:
        fail(str(error), 2)

    async def run() -> T:
        async with open_channel(endpoint) as channel:
            return await rpc(registry_stub(channel))

    try:
        return asyncio.run(run())
    except grpc.aio.AioRpcError as error:
        fail_rpc(error, registry)


# ---------------------------------------------------------------------- registry


@registry_app.command("serve")
def registry_serve(
    listen: Annotated[
        str, typer.Option(envvar="KVBROKER_LISTEN", help="gRPC address HOST:PORT (port 0: any).")
    ] = DEFAULT_REGISTRY,
    metrics_listen: Annotated[
        str | None,
        typer.Option(envvar="KVBROKER_METRICS_LISTEN", help="Prometheus HTTP HOST:PORT."),
    ] = None,
    token: TokenOpt = None,
    tls_cert: Annotated[Path | None, typer.Option(envvar="KVBROKER_TLS_CERT")] = None,
    tls_key: Annotated[Path | None, typer.Option(envvar="KVBROKER_TLS_KEY")] = None,
    tls_client_ca: Annotated[
        Path | None,
        typer.Option(envvar="KVBROKER_TLS_CLIENT_CA", help="Require client certs (mTLS)."),
    ] = None,
    lease_ttl: Annotated[
        float,
        typer.Option(
            envvar="KVBROKER_LEASE_TTL",
            help="Idle TTL, seconds: a lease not renewed this long ends (until one is learned).",
        ),
    ] = RegistryConfig.default_lease_ttl_s,
    learn_idle_ttl: Annotated[
        bool,
        typer.Option(
            envvar="KVBROKER_LEARN_IDLE_TTL",
            help="Learn the idle TTL from the gaps between turns (a bounded high percentile).",
        ),
    ] = RegistryConfig.learn_idle_ttl,
    min_idle_ttl: Annotated[
        float, typer.Option(envvar="KVBROKER_MIN_IDLE_TTL", help="Shortest learned idle TTL.")
    ] = RegistryConfig.min_idle_ttl_s,
    max_idle_ttl: Annotated[
        float, typer.Option(envvar="KVBROKER_MAX_IDLE_TTL", help="Longest learned idle TTL.")
    ] = RegistryConfig.max_idle_ttl_s,
    turn_settle_timeout: Annotated[
        float,
        typer.Option(
            envvar="KVBROKER_TURN_SETTLE_TIMEOUT",
            help="A hint waits this long for the previous turn's retention, seconds.",
        ),
    ] = RegistryConfig.turn_settle_timeout_s,
    max_lease_ttl: Annotated[
        float, typer.Option(envvar="KVBROKER_MAX_LEASE_TTL", help="Longest TTL a call may ask.")
    ] = RegistryConfig.max_lease_ttl_s,
    claim_timeout: Annotated[
        float,
        typer.Option(envvar="KVBROKER_CLAIM_TIMEOUT", help="How long a hint protects a read."),
    ] = RegistryConfig.claim_timeout_s,
    revoke_grace: Annotated[
        float,
        typer.Option(envvar="KVBROKER_REVOKE_GRACE", help="Blocks kept after a revoke, seconds."),
    ] = RegistryConfig.revoke_grace_s,
    heartbeat_interval: Annotated[
        float, typer.Option(envvar="KVBROKER_HEARTBEAT_INTERVAL", help="Sidecar heartbeat.")
    ] = RegistryConfig.heartbeat_interval_s,
    session_ttl: Annotated[
        float,
        typer.Option(envvar="KVBROKER_SESSION_TTL", help="Silence before a node is DOWN."),
    ] = RegistryConfig.session_ttl_s,
    store: Annotated[
        str,
        typer.Option(
            envvar="KVBROKER_STORE",
            help="'memory', or etcd://HOST:PORT[,HOST:PORT] to run as one of several replicas.",
        ),
    ] = "memory",
    advertise: Annotated[
        str | None,
        typer.Option(
            envvar="KVBROKER_ADVERTISE",
            help="HOST:PORT other replicas forward to (default: the listen address).",
        ),
    ] = None,
    election_ttl: Annotated[
        int,
        typer.Option(
            envvar="KVBROKER_ELECTION_TTL",
            help="Seconds before a dead leader is replaced (etcd store).",
        ),
    ] = 2,
    etcd_prefix: Annotated[
        str, typer.Option(envvar="KVBROKER_ETCD_PREFIX", help="Key prefix in etcd.")
    ] = "/kvbroker",
    log_level: LogLevelOpt = "info",
    log_format: LogFormatOpt = "auto",
) -> None:
    """Serve the registry: standalone in memory, or one replica of several sharing etcd.
    Prints one JSON line with its addresses."""
    if (tls_cert is None) != (tls_key is None):
        fail("--tls-cert and --tls-key go together", 2)
    try:
        config = RegistryConfig(
            default_lease_ttl_s=lease_ttl,
            learn_idle_ttl=learn_idle_ttl,
            min_idle_ttl_s=min_idle_ttl,
            max_idle_ttl_s=max_idle_ttl,
            turn_settle_timeout_s=turn_settle_timeout,
            max_lease_ttl_s=max_lease_ttl,
            claim_timeout_s=claim_timeout,
            revoke_grace_s=revoke_grace,
            heartbeat_interval_s=heartbeat_interval,
            session_ttl_s=session_ttl,
        )
    except ValueError as error:
        fail(str(error), 2)
    # Imported here so that the operator commands start fast.
    from controlplane.etcd_store import EtcdEndpoints
    from controlplane.server import ServerOptions, TlsFiles, serve_forever

    if store != "memory":
        try:
            EtcdEndpoints.parse(store)
        except ValueError as error:
            fail(str(error), 2)
    if election_ttl < 1:
        fail("--election-ttl must be at least 1 second", 2)
    _configure_logging(log_level, log_format)
    tls = TlsFiles(tls_cert, tls_key, tls_client_ca) if tls_cert and tls_key else None
    options = ServerOptions(
        listen, metrics_listen, token, tls, config, store, advertise, election_ttl, etcd_prefix
    )
    try:
        # uvloop: the registry's time is mostly event loop and gRPC per-call work, and uvloop
        # answers ~25% more calls a second than asyncio's own loop on the same core.
        uvloop.run(serve_forever(options))
    except OSError as error:
        fail(f"cannot serve on {listen}: {error}")
    except ValueError as error:
        fail(str(error), 2)


# ---------------------------------------------------------------------- sidecar


class Role(StrEnum):
    prefill = "prefill"
    decode = "decode"
    both = "both"


_NODE_ROLES = {
    Role.prefill: node_pb2.NODE_ROLE_PREFILL,
    Role.decode: node_pb2.NODE_ROLE_DECODE,
    Role.both: node_pb2.NODE_ROLE_BOTH,
}


@sidecar_app.command("run")
def sidecar_run(
    engine_url: Annotated[
        str,
        typer.Option(envvar="KVBROKER_ENGINE_URL", help="The vLLM server, http://HOST:PORT."),
    ],
    role: Annotated[Role, typer.Option(envvar="KVBROKER_ROLE", help="The node's P/D role.")],
    node_id: Annotated[
        str,
        typer.Option(envvar="KVBROKER_NODE_ID", help="Unique node name [default: HOST-ROLE]."),
    ] = "",
    listen: Annotated[
        str,
        typer.Option(
            envvar="KVBROKER_SIDECAR_LISTEN",
            help="Local endpoint for the engine [default: unix:/tmp/kvbroker-NODE.sock].",
        ),
    ] = "",
    model: Annotated[
        str, typer.Option(envvar="KVBROKER_MODEL", help="Served model [default: ask the engine].")
    ] = SidecarConfig.model,
    advertise_url: Annotated[
        str,
        typer.Option(envvar="KVBROKER_ADVERTISE_URL", help="URL routers use [default: engine's]."),
    ] = SidecarConfig.advertise_url,
    metrics_listen: Annotated[
        str | None,
        typer.Option(envvar="KVBROKER_METRICS_LISTEN", help="Prometheus HTTP HOST:PORT."),
    ] = None,
    registry: RegistryOpt = DEFAULT_REGISTRY,
    token: TokenOpt = None,
    tls_ca: TlsCaOpt = None,
    log_level: LogLevelOpt = "info",
    log_format: LogFormatOpt = "auto",
) -> None:
    """Register this node, keep its session, and link its engine to the registry."""
    if not engine_url.startswith(("http://", "https://")):
        fail(f"--engine-url {engine_url!r} is not an http(s) URL", 2)
    try:
        endpoint = RegistryEndpoint.parse(registry, token, tls_ca)
    except ValueError as error:
        fail(str(error), 2)
    from sidecar.server import serve_forever as serve_sidecar

    node_id = node_id or f"{socket.gethostname()}-{role.value}"
    listen = listen or f"unix:/tmp/kvbroker-{node_id}.sock"
    _configure_logging(log_level, log_format)
    config = SidecarConfig(
        node_id=node_id,
        role=_NODE_ROLES[role],
        engine_url=engine_url,
        model=model,
        advertise_url=advertise_url,
    )
    try:
        uvloop.run(serve_sidecar(config, endpoint, listen, metrics_listen))
    except OSError as error:
        fail(f"cannot serve the sidecar on {listen}: {error}")


# ---------------------------------------------------------------------- the whole stack


class Switch(StrEnum):
    on = "on"
    off = "off"


@app.command("up")
def up(
    reuse: Annotated[Switch, typer.Option(help="KV reuse across turns.")] = Switch.on,
    model: Annotated[
        Path | None,
        typer.Option(help="A model directory [default: the generated test model]."),
    ] = None,
    workdir: Annotated[Path, typer.Option(help="Sockets and logs of every process.")] = Path(
        "/tmp/kvbroker-up"
    ),
    replicas: Annotated[
        int,
        typer.Option(min=1, help="Registry replicas; more than one also starts an etcd."),
    ] = 1,
) -> None:
    """Start registry, prefill and decode vLLM servers with sidecars, and the router, on this
    machine; print one JSON line when ready; stop everything on Ctrl-C or SIGTERM."""

    async def serve(stack: Any, console: Console) -> None:
        print(json.dumps(stack.describe()), flush=True)
        await asyncio.Event().wait()  # until a signal

    _run_with_stack(reuse is Switch.on, model, workdir, serve, Console(stderr=True), replicas)


def _run_with_stack(
    reuse: bool,
    model: Path | None,
    workdir: Path,
    body: Callable[[Any, Console], Awaitable[None]],
    console: Console | None = None,
    replicas: int = 1,
) -> None:
    """Starts the stack, runs ``body(stack, console)``, and always stops the stack: when the
    body ends, fails, or Ctrl-C / SIGTERM arrives (also while the engines are starting)."""
    from kvbroker.stack import Stack, StackConfig

    console = console or Console()

    async def until_signal(work: Awaitable[None], stop: asyncio.Event) -> None:
        task = asyncio.ensure_future(work)
        waiter = asyncio.ensure_future(stop.wait())
        await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        else:
            task.result()

    async def run() -> None:
        stack = Stack(
            StackConfig(workdir=workdir, model_dir=model, reuse=reuse, registry_replicas=replicas),
            progress=lambda message: console.print(f"[dim]·[/] {message}"),
        )
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        try:
            with console.status("starting the stack"):
                await until_signal(stack.start(), stop)
            if not stop.is_set():
                console.print(f"[dim]·[/] stack ready: router {stack.router_url}")
                await until_signal(body(stack, console), stop)
        finally:
            console.print("[dim]·[/] stopping the stack")
            await stack.stop()

    try:
        asyncio.run(run())
    except (RuntimeError, TimeoutError) as error:
        fail(str(error))


@app.command("demo")
def demo(
    model: Annotated[Path | None, typer.Option(help="A model directory.")] = None,
    workdir: Annotated[Path, typer.Option(help="Sockets and logs.")] = Path("/tmp/kvbroker-demo"),
) -> None:
    """Start the stack and run a scripted agent session with reuse and without."""
    from kvbroker.demo import run_demo

    _run_with_stack(True, model, workdir, run_demo)


bench_app = typer.Typer(help="Benchmarks.", no_args_is_help=True)
app.add_typer(bench_app, name="bench")


@bench_app.command("multiturn")
def bench_multiturn(
    output: Annotated[Path, typer.Option(help="Where records and charts go.")] = Path(
        "results/multiturn"
    ),
    lengths: Annotated[
        str, typer.Option(help="Prompt lengths the conversations grow through.")
    ] = "512,1024,2048,4096,6144",
    conversations: Annotated[int, typer.Option(min=1, help="Conversations per mode.")] = 3,
    max_tokens: Annotated[int, typer.Option(min=1, help="Tokens generated per turn.")] = 32,
    model: Annotated[Path | None, typer.Option(help="A model directory.")] = None,
    workdir: Annotated[Path, typer.Option(help="Sockets and logs.")] = Path("/tmp/kvbroker-bench"),
) -> None:
    """TTFT vs prompt length with reuse ON and OFF in the same run: JSON, charts, a table."""
    try:
        targets = [int(n) for n in lengths.split(",")]
    except ValueError:
        fail(f"--lengths {lengths!r} is not a comma-separated list of token counts", 2)
    from kvbroker.bench.multiturn import plot, print_table, run_sweep, summarise, write_records

    async def body(stack: Any, console: Console) -> None:
        records = await run_sweep(stack, output, targets, conversations, max_tokens, console)
        write_records(records, output)
        rows = summarise(records)
        print_table(rows, console)
        (output / "summary.json").write_text(
            json.dumps({"model_dir": str(stack.model_dir), "rows": rows}, indent=2)
        )
        charts = plot(rows, output, f"TTFT vs prompt length ({stack.config.served_model}, CPU)")
        console.print(
            f"records, summary and charts in {output}: {', '.join(c.name for c in charts)}"
        )

    _run_with_stack(True, model, workdir, body)


@bench_app.command("retention")
def bench_retention(
    output: Annotated[Path, typer.Option(help="Where the table's JSON and the plot go.")] = Path(
        "results/retention"
    ),
    conversations: Annotated[int, typer.Option(min=1, help="Conversations in the trace.")] = 5000,
    fixed_ttl: Annotated[float, typer.Option(min=1, help="The fixed TTL to compare, s.")] = 480,
    seed: Annotated[int, typer.Option(help="Trace seed.")] = 0,
) -> None:
    """Simulate decode retention on an agentic trace: fixed TTL vs kvbroker idle leases."""
    from kvbroker.bench.retention import TraceConfig, report, simulate

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
    seconds: Annotated[float, typer.Option(help="Seconds per load level.")] = 10.0,
    etcd: Annotated[
        bool,
        typer.Option(help="Run the registry as a replica on its own etcd (load levels only)."),
    ] = False,
) -> None:
    """Registry latency and throughput over gRPC, RSS per lease, and restart recovery."""
    try:
        rate_list = [float(r) for r in rates.split(",")]
        points = [int(p) for p in memory_points.split(",") if p]
    except ValueError:
        fail("--rates and --memory-points are comma-separated numbers", 2)
    from kvbroker.bench.registry_load import run_registry_bench, write

    console = Console()

    async def bench() -> dict[str, Any]:
        say = lambda message: console.print(f"[dim]·[/] {message}")  # noqa: E731
        if not etcd:
            return await run_registry_bench(
                rate_list, live_leases, points, restart_leases, seconds, progress=say
            )
        from kvbroker.bench.failover import EtcdServer

        with tempfile.TemporaryDirectory(prefix="kvbroker-bench-etcd-") as workdir:
            server = EtcdServer(Path(workdir))
            await server.start()
            try:
                return await run_registry_bench(
                    rate_list, live_leases, [], 0, seconds, progress=say, store=server.url
                )
            finally:
                await server.child.stop()

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
    console.print(table)
    idle = result["idle"]
    console.print(
        f"idle registry, one hint at a time: p50 {idle['p50_ms']:.2f} ms, "
        f"p99 {idle['p99_ms']:.2f} ms"
    )
    for point in result["memory"]:
        console.print(f"RSS {point['rss_mib']:,.0f} MiB with {point['live_leases']:,} live leases")
    restart = result["restart"]
    if restart:
        console.print(
            f"restart: {restart['recovered']:,} of {restart['leases']:,} leases back in "
            f"{restart['recovery_s']:.2f} s (process start {restart['startup_s']:.2f} s)"
        )
    paths = write(result, output)
    console.print(f"written: {', '.join(str(p) for p in paths)}")


@bench_app.command("failover")
def bench_failover(
    output: Annotated[Path, typer.Option(help="Where failover.json goes.")] = Path(
        "results/failover"
    ),
    seconds: Annotated[float, typer.Option(min=10, help="How long the load and kills last.")] = 120,
    replicas: Annotated[int, typer.Option(min=2, help="Registry replicas.")] = 3,
    conversations: Annotated[int, typer.Option(min=1, help="Concurrent conversations.")] = 8,
    kill_every: Annotated[float, typer.Option(min=2, help="Seconds between kills.")] = 8,
    restart_etcd: Annotated[
        bool, typer.Option(help="Restart etcd once, a third of the way in.")
    ] = True,
    seed: Annotated[int, typer.Option(help="Seed for think times and victims.")] = 7,
) -> None:
    """Soak: replicas on a real etcd killed under a steady load of turns through the router.
    Exits 1 if any request failed, any lease was lost, or any hint or read was stale."""
    from kvbroker.bench.failover import SoakConfig, run_soak, summary_rows, write_report

    console = Console()
    config = SoakConfig(
        replicas=replicas,
        conversations=conversations,
        duration_s=seconds,
        kill_every_s=kill_every,
        restart_etcd=restart_etcd,
        seed=seed,
    )
    try:
        report = asyncio.run(
            run_soak(config, progress=lambda message: console.print(f"[dim]·[/] {message}"))
        )
    except (RuntimeError, TimeoutError) as error:
        fail(str(error))
    table = Table(title="registry replicas under kills", title_justify="left")
    for column, justify in (("figure", "left"), ("value", "right"), ("must be", "right")):
        table.add_column(column, justify=justify)  # type: ignore[arg-type]
    for row in summary_rows(report):
        table.add_row(*row)
    console.print(table)
    for failure in report.failures:
        console.print(f"[red]·[/] {failure}")
    console.print(f"written: {write_report(report, output)}")
    bad = report.failed_requests + report.leases_lost + report.stale_hints + report.stale_reads
    raise typer.Exit(1 if bad else 0)


@bench_app.command("agentic")
def bench_agentic(
    output: Annotated[Path, typer.Option(help="Where records, summary and chart go.")] = Path(
        "results/agentic"
    ),
    arms: Annotated[
        str, typer.Option(help="Arms to run: reuse-off, fixed-ttl, kvbroker.")
    ] = "reuse-off,fixed-ttl,kvbroker",
    sessions: Annotated[int, typer.Option(min=1, help="Agent sessions in the trace.")] = 20,
    concurrency: Annotated[int, typer.Option(min=1, help="Sessions running at once.")] = 6,
    time_scale: Annotated[
        float, typer.Option(min=1, help="Trace seconds per wall-clock second.")
    ] = 12.0,
    max_gap: Annotated[
        float | None,
        typer.Option(min=0.1, help="Longest compressed gap, s [default: 1.2 x the fixed cap]."),
    ] = None,
    mean_turns: Annotated[float, typer.Option(min=2, help="Mean turns per session.")] = 6.0,
    max_turns: Annotated[int, typer.Option(min=1, help="Turns per session at most.")] = 12,
    kv_blocks: Annotated[
        int, typer.Option(min=64, help="KV blocks (128 tokens) per engine; 64 fit 8,192 tokens.")
    ] = 72,
    system_tokens: Annotated[int, typer.Option(min=1, help="System prompt, tokens.")] = 500,
    turn_tokens: Annotated[int, typer.Option(min=1, help="New context per turn, tokens.")] = 250,
    max_tokens: Annotated[int, typer.Option(min=1, help="Tokens generated per turn.")] = 16,
    stall_ms: Annotated[
        float, typer.Option(min=1, help="A decode leg longer than this waited for blocks.")
    ] = 2000.0,
    seed: Annotated[int, typer.Option(help="Trace and text seed.")] = 0,
    model: Annotated[Path | None, typer.Option(help="A model directory.")] = None,
    workdir: Annotated[Path, typer.Option(help="Sockets and logs.")] = Path(
        "/tmp/kvbroker-agentic"
    ),
) -> None:
    """Concurrent agent sessions on a small decode KV cache: no reuse, vLLM's fixed TTL and
    kvbroker on the same trace; TTFT, reuse rate and stalls per arm."""
    from kvbroker.bench.agentic import ARMS, AgenticConfig, print_table, run_agentic, summarise
    from kvbroker.bench.agentic import write as write_agentic

    chosen = tuple(a.strip() for a in arms.split(",") if a.strip())
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
        seed=seed,
        model_dir=model,
        workdir=workdir,
    )
    console = Console()
    try:
        results = asyncio.run(run_agentic(config, console))
    except (RuntimeError, TimeoutError) as error:
        fail(str(error))
    except (KeyboardInterrupt, asyncio.CancelledError):
        fail("interrupted; every stack was stopped", 130)
    print_table([summarise(result) for result in results], stall_ms, console)
    paths = write_agentic(results, config, output)
    console.print(f"written: {', '.join(str(p) for p in paths)}")
    errors = [message for result in results for message in result.errors]
    for message in errors[:5]:
        console.print(f"[red]·[/] {message}", highlight=False)
    if errors:
        fail(f"{len(errors)} sessions ended on a failed request (all in summary.json)")


# ---------------------------------------------------------------------- router


@router_app.command("run")
def router_run(
    listen: Annotated[
        str, typer.Option(envvar="KVBROKER_ROUTER_LISTEN", help="HTTP address HOST:PORT.")
    ] = RouterConfig.listen,
    hint_timeout: Annotated[
        float,
        typer.Option(envvar="KVBROKER_HINT_TIMEOUT", help="Registry deadline per hint, s."),
    ] = RouterConfig.hint_timeout_s,
    registry: RegistryOpt = DEFAULT_REGISTRY,
    token: TokenOpt = None,
    tls_ca: TlsCaOpt = None,
    log_level: LogLevelOpt = "info",
    log_format: LogFormatOpt = "auto",
) -> None:
    """Serve /v1/chat/completions and /v1/completions, routing turns by the registry."""
    config = RouterConfig(listen=listen, hint_timeout_s=hint_timeout)
    try:
        config.host_and_port()
    except ValueError:
        fail(f"--listen {listen!r} is not HOST:PORT", 2)
    try:
        endpoint = RegistryEndpoint.parse(registry, token, tls_ca)
    except ValueError as error:
        fail(str(error), 2)
    from router.server import serve as serve_router

    _configure_logging(log_level, log_format)
    serve_router(endpoint, config)


# ---------------------------------------------------------------------- leases

_STATES: dict[str, lease_pb2.LeaseState] = {
    name.removeprefix("LEASE_STATE_").lower(): cast("lease_pb2.LeaseState", value)
    for name, value in lease_pb2.LeaseState.items()
    if value != lease_pb2.LEASE_STATE_UNSPECIFIED
}


def _state(value: int) -> str:
    return lease_pb2.LeaseState.Name(value).removeprefix("LEASE_STATE_")


def _cause(value: int) -> str:
    return lease_pb2.LeaseEndCause.Name(value).removeprefix("LEASE_END_CAUSE_")


def _live(lease: lease_pb2.Lease) -> bool:
    return lease.state in (lease_pb2.LEASE_STATE_ACTIVE, lease_pb2.LEASE_STATE_CLAIMED)


def _rank_fields(lease: lease_pb2.Lease) -> list[str]:
    """Idle time, chance of a next turn and value (kvbroker.common.retention_value)."""
    if not _live(lease):
        return ["-", "-", "-"]
    rank = retention_value.of_lease(lease)
    return [f"{rank.idle_s:.0f}s/{rank.ttl_s:.0f}s", f"{rank.p_next:.2f}", f"{rank.value:.1f}"]


def _lease_row(lease: lease_pb2.Lease) -> list[str]:
    state = _state(lease.state)
    if lease.end_cause:
        state += f" {_cause(lease.end_cause)}"
    return [
        lease.lease_id,
        lease.conversation_id,
        lease.node_id,
        str(lease.epoch),
        state,
        str(lease.token_count),
        str(sum(len(g.block_ids) for g in lease.handle.remote_block_groups)),
        seconds_left(lease.time_to_live),
        *_rank_fields(lease),
    ]


_LEASE_COLUMNS = [
    "LEASE", "CONVERSATION", "NODE", "EPOCH", "STATE", "TOKENS", "BLOCKS", "TTL",
    "IDLE/TTL", "P(NEXT)", "VALUE",
]  # fmt: skip


def _show_lease(lease: lease_pb2.Lease, output: OutputFormat) -> None:
    def table() -> None:
        handle = lease.handle
        emit_fields(
            f"lease {lease.lease_id}",
            [
                ("conversation", lease.conversation_id),
                (
                    "state",
                    _state(lease.state) + (f" ({lease.end_reason})" if lease.end_reason else ""),
                ),
                ("epoch", str(lease.epoch)),
                ("holder", f"{lease.node_id} (incarnation {lease.node_incarnation})"),
                ("tokens", str(lease.token_count)),
                ("blocks", str(sum(len(g.block_ids) for g in handle.remote_block_groups))),
                ("block hashes", str(len(lease.block_hashes))),
                ("engine", f"{handle.remote_engine_id} request {handle.remote_request_id}"),
                ("side channel", f"{handle.remote_host}:{handle.remote_port}"),
                ("granted", when(lease.grant_time)),
                ("renewed", when(lease.renew_time)),
                ("expires", when(lease.expire_time)),
                ("time left", seconds_left(lease.time_to_live)),
                ("ended", when(lease.end_time)),
                ("end cause", _cause(lease.end_cause) if lease.end_cause else "-"),
                *zip(
                    ("idle / idle TTL", "p(next turn)", "value (tokens saved per block)"),
                    _rank_fields(lease),
                    strict=True,
                ),
            ],
        )

    render(output, to_dict(lease), table)


@lease_app.command("ls")
def lease_ls(
    node: Annotated[str, typer.Option(help="Only leases held by this node.")] = "",
    conversation: Annotated[str, typer.Option(help="Only this conversation's leases.")] = "",
    state: Annotated[
        list[str] | None,
        typer.Option(help=f"Only these states ({', '.join(_STATES)}); default live ones."),
    ] = None,
    all_states: Annotated[bool, typer.Option("--all", help="Every state.")] = False,
    limit: Annotated[int, typer.Option(min=1, help="At most this many leases.")] = 1000,
    registry: RegistryOpt = DEFAULT_REGISTRY,
    token: TokenOpt = None,
    tls_ca: TlsCaOpt = None,
    output: OutputOpt = OutputFormat.table,
    timeout: TimeoutOpt = 5.0,
) -> None:
    """List leases (live ones unless --state or --all)."""
    unknown = [s for s in state or [] if s.lower() not in _STATES]
    if unknown:
        fail(f"unknown state {unknown[0]!r}; choose from {', '.join(_STATES)}", 2)
    states = list(_STATES.values()) if all_states else [_STATES[s.lower()] for s in state or []]

    async def rpc(stub: Any) -> list[lease_pb2.Lease]:
        leases: list[lease_pb2.Lease] = []
        page_token = ""
        while len(leases) < limit:
            request = registry_pb2.ListLeasesRequest(
                node_id=node,
                conversation_id=conversation,
                states=states,
                page_size=min(limit - len(leases), 1000),
                page_token=page_token,
            )
            response = await stub.ListLeases(request, timeout=timeout)
            leases.extend(response.leases)
            page_token = response.next_page_token
            if not page_token:
                break
        return leases

    leases = _call(registry, token, tls_ca, rpc)
    render(
        output,
        [to_dict(lease) for lease in leases],
        lambda: emit_table(
            "leases", _LEASE_COLUMNS, [_lease_row(lease) for lease in leases], "no leases"
        ),
    )


@lease_app.command("show")
def lease_show(
    lease_id: Annotated[str, typer.Argument(help="The lease id.")],
    registry: RegistryOpt = DEFAULT_REGISTRY,
    token: TokenOpt = None,
    tls_ca: TlsCaOpt = None,
    output: OutputOpt = OutputFormat.table,
    timeout: TimeoutOpt = 5.0,
) -> None:
    """Show one lease in full."""

    async def rpc(stub: Any) -> lease_pb2.Lease:
        response = await stub.GetLease(
            registry_pb2.GetLeaseRequest(lease_id=lease_id), timeout=timeout
        )
        return response.lease  # type: ignore[no-any-return]

    _show_lease(_call(registry, token, tls_ca, rpc), output)


@lease_app.command("renew")
def lease_renew(
    target: TargetArg,
    conversation: ConversationFlag = False,
    ttl: Annotated[
        float, typer.Option(min=0, help="New time to live, seconds (0: registry default).")
    ] = 0.0,
    registry: RegistryOpt = DEFAULT_REGISTRY,
    token: TokenOpt = None,
    tls_ca: TlsCaOpt = None,
    output: OutputOpt = OutputFormat.table,
    timeout: TimeoutOpt = 5.0,
) -> None:
    """Extend a live lease."""
    request = registry_pb2.RenewLeaseRequest(time_to_live=to_duration(ttl) if ttl else None)
    if conversation:
        request.conversation_id = target
    else:
        request.lease_id = target

    async def rpc(stub: Any) -> lease_pb2.Lease:
        return (await stub.RenewLease(request, timeout=timeout)).lease  # type: ignore[no-any-return]

    _show_lease(_call(registry, token, tls_ca, rpc), output)


@lease_app.command("revoke")
def lease_revoke(
    target: TargetArg,
    conversation: ConversationFlag = False,
    reason: Annotated[str, typer.Option(help="Recorded on the lease.")] = "revoked by operator",
    registry: RegistryOpt = DEFAULT_REGISTRY,
    token: TokenOpt = None,
    tls_ca: TlsCaOpt = None,
    output: OutputOpt = OutputFormat.table,
    timeout: TimeoutOpt = 5.0,
) -> None:
    """End a lease; its holder frees the blocks once any in-flight read is done."""
    request = registry_pb2.RevokeLeaseRequest(reason=reason)
    if conversation:
        request.conversation_id = target
    else:
        request.lease_id = target

    async def rpc(stub: Any) -> lease_pb2.Lease:
        return (await stub.RevokeLease(request, timeout=timeout)).lease  # type: ignore[no-any-return]

    _show_lease(_call(registry, token, tls_ca, rpc), output)


# ---------------------------------------------------------------------- nodes


def _role(value: int) -> str:
    return node_pb2.NodeRole.Name(value).removeprefix("NODE_ROLE_")


def _node_state(value: int) -> str:
    return node_pb2.NodeState.Name(value).removeprefix("NODE_STATE_")


_ROLES = {
    "prefill": node_pb2.NODE_ROLE_PREFILL,
    "decode": node_pb2.NODE_ROLE_DECODE,
    "both": node_pb2.NODE_ROLE_BOTH,
}


def _retained(node: node_pb2.Node) -> str:
    """Retained blocks over capacity, with the share and the bytes."""
    capacity = node.spec.capacity_blocks
    share = f" {100 * node.retained_blocks / capacity:.0f}%" if capacity else ""
    mib = node.retained_blocks * node.spec.bytes_per_block / 2**20
    return f"{node.retained_blocks}/{capacity}{share} {mib:.0f}MiB"


def _node_rows(nodes: list[node_pb2.Node]) -> list[list[str]]:
    return [
        [
            n.spec.node_id,
            _role(n.spec.role),
            _node_state(n.state),
            n.spec.model,
            n.spec.http_base_url,
            f"{n.spec.side_channel_host}:{n.spec.side_channel_port}",
            str(n.live_leases),
            _retained(n),
            str(n.spec.retention_budget_blocks or "-"),
            str(n.load.running_requests + n.load.waiting_requests),
            when(n.last_heartbeat_time),
        ]
        for n in nodes
    ]


_NODE_COLUMNS = [
    "NODE",
    "ROLE",
    "STATE",
    "MODEL",
    "HTTP",
    "NIXL",
    "LEASES",
    "RETAINED",
    "BUDGET",
    "QUEUE",
    "HEARTBEAT",
]


@node_app.command("ls")
def node_ls(
    role: Annotated[str, typer.Option(help="Only prefill, decode or both nodes.")] = "",
    registry: RegistryOpt = DEFAULT_REGISTRY,
    token: TokenOpt = None,
    tls_ca: TlsCaOpt = None,
    output: OutputOpt = OutputFormat.table,
    timeout: TimeoutOpt = 5.0,
) -> None:
    """List registered nodes."""
    if role and role not in _ROLES:
        fail(f"unknown role {role!r}; choose from {', '.join(_ROLES)}", 2)

    async def rpc(stub: Any) -> list[node_pb2.Node]:
        request = registry_pb2.ListNodesRequest(
            role=_ROLES.get(role, node_pb2.NODE_ROLE_UNSPECIFIED)
        )
        return list((await stub.ListNodes(request, timeout=timeout)).nodes)

    nodes = _call(registry, token, tls_ca, rpc)
    render(
        output,
        [to_dict(n) for n in nodes],
        lambda: emit_table("nodes", _NODE_COLUMNS, _node_rows(nodes), "no nodes registered"),
    )


@node_app.command("drain")
def node_drain(
    node_id: Annotated[str, typer.Argument(help="The node to drain.")],
    registry: RegistryOpt = DEFAULT_REGISTRY,
    token: TokenOpt = None,
    tls_ca: TlsCaOpt = None,
    output: OutputOpt = OutputFormat.table,
    timeout: TimeoutOpt = 5.0,
) -> None:
    """Stop routing new turns to a node; its leases can still be read until they end."""

    async def rpc(stub: Any) -> node_pb2.Node:
        request = registry_pb2.DrainNodeRequest(node_id=node_id)
        return (await stub.DrainNode(request, timeout=timeout)).node  # type: ignore[no-any-return]

    node = _call(registry, token, tls_ca, rpc)
    render(
        output, to_dict(node), lambda: emit_table("nodes", _NODE_COLUMNS, _node_rows([node]), "")
    )


# ---------------------------------------------------------------------- hints


@app.command("hint")
def hint(
    conversation: Annotated[str, typer.Argument(help="Conversation (session) id.")],
    model: Annotated[str, typer.Option(help="Served model name (default: any).")] = "",
    claim: Annotated[
        bool,
        typer.Option(help="Claim the lease as a router would (default: look only)."),
    ] = False,
    registry: RegistryOpt = DEFAULT_REGISTRY,
    token: TokenOpt = None,
    tls_ca: TlsCaOpt = None,
    output: OutputOpt = OutputFormat.table,
    timeout: TimeoutOpt = 5.0,
) -> None:
    """Where the conversation's next turn would go, and whether it would reuse KV."""

    async def rpc(stub: Any) -> registry_pb2.RoutingHint:
        request = registry_pb2.GetRoutingHintRequest(
            conversation_id=conversation, model=model, dry_run=not claim
        )
        return (await stub.GetRoutingHint(request, timeout=timeout)).hint  # type: ignore[no-any-return]

    result = _call(registry, token, tls_ca, rpc)

    def table() -> None:
        fields = [
            (
                "decision",
                registry_pb2.HintDecision.Name(result.decision).removeprefix("HINT_DECISION_"),
            ),
            ("reason", result.reason),
            (
                "consistency",
                registry_pb2.HintConsistency.Name(result.consistency).removeprefix(
                    "HINT_CONSISTENCY_"
                ),
            ),
            ("prefill", f"{result.prefill.node_id} {result.prefill.http_base_url}"),
            ("decode", f"{result.decode.node_id} {result.decode.http_base_url}"),
        ]
        if result.HasField("lease"):
            fields += [
                ("lease", f"{result.lease.lease_id} (epoch {result.lease.epoch})"),
                ("tokens", str(result.lease.token_count)),
            ]
        emit_fields(f"hint for {conversation}", fields)

    render(output, to_dict(result), table)
