"""``kvbroker node``: list, show and drain nodes."""

from __future__ import annotations

import asyncio
import time
from typing import Annotated, Any, cast

import grpc
import typer
from rich.console import Console

from kvbroker.cli.client import call_registry, registry_flags
from kvbroker.cli.options import (
    DEFAULT_TIMEOUT_S,
    OutputOpt,
    TimeoutOpt,
    positive_seconds,
)
from kvbroker.cli.output import (
    EXIT_TIMED_OUT,
    OutputFormat,
    emit_table,
    fail,
    render,
    say,
    to_dict,
    when,
)
from kvbroker.common.client.grpc_client import RegistryEndpoint, replica_away
from kvbroker.common.rules.costs import Costs, default_costs, device_of
from kvbroker.common.rules.labels import by_lower_label, label
from kvbroker.v1 import node_pb2, registry_pb2

node_app = typer.Typer(help="Inspect and manage nodes.", no_args_is_help=True)

_ROLES = by_lower_label(node_pb2.NodeRole)


def _retained(node: node_pb2.Node) -> str:
    """Retained blocks over capacity, with the share and the bytes."""
    capacity = node.spec.capacity_blocks
    share = f" {100 * node.retained_blocks / capacity:.0f}%" if capacity else ""
    mib = node.retained_blocks * node.spec.bytes_per_block / 2**20
    return f"{node.retained_blocks}/{capacity}{share} {mib:.0f}MiB"


def _correction(node: node_pb2.Node) -> str:
    """The live correction of its prefill and read costs, as factors (``-``: not reported)."""
    if not node.HasField("cost_correction"):
        return "-"
    return f"x{node.cost_correction.prefill:.2f}/x{node.cost_correction.read:.2f}"


