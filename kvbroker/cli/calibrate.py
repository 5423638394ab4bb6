"""``kvbroker calibrate``: measure each node's costs and store them in the registry, where the
planner chooses every turn's path by them (see ``kvbroker.calibration``)."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Annotated, Any

import typer

from kvbroker.cli.client import call_registry, registry_flags
from kvbroker.cli.options import (
    DEFAULT_TIMEOUT_S,
    OutputOpt,
    TimeoutOpt,
)
from kvbroker.cli.output import OutputFormat, emit_table, fail, render
from kvbroker.common.client.grpc_client import RegistryEndpoint
from kvbroker.common.rules.clock import to_timestamp
from kvbroker.common.rules.costs import Costs
from kvbroker.v1 import node_pb2, registry_pb2

if TYPE_CHECKING:
    import httpx


@dataclass
class Measured:
    node_id: str
    costs: Costs | None
    probes: list[tuple[int, float]]
    reads_measured: bool
    error: str = ""


@registry_flags
def calibrate(
    nodes: Annotated[
        list[str] | None,
        typer.Argument(help="Nodes to measure (default: every ready node)."),
    ] = None,
    repeats: Annotated[
        int, typer.Option(min=1, max=20, help="Probes per prompt length; the fastest counts.")
    ] = 3,
    dry_run: Annotated[
        bool, typer.Option(help="Measure and print, but store nothing in the registry.")
    ] = False,
    output: OutputOpt = OutputFormat.table,
    timeout: TimeoutOpt = DEFAULT_TIMEOUT_S,
    *,
    endpoint: RegistryEndpoint,
) -> None:
    """Probe each node's engine with fresh prompts of a few lengths (max_tokens=1), fit its
    prefill costs, take its read cost from its NIXL telemetry, and store them."""

    # httpx and the probes load here, not with the CLI: every `kvbroker` command (a registry's
    # start among them) would otherwise pay for importing them.
    import httpx

    async def rpc(stub: Any) -> list[Measured]:
        listed = await stub.ListNodes(registry_pb2.ListNodesRequest(), timeout=timeout)
        chosen = [
            n
            for n in listed.nodes
            if (nodes and n.spec.node_id in nodes)
            or (not nodes and n.state == node_pb2.NODE_STATE_READY)
        ]
        missing = set(nodes or ()) - {n.spec.node_id for n in chosen}
        if missing:
            fail(f"no such node: {', '.join(sorted(missing))}", 1)
        results = []
        async with httpx.AsyncClient(timeout=max(timeout, 120.0)) as http:
            for node in chosen:
                measured = await _measure(http, node, repeats)
                if measured.costs is not None and not dry_run:
                    cost = node_pb2.CostProfile(calibrated_time=to_timestamp(time.time()))
                    measured.costs.to_proto(cost)
                    await stub.SetCostProfile(
                        registry_pb2.SetCostProfileRequest(node_id=node.spec.node_id, cost=cost),
                        timeout=timeout,
                    )
                results.append(measured)
        return results

    results = call_registry(endpoint, rpc)
    payload = [
        {
            "node_id": m.node_id,
            "error": m.error,
            "probes": [{"tokens": t, "seconds": s} for t, s in m.probes],
            "costs": asdict(m.costs) if m.costs is not None else None,
            "reads_measured": m.reads_measured,
            "stored": m.costs is not None and not dry_run,
        }
        for m in results
    ]
    render(output, payload, lambda: _table(results, dry_run))
    if any(m.error for m in results):
        raise typer.Exit(1)


async def _measure(http: httpx.AsyncClient, node: node_pb2.Node, repeats: int) -> Measured:
    import httpx

    from kvbroker.calibration import measured_costs, probe_prefill, read_cost_us_per_block

    base = node.spec.http_base_url.rstrip("/")
    try:
        probes = await probe_prefill(http, base, node.spec.model, repeats=repeats)
        metrics = (await http.get(f"{base}/metrics")).text
    except (httpx.HTTPError, KeyError, ValueError) as error:
        return Measured(node.spec.node_id, None, [], False, f"{type(error).__name__}: {error}")
    per_block = read_cost_us_per_block(metrics, node.spec.bytes_per_block)
    return Measured(
        node.spec.node_id,
        measured_costs(probes, per_block),
        [(p.tokens, p.seconds) for p in probes],
        per_block is not None,
    )


def _table(results: list[Measured], dry_run: bool) -> None:
    rows = []
    for m in results:
        if m.costs is None:
            rows.append([m.node_id, "-", "-", "-", "-", "-", f"failed: {m.error}"])
            continue
        probes = ", ".join(f"{t} tok {1000 * s:.0f} ms" for t, s in m.probes)
        read = f"{m.costs.read_us_per_block:.0f}" + ("" if m.reads_measured else " (default)")
        rows.append(
            [
                m.node_id,
                f"{m.costs.prefill_fixed_ms:.1f}",
                f"{m.costs.prefill_us_per_token:.0f}",
                f"{m.costs.prefill_ns_per_token_context:.2f}",
                read,
                probes,
                "measured" if dry_run else "stored",
            ]
        )
    emit_table(
        "node costs",
        ["NODE", "FIXED ms", "µs/TOKEN", "ns/TOKEN·CTX", "READ µs/BLOCK", "PROBES", ""],
        rows,
        "no ready node to calibrate",
    )
