"""``kvbroker node``: list and drain nodes."""

from __future__ import annotations

from typing import Annotated, Any, cast

import typer

from kvbroker.cli.client import call_registry, registry_endpoint
from kvbroker.cli.options import (
    DEFAULT_REGISTRY,
    DEFAULT_TIMEOUT_S,
    OutputOpt,
    RegistryOpt,
    TimeoutOpt,
    TlsCaOpt,
    TlsClientCertOpt,
    TlsClientKeyOpt,
    TokenFileOpt,
    TokenOpt,
)
from kvbroker.cli.output import OutputFormat, emit_table, fail, render, to_dict, when
from kvbroker.common.labels import by_lower_label, label
from kvbroker.v1 import node_pb2, registry_pb2

node_app = typer.Typer(help="Inspect and manage nodes.", no_args_is_help=True)

_ROLES = by_lower_label(node_pb2.NodeRole)


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
    "HEARTBEAT",
]


@node_app.command("ls")
def node_ls(
    role: Annotated[str, typer.Option(help="Only prefill, decode or both nodes.")] = "",
    registry: RegistryOpt = DEFAULT_REGISTRY,
    token: TokenOpt = None,
    token_file: TokenFileOpt = None,
    tls_ca: TlsCaOpt = None,
    tls_client_cert: TlsClientCertOpt = None,
    tls_client_key: TlsClientKeyOpt = None,
    output: OutputOpt = OutputFormat.table,
    timeout: TimeoutOpt = DEFAULT_TIMEOUT_S,
) -> None:
    """List registered nodes."""
    if role and role not in _ROLES:
        fail(f"unknown role {role!r}; choose from {', '.join(_ROLES)}", 2)
    wanted = cast("node_pb2.NodeRole", _ROLES.get(role, node_pb2.NODE_ROLE_UNSPECIFIED))

    async def rpc(stub: Any) -> list[node_pb2.Node]:
        request = registry_pb2.ListNodesRequest(role=wanted)
        return list((await stub.ListNodes(request, timeout=timeout)).nodes)

    nodes = call_registry(
        registry_endpoint(registry, token, token_file, tls_ca, tls_client_cert, tls_client_key), rpc
    )
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
    token_file: TokenFileOpt = None,
    tls_ca: TlsCaOpt = None,
    tls_client_cert: TlsClientCertOpt = None,
    tls_client_key: TlsClientKeyOpt = None,
    output: OutputOpt = OutputFormat.table,
    timeout: TimeoutOpt = DEFAULT_TIMEOUT_S,
) -> None:
    """Stop routing new turns to a node; its leases can still be read until they end."""

    async def rpc(stub: Any) -> node_pb2.Node:
        request = registry_pb2.DrainNodeRequest(node_id=node_id)
        return (await stub.DrainNode(request, timeout=timeout)).node  # type: ignore[no-any-return]

    node = call_registry(
        registry_endpoint(registry, token, token_file, tls_ca, tls_client_cert, tls_client_key), rpc
    )
    render(
        output, to_dict(node), lambda: emit_table("nodes", _NODE_COLUMNS, _node_rows([node]), "")
    )