def _node_rows(nodes: list[node_pb2.Node]) -> list[list[str]]:
    return [
        [
            n.spec.node_id,
            label(node_pb2.NodeRole, n.spec.role),
            label(node_pb2.NodeState, n.state),
            n.spec.model,
            n.spec.http_base_url,
            f"{n.spec.side_channel_host}:{n.spec.side_channel_port}",
            str(n.live_leases),
            _retained(n),
            str(n.spec.retention_budget_blocks or "-"),
            str(n.load.running_requests + n.load.waiting_requests),
            f"{n.cost.prefill_us_per_token:.0f}" if n.cost.HasField("calibrated_time") else "-",
            _correction(n),
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
    "µs/TOKEN",
    "LIVE P/R",
    "HEARTBEAT",
]


@node_app.command("ls")
@registry_flags
def node_ls(
    role: Annotated[str, typer.Option(help="Only prefill, decode or both nodes.")] = "",
    output: OutputOpt = OutputFormat.table,
    timeout: TimeoutOpt = DEFAULT_TIMEOUT_S,
    *,
    endpoint: RegistryEndpoint,
) -> None:
    """List registered nodes."""
    if role and role not in _ROLES:
        fail(f"unknown role {role!r}; choose from {', '.join(_ROLES)}", 2)
    wanted = cast("node_pb2.NodeRole", _ROLES.get(role, node_pb2.NODE_ROLE_UNSPECIFIED))

    async def rpc(stub: Any) -> list[node_pb2.Node]:
        request = registry_pb2.ListNodesRequest(role=wanted)
        return list((await stub.ListNodes(request, timeout=timeout)).nodes)

    nodes = call_registry(endpoint, rpc)
    render(
        output,
        [to_dict(n) for n in nodes],
        lambda: emit_table("nodes", _NODE_COLUMNS, _node_rows(nodes), "no nodes registered"),
    )


def _cost_rows(node: node_pb2.Node) -> list[list[str]]:
    """Each cost figure as calibrated (or the default), and the live factor on it."""
    calibrated = node.cost.HasField("calibrated_time")
    costs = Costs.of(node.cost) if calibrated else default_costs(device_of(node.spec.kv_device))
    source = when(node.cost.calibrated_time) if calibrated else "default"
    factors = node.cost_correction
    figures = [
        ("prefill fixed ms", costs.prefill_fixed_ms, factors.prefill, factors.prefill_samples),
        ("prefill µs/token", costs.prefill_us_per_token, factors.prefill, factors.prefill_samples),
        (
            "prefill ns/token·context",
            costs.prefill_ns_per_token_context,
            factors.prefill,
            factors.prefill_samples,
        ),
        ("read fixed ms", costs.read_fixed_ms, factors.read, factors.read_samples),
        ("read µs/block", costs.read_us_per_block, factors.read, factors.read_samples),
    ]
    live = node.HasField("cost_correction")
    return [
        [name, f"{value:g}", source, f"x{factor:.2f} ({samples})" if live else "-"]
        for name, value, factor, samples in figures
    ]


@node_app.command("get")
@registry_flags
def node_get(
    node_id: Annotated[str, typer.Argument(help="The node to show.")],
    output: OutputOpt = OutputFormat.table,
    timeout: TimeoutOpt = DEFAULT_TIMEOUT_S,
    *,
    endpoint: RegistryEndpoint,
) -> None:
    """Show one node: its row of `node ls`, and its costs as calibrated with the live
    correction the planner scales them by (and how many heartbeats of work moved it)."""

    async def rpc(stub: Any) -> node_pb2.Node:
        request = registry_pb2.GetNodeRequest(node_id=node_id)
        return (await stub.GetNode(request, timeout=timeout)).node  # type: ignore[no-any-return]

    node = call_registry(endpoint, rpc)

    def tables() -> None:
        emit_table("nodes", _NODE_COLUMNS, _node_rows([node]), "")
        columns = ["FIGURE", "VALUE", "CALIBRATED", "LIVE FACTOR (HEARTBEATS)"]
        emit_table(f"costs of {node_id}", columns, _cost_rows(node), "")

    render(output, to_dict(node), tables)


# With --wait and no --timeout: the whole drain's limit, under the decode pod's 120 s
# terminationGracePeriodSeconds (claims last up to the registry's 30 s --claim-timeout).
DEFAULT_DRAIN_WAIT_S = 110.0
# How often --wait asks the registry.
DRAIN_POLL_S = 0.5


def _drain_progress(node: node_pb2.Node) -> str:
    state = label(node_pb2.NodeState, node.state)
    return (
        f"{node.spec.node_id}: {state}, {node.live_leases} live leases, "
        f"{node.load.running_requests} running and {node.load.waiting_requests} waiting requests"
    )


async def _wait_drained(
    stub: Any, node_id: str, limit: float, call_timeout: float, console: Console
) -> node_pb2.Node:
    """Drains the node, then asks until the registry says it is drained (``Node.drained``),
    printing each change of its figures; exits 4 when ``limit`` passes first, 1 when the node
    stops draining (registered again as a new incarnation). A registry that cannot be reached
    for a moment (a leader changing) is asked again until the limit."""
    deadline = time.monotonic() + limit
    request = registry_pb2.DrainNodeRequest(node_id=node_id)
    node = (await stub.DrainNode(request, timeout=call_timeout)).node
    shown = ""
    while True:
        if node.drained:
            say(console, f"{node_id}: drained", mark="green")
            return node  # type: ignore[no-any-return]
        if node.state == node_pb2.NODE_STATE_DOWN:
            say(console, f"{node_id}: DOWN, its leases withdrawn: nothing left to drain")
            return node  # type: ignore[no-any-return]
        if node.state != node_pb2.NODE_STATE_DRAINING:
            state = label(node_pb2.NodeState, node.state)
            fail(f"node {node_id!r} is {state}, no longer draining (it registered again)")
        progress = _drain_progress(node)
        if progress != shown:
            say(console, progress)
            shown = progress
        left = deadline - time.monotonic()
        if left <= 0:
            fail(f"node {node_id!r} not drained within {limit:g}s: {progress}", EXIT_TIMED_OUT)
        await asyncio.sleep(min(DRAIN_POLL_S, left))
        try:
            get = registry_pb2.GetNodeRequest(node_id=node_id)
            node = (await stub.GetNode(get, timeout=min(call_timeout, left + 0.1))).node
        except grpc.aio.AioRpcError as error:
            if not replica_away(error) or time.monotonic() >= deadline:
                raise


@node_app.command("drain")
@registry_flags
def node_drain(
    node_id: Annotated[str, typer.Argument(help="The node to drain.")],
    wait: Annotated[
        bool,
        typer.Option(
            "--wait",
            help="Wait until the node is drained: no live lease, no request running (exit 4 "
            "if --timeout passes first).",
        ),
    ] = False,
    output: OutputOpt = OutputFormat.table,
    timeout: Annotated[
        float | None,
        typer.Option(
            "--timeout",
            envvar="KVBROKER_TIMEOUT",
            callback=positive_seconds,
            help=f"Deadline per call, s ({DEFAULT_TIMEOUT_S:g}); with --wait, for the whole "
            f"drain ({DEFAULT_DRAIN_WAIT_S:g}).",
        ),
    ] = None,
    *,
    endpoint: RegistryEndpoint,
) -> None:
    """Stop routing new turns to a node and end its unclaimed leases; reads in flight finish.
    With --wait, return once it is drained (a decode pod's preStop hook)."""
    call_timeout = min(timeout or DEFAULT_TIMEOUT_S, DEFAULT_TIMEOUT_S)

    async def rpc(stub: Any) -> node_pb2.Node:
        if wait:
            limit = timeout or DEFAULT_DRAIN_WAIT_S
            return await _wait_drained(stub, node_id, limit, call_timeout, Console(stderr=True))
        request = registry_pb2.DrainNodeRequest(node_id=node_id)
        return (await stub.DrainNode(request, timeout=timeout or DEFAULT_TIMEOUT_S)).node  # type: ignore[no-any-return]

    node = call_registry(endpoint, rpc)
    render(
        output, to_dict(node), lambda: emit_table("nodes", _NODE_COLUMNS, _node_rows([node]), "")
    )
