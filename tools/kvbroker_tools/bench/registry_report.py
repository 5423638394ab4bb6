"""The figures of `kvbroker bench registry`: one load level's latencies summarised, and
registry.json with its latency plot and its memory plot (RSS against live leases, beside an
earlier run's when one is given).

Apart from the run (``kvbroker_tools.bench.registry_load``) because none of it needs a registry or
a load process: it only reduces and writes what they measured.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvbroker_tools.bench.plotting import ready_plotting, save_figure
from kvbroker_tools.bench.registry_workers import HINT_RPC
from kvbroker_tools.bench.stats import quantile


@dataclass(frozen=True)
class LoadResult:
    rpc: str
    rate: float  # offered turns (or calls) per second; 0 for saturation
    p50_ms: float
    p99_ms: float
    p999_ms: float
    throughput: float  # answered per second
    errors: int
    # The registry process's CPU over the level, in cores (the load generators share the
    # machine's 2 cores with it): throughput / registry_cpu is what one registry core answers.
    registry_cpu: float


def summarise(
    rpc: str, rate: float, latencies: list[float], seconds: float, errors: int, cpu: float
) -> LoadResult:
    return LoadResult(
        rpc=rpc,
        rate=rate,
        p50_ms=1000 * statistics.median(latencies) if latencies else float("nan"),
        p99_ms=1000 * quantile(latencies, 0.99, method="rank"),
        p999_ms=1000 * quantile(latencies, 0.999, method="rank"),
        throughput=len(latencies) / seconds,
        errors=errors,
        registry_cpu=cpu,
    )


# The targets the memory plot draws: RSS at a million live leases, and a restart of 100k.
TARGET_RSS_MIB = 1024
TARGET_RESTART_S = 5.0


def write(
    report: dict[str, Any], output: Path, baseline: dict[str, Any] | None = None
) -> list[Path]:
    """``baseline``: an earlier run's report, drawn beside this one's memory."""
    output.mkdir(parents=True, exist_ok=True)
    (output / "registry.json").write_text(json.dumps(report, indent=2))
    ready_plotting()
    paths = [output / "registry.json"]
    if report["load"]:
        paths.append(_latency_plot(report, output))
    if len(report["memory"]) > 1:
        paths.append(_memory_plot(report, baseline, output))
    return paths


def _latency_plot(report: dict[str, Any], output: Path) -> Path:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for rpc in (HINT_RPC, "ReportRetention", "RenewLease"):
        rows = [r for r in report["load"] if r["rpc"] == rpc and r["rate"] > 0]
        ax.plot([r["rate"] for r in rows], [r["p99_ms"] for r in rows], "o-", label=f"{rpc} p99")
        ax.plot([r["rate"] for r in rows], [r["p50_ms"] for r in rows], "o--", alpha=0.6,
                label=f"{rpc} p50")  # fmt: skip
    ax.set_xlabel("offered load (turns/s)")
    ax.set_ylabel("latency (ms, log scale)")
    ax.set_yscale("log")  # a saturated level is 100x the others
    ax.set_title("Registry latency vs load (10k live leases, gRPC on loopback)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(fig, output / "registry_latency.png")


def _memory_plot(report: dict[str, Any], baseline: dict[str, Any] | None, output: Path) -> Path:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    runs = [("this run", report)] + ([("baseline", baseline)] if baseline else [])
    for name, run in runs:
        points = run["memory"]
        restart = run.get("restart") or {}
        label = name
        if restart:
            label += f" (restart of {restart['leases']:,}: {restart['recovery_s']:.1f} s)"
        ax.plot([p["live_leases"] for p in points], [p["rss_mib"] for p in points], "o-",
                label=label)  # fmt: skip
    ax.axhline(TARGET_RSS_MIB, color="grey", linestyle="--", label="target at 1M leases")
    ax.set_xlabel("live leases")
    ax.set_ylabel("registry RSS (MiB)")
    ax.set_title(f"Registry memory (restart target {TARGET_RESTART_S:.0f} s at 100k)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(fig, output / "registry_memory.png")


def write_replicas(report: dict[str, Any], output: Path) -> list[Path]:
    """registry_replicas.json, and its plot: hints/s at saturation and p50/p99 at the paced
    rate, per number of replicas."""
    output.mkdir(parents=True, exist_ok=True)
    data = output / "registry_replicas.json"
    data.write_text(json.dumps(report, indent=2))
    ready_plotting()
    import matplotlib.pyplot as plt

    configurations = report["configurations"]
    labels = [f"{c['replicas']} replica{'s' if c['replicas'] > 1 else ''}" for c in configurations]
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 4))
    width = 0.38
    for offset, rpc in ((-width / 2, "GetRoutingHint"), (width / 2, HINT_RPC)):
        rows = [next(r for r in c["load"] if r["rpc"] == rpc and r["rate"] == 0)
                for c in configurations]  # fmt: skip
        positions = [i + offset for i in range(len(rows))]
        left.bar(positions, [r["throughput"] for r in rows], width, label=f"{rpc}")
    left.set_xticks(range(len(labels)), labels)
    left.set_ylabel("dry-run hints/s at saturation")
    left.legend(fontsize=8)
    left.grid(alpha=0.3, axis="y")
    paced = [next(r for r in c["load"] if r["rate"] > 0) for c in configurations]
    for offset, key in ((-width / 2, "p50_ms"), (width / 2, "p99_ms")):
        positions = [i + offset for i in range(len(paced))]
        right.bar(positions, [r[key] for r in paced], width, label=key.replace("_ms", ""))
    right.set_xticks(range(len(labels)), labels)
    right.set_ylabel(f"latency at {paced[0]['rate']:.0f} hints/s (ms, log scale)")
    right.set_yscale("log")  # p99 is queueing on a busy machine, p50 the answer itself
    right.legend(fontsize=8)
    right.grid(alpha=0.3, axis="y")
    fig.suptitle("Dry-run hints answered by every replica (etcd, gRPC on loopback)")
    path = save_figure(fig, output / "registry_replicas.png")
    return [data, path]
