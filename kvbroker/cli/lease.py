"""``kvbroker lease``: list, show, renew and revoke leases."""

from __future__ import annotations

from typing import Annotated, Any, cast

import typer

from kvbroker.cli.client import call_registry, registry_flags
from kvbroker.cli.options import (
    DEFAULT_TIMEOUT_S,
    OutputOpt,
    TimeoutOpt,
    seconds,
)
from kvbroker.cli.output import (
    OutputFormat,
    emit_fields,
    emit_table,
    fail,
    render,
    seconds_left,
    to_dict,
    when,
)
from kvbroker.common.client.grpc_client import RegistryEndpoint
from kvbroker.common.rules import retention_value
from kvbroker.common.rules.clock import to_duration
from kvbroker.common.rules.labels import by_lower_label, label
from kvbroker.v1 import lease_pb2, registry_pb2

lease_app = typer.Typer(help="Inspect and manage leases.", no_args_is_help=True)

TargetArg = Annotated[
    str, typer.Argument(help="Lease id (or conversation id with --conversation).")
]
ConversationFlag = Annotated[
    bool, typer.Option("--conversation", help="TARGET is a conversation id.")
]

_STATES = by_lower_label(lease_pb2.LeaseState)


def _live(lease: lease_pb2.Lease) -> bool:
    return lease.state in (lease_pb2.LEASE_STATE_ACTIVE, lease_pb2.LEASE_STATE_CLAIMED)


def _rank_fields(lease: lease_pb2.Lease) -> list[str]:
    """Idle time, chance of a next turn and value (kvbroker.common.rules.retention_value)."""
    if not _live(lease):
        return ["-", "-", "-"]
    rank = retention_value.of_lease(lease)
    return [f"{rank.idle_s:.0f}s/{rank.ttl_s:.0f}s", f"{rank.p_next:.2f}", f"{rank.value:.1f}"]


def _lease_row(lease: lease_pb2.Lease) -> list[str]:
    state = label(lease_pb2.LeaseState, lease.state)
    if lease.end_cause:
        state += f" {label(lease_pb2.LeaseEndCause, lease.end_cause)}"
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
                    label(lease_pb2.LeaseState, lease.state)
                    + (f" ({lease.end_reason})" if lease.end_reason else ""),
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
                (
                    "end cause",
                    label(lease_pb2.LeaseEndCause, lease.end_cause) if lease.end_cause else "-",
                ),
                *zip(
                    ("idle / idle TTL", "p(next turn)", "value (tokens saved per block)"),
                    _rank_fields(lease),
                    strict=True,
                ),
            ],
        )

    render(output, to_dict(lease), table)


def _call_and_show(
    endpoint: RegistryEndpoint, method: str, request: Any, timeout: float, output: OutputFormat
) -> None:
    """Calls one of the registry's methods that answer with a lease, and shows that lease."""

    async def rpc(stub: Any) -> lease_pb2.Lease:
        return (await getattr(stub, method)(request, timeout=timeout)).lease  # type: ignore[no-any-return]

    _show_lease(call_registry(endpoint, rpc), output)


@lease_app.command("ls")
@registry_flags
def lease_ls(
    node: Annotated[str, typer.Option(help="Only leases held by this node.")] = "",
    conversation: Annotated[str, typer.Option(help="Only this conversation's leases.")] = "",
    state: Annotated[
        list[str] | None,
        typer.Option(help=f"Only these states ({', '.join(_STATES)}); default live ones."),
    ] = None,
    all_states: Annotated[bool, typer.Option("--all", help="Every state.")] = False,
    limit: Annotated[int, typer.Option(min=1, help="At most this many leases.")] = 1000,
    output: OutputOpt = OutputFormat.table,
    timeout: TimeoutOpt = DEFAULT_TIMEOUT_S,
    *,
    endpoint: RegistryEndpoint,
) -> None:
    """List leases (live ones unless --state or --all)."""
    unknown = [s for s in state or [] if s.lower() not in _STATES]
    if unknown:
        fail(f"unknown state {unknown[0]!r}; choose from {', '.join(_STATES)}", 2)
    chosen = list(_STATES.values()) if all_states else [_STATES[s.lower()] for s in state or []]
    states = cast("list[lease_pb2.LeaseState]", chosen)

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

    leases = call_registry(endpoint, rpc)
    render(
        output,
        [to_dict(lease) for lease in leases],
        lambda: emit_table(
            "leases", _LEASE_COLUMNS, [_lease_row(lease) for lease in leases], "no leases"
        ),
    )


@lease_app.command("show")
@registry_flags
def lease_show(
    lease_id: Annotated[str, typer.Argument(help="The lease id.")],
    output: OutputOpt = OutputFormat.table,
    timeout: TimeoutOpt = DEFAULT_TIMEOUT_S,
    *,
    endpoint: RegistryEndpoint,
) -> None:
    """Show one lease in full."""

    _call_and_show(
        endpoint, "GetLease", registry_pb2.GetLeaseRequest(lease_id=lease_id), timeout, output
    )


@lease_app.command("renew")
@registry_flags
def lease_renew(
    target: TargetArg,
    conversation: ConversationFlag = False,
    ttl: Annotated[
        float,
        typer.Option(callback=seconds, help="New time to live, seconds (0: registry default)."),
    ] = 0.0,
    output: OutputOpt = OutputFormat.table,
    timeout: TimeoutOpt = DEFAULT_TIMEOUT_S,
    *,
    endpoint: RegistryEndpoint,
) -> None:
    """Extend a live lease."""
    request = registry_pb2.RenewLeaseRequest(time_to_live=to_duration(ttl) if ttl else None)
    if conversation:
        request.conversation_id = target
    else:
        request.lease_id = target
    _call_and_show(endpoint, "RenewLease", request, timeout, output)


@lease_app.command("revoke")
@registry_flags
def lease_revoke(
    target: TargetArg,
    conversation: ConversationFlag = False,
    reason: Annotated[str, typer.Option(help="Recorded on the lease.")] = "revoked by operator",
    output: OutputOpt = OutputFormat.table,
    timeout: TimeoutOpt = DEFAULT_TIMEOUT_S,
    *,
    endpoint: RegistryEndpoint,
) -> None:
    """End a lease; its holder frees the blocks once any in-flight read is done."""
    request = registry_pb2.RevokeLeaseRequest(reason=reason)
    if conversation:
        request.conversation_id = target
    else:
        request.lease_id = target
    _call_and_show(endpoint, "RevokeLease", request, timeout, output)
