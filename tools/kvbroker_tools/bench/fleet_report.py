"""The figures of `kvbroker bench fleet`: one fleet size's turns reduced to its row, the
table, fleet.json and the plot of how they grow with the fleet.

Apart from the run (``kvbroker_tools.bench.fleet``) because none of it needs a registry: it only
reduces and writes what the run measured.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table

from kvbroker_tools.bench.stats import quantile

if TYPE_CHECKING:
    from kvbroker_tools.bench.fleet_config import FleetConfig
    from kvbroker_tools.bench.fleet_engines import Tally


@dataclass(frozen=True)
class FleetPoint:
    nodes: int
    replicas: int
    live_conversations: int  # at the start of the turns
    offered_rate: float  # turns/s
    achieved_rate: float  # turns done / seconds until the last was done
    turns: int
    errors: int
    hint_p50_ms: float
    hint_p99_ms: float
    hint_p999_ms: float
    registry_cores: float  # all replicas' CPU over the turns, in cores
    replica_cores: list[float]
    hints_per_core: float  # hints answered per registry CPU-second (with all else it served)
    # Hints alone, as fast as answered (heartbeats go on): per second, and per registry core.
    saturated_hints_per_s: float
    saturated_registry_cores: float
    saturated_hints_per_core: float
    etcd_cores: float
    # The load's processes: the simulated sidecars, routers and engines, and the heartbeats.
    loadgen_cores: float
    registry_rss_mib: float  # all replicas
    replica_rss_mib: list[float]
    later_turns: int
    hit_rate: float  # later turns whose hint said READ or DECODE_LOCAL
    held_rate: float  # later turns whose KV an engine still held at the hint
    reused_of_held: float  # of those, the share the hint reused
    reused_not_held: int  # hints to reuse KV no engine held: must be 0
    fenced: int  # READs the prefill node's fence declined (the claim lapsed before it)
    forks: int
    fork_hits: int  # sub-agents that found the parent's KV by content (MatchPrefix)
    refused_events: int
    heartbeat_errors: dict[str, int]  # by gRPC status code
    # By gRPC status code, the longest a failed heartbeat waited before it failed: whether it
    # was cut at a deadline, by the server's 30 s limit on calls not yet accepted, or at once.
    heartbeat_failed_after_s: dict[str, float]
    heartbeat_max_s: float  # the longest a heartbeat took to be answered, replay included
    # The latest a heartbeat left after its time (the heartbeat process's own delay): what
    # the registry is not to blame for.
    heartbeat_late_max_s: float
    sidecar_retries: int  # registrations and replays no replica served, sent again
    register_s: float
    populate_s: float


def _share(part: int, whole: int) -> float:
    return part / whole if whole else float("nan")


def point_of(
    config: FleetConfig,
    nodes: int,
    tally: Tally,
    measured: dict[str, Any],
    saturated: dict[str, Any],
    rss: list[float],
    register_s: float,
    populate_s: float,
) -> FleetPoint:
    seconds = measured["seconds"]
    cores = [cpu / seconds for cpu in measured["replica_cpu_s"]]
    latencies = tally.latencies
    return FleetPoint(
        nodes=nodes,
        replicas=len(cores),
        live_conversations=config.trace.conversations_per_node * nodes,
        offered_rate=config.rate,
        achieved_rate=tally.turns / seconds,
        turns=tally.turns,
        errors=tally.errors,
        hint_p50_ms=1000 * statistics.median(latencies) if latencies else float("nan"),
        hint_p99_ms=1000 * quantile(latencies, 0.99, method="rank"),
        hint_p999_ms=1000 * quantile(latencies, 0.999, method="rank"),
        registry_cores=sum(cores),
        replica_cores=cores,
        hints_per_core=len(latencies) / max(sum(measured["replica_cpu_s"]), 1e-9),
        saturated_hints_per_s=saturated["hints"] / saturated["seconds"],
        saturated_registry_cores=sum(saturated["replica_cpu_s"]) / saturated["seconds"],
        saturated_hints_per_core=saturated["hints"] / max(sum(saturated["replica_cpu_s"]), 1e-9),
        etcd_cores=measured["etcd_cpu_s"] / seconds,
        loadgen_cores=measured["loadgen_cpu_s"] / seconds,
        registry_rss_mib=sum(rss),
        replica_rss_mib=rss,
        later_turns=tally.later,
        hit_rate=_share(tally.reused, tally.later),
        held_rate=_share(tally.held, tally.later),
        reused_of_held=_share(tally.reused_held, tally.held),
        reused_not_held=tally.reused_not_held,
        fenced=tally.fenced,
        forks=tally.forks,
        fork_hits=tally.fork_hits,
        refused_events=tally.refused_events,
        heartbeat_errors=dict(tally.heartbeats.errors),
        heartbeat_failed_after_s=dict(tally.heartbeats.failed_after_s),
        heartbeat_max_s=tally.heartbeats.max_s,
        heartbeat_late_max_s=tally.heartbeats.late_max_s,
        sidecar_retries=tally.sidecar_retries,
        register_s=register_s,
        populate_s=populate_s,
    )


def print_table(points: list[FleetPoint], console: Console) -> None:
    table = Table(title="the control plane at fleet scale", title_justify="left")
    # "max": hints alone, as fast as they are answered; "stale": hints to reuse KV no engine
    # held (must be 0); "fenced": READs the prefill node's fence declined.
    columns = ("nodes", "convs", "turns/s", "p50 ms", "p99 ms", "p999 ms", "cores",
               "hints/core", "max/s", "max/core", "RSS MiB", "hit", "errors", "stale",
               "fenced")  # fmt: skip
    for column in columns:
        table.add_column(column, justify="right")
    for p in points:
        table.add_row(
            f"{p.nodes:,}", f"{p.live_conversations:,}", f"{p.achieved_rate:,.0f}",
            f"{p.hint_p50_ms:.2f}", f"{p.hint_p99_ms:.2f}", f"{p.hint_p999_ms:.2f}",
            f"{p.registry_cores:.2f}", f"{p.hints_per_core:,.0f}",
            f"{p.saturated_hints_per_s:,.0f}", f"{p.saturated_hints_per_core:,.0f}",
            f"{p.registry_rss_mib:,.0f}", f"{p.hit_rate:.1%}", str(p.errors),
            str(p.reused_not_held), str(p.fenced),
        )  # fmt: skip
    console.print(table)
    for p in points:
        failed = _failures(p.heartbeat_errors, p.heartbeat_failed_after_s)
        console.print(
            f"{p.nodes:,} nodes: engines held {p.held_rate:.1%} of later turns' KV, the hint "
            f"reused {p.reused_of_held:.1%} of it; sub-agents found their parent's KV "
            f"{p.fork_hits}/{p.forks}; etcd {p.etcd_cores:.2f} cores, the load "
            f"{p.loadgen_cores:.2f}; {failed} heartbeats failed, the "
            f"slowest took {p.heartbeat_max_s:.1f} s (left at most "
            f"{p.heartbeat_late_max_s:.2f} s late); registering took {p.register_s:.1f} s, "
            f"the replay {p.populate_s:.1f} s ({p.sidecar_retries} calls sent again)"
        )


def _failures(by_code: dict[str, int], after_s: dict[str, float]) -> str:
    """``0``, or the count with its status codes and the longest each waited:
    ``4 (UNAVAILABLE 3 within 0.1 s, DEADLINE_EXCEEDED 1 within 30.0 s)``."""
    total = sum(by_code.values())
    if not total:
        return "0"
    codes = ", ".join(
        f"{code} {count} within {after_s.get(code, 0.0):.1f} s"
        for code, count in sorted(by_code.items())
    )
    return f"{total} ({codes})"


def write(points: list[FleetPoint], config: FleetConfig, output: Path) -> list[Path]:
    from kvbroker_tools.bench.plotting import ready_plotting, save_figure

    output.mkdir(parents=True, exist_ok=True)
    settings = {k: v for k, v in asdict(config).items() if k != "trace"}
    report = {"settings": settings, "trace": asdict(config.trace),
              "points": [asdict(p) for p in points]}  # fmt: skip
    (output / "fleet.json").write_text(json.dumps(report, indent=2))
    ready_plotting()
    import matplotlib.pyplot as plt

    nodes = [p.nodes for p in points]
    fig, (latency, cost) = plt.subplots(1, 2, figsize=(10, 4.2))
    for field, style in (("hint_p50_ms", "o--"), ("hint_p99_ms", "o-"), ("hint_p999_ms", "o:")):
        latency.plot(nodes, [getattr(p, field) for p in points], style,
                     label=field.removeprefix("hint_").removesuffix("_ms"))  # fmt: skip
    latency.set_ylabel("hint latency at the router (ms)")
    latency.set_title(f"Hints at {config.rate:.0f} turns/s offered")
    cost.plot(nodes, [p.registry_cores for p in points], "o-", label="registry cores")
    cost.plot(nodes, [p.hit_rate for p in points], "s--", label="retained-KV hit rate")
    cost.set_ylabel("cores / share")
    cost.set_ylim(bottom=0)
    rss = cost.twinx()
    rss.plot(nodes, [p.registry_rss_mib for p in points], "^-", color="tab:red", label="RSS")
    rss.set_ylabel("registry RSS, all replicas (MiB)")
    cost.set_title("Registry cost and hit rate")
    for ax in (latency, cost):
        ax.set_xscale("log")
        ax.set_xlabel("nodes (half prefill, half decode)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper left")
    rss.legend(fontsize=8, loc="lower right")
    return [output / "fleet.json", save_figure(fig, output / "fleet.png")]
