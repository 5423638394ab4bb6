"""``kvbroker hint``: ask the registry where a conversation's next turn would go."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from kvbroker.cli.client import call_registry, registry_flags
from kvbroker.cli.options import (
    DEFAULT_TIMEOUT_S,
    OutputOpt,
    TimeoutOpt,
)
from kvbroker.cli.output import OutputFormat, emit_fields, render, to_dict
from kvbroker.common.client.grpc_client import RegistryEndpoint
from kvbroker.common.rules.labels import label
from kvbroker.v1 import registry_pb2


@registry_flags
def hint(
    conversation: Annotated[str, typer.Argument(help="Conversation (session) id.")],
    model: Annotated[str, typer.Option(help="Served model name (default: any).")] = "",
    claim: Annotated[
        bool,
        typer.Option(help="Claim the lease as a router would (default: look only)."),
    ] = False,
    new_tokens: Annotated[
        int,
        typer.Option(
            min=0,
            help="The next turn's new suffix, in tokens: the path is chosen by it "
            "(0: not said, as from an older router).",
        ),
    ] = 0,
    output: OutputOpt = OutputFormat.table,
    timeout: TimeoutOpt = DEFAULT_TIMEOUT_S,
    *,
    endpoint: RegistryEndpoint,
) -> None:
    """Where the conversation's next turn would go, and whether it would reuse KV."""

    async def rpc(stub: Any) -> registry_pb2.RoutingHint:
        request = registry_pb2.GetRoutingHintRequest(
            conversation_id=conversation, model=model, dry_run=not claim, new_tokens=new_tokens
        )
        return (await stub.GetRoutingHint(request, timeout=timeout)).hint  # type: ignore[no-any-return]

    result = call_registry(endpoint, rpc)

    def table() -> None:
        fields = [
            ("decision", label(registry_pb2.HintDecision, result.decision)),
            ("reason", result.reason),
            ("consistency", label(registry_pb2.HintConsistency, result.consistency)),
            ("prefill", f"{result.prefill.node_id} {result.prefill.http_base_url}"),
            ("decode", f"{result.decode.node_id} {result.decode.http_base_url}"),
        ]
        if result.HasField("lease"):
            fields += [
                ("lease", f"{result.lease.lease_id} (epoch {result.lease.epoch})"),
                ("tokens", str(result.lease.token_count)),
            ]
        fields.append(("path", label(registry_pb2.TurnPath, result.path)))
        for estimate in result.estimates:
            why_not = f" (not eligible: {estimate.not_eligible})" if estimate.not_eligible else ""
            where = f" on {estimate.prefill_node_id}" if estimate.prefill_node_id else ""
            if estimate.prefill_cached_tokens:
                where += f" ({estimate.prefill_cached_tokens} tokens in its cache)"
            fields.append(
                (
                    f"  {label(registry_pb2.TurnPath, estimate.path)}{where}",
                    f"{estimate.ttft_ms:.0f} ms{why_not}",
                )
            )
        emit_fields(f"hint for {conversation}", fields)

    render(output, to_dict(result), table)
