"""What the failover soak found: its figures, the table the CLI prints and failover.json.

Apart from the fleet and its load (``kvbroker_tools.bench.failover``) because it needs neither:
it only formats and writes what a run counted.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any


@dataclass
class SoakReport:
    duration_s: float
    turns: int
    failed_requests: int
    reuse_exact: int
    degraded_hints: int
    reads: int
    declined_reads: int
    leases_granted: int
    leases_lost: int
    stale_hints: int
    stale_reads: int
    replica_kills: int
    leader_kills: int
    etcd_restarts: int
    recovery_s: list[float]
    etcd_recovery_s: list[float]
    etcd_hangs: int
    # Seconds from etcd resuming after a hang until every replica served again.
    etcd_hang_rejoin_s: list[float]
    etcd_hang_recovery_s: list[float]
    # Hangs after which some replica did not serve again in time.
    replicas_stuck: int
    failures: list[str]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _spread(times: list[float]) -> str:
    if not times:
        return "n/a"
    return f"median {statistics.median(times):.2f}, max {max(times):.2f}"


def summary_rows(report: SoakReport) -> list[tuple[str, str, str]]:
    """(figure, value, must be) rows for the table."""
    return [
        ("turns", str(report.turns), ""),
        ("failed requests", str(report.failed_requests), "0"),
        ("reuse (EXACT hints)", str(report.reuse_exact), ""),
        ("DEGRADED hints", str(report.degraded_hints), ""),
        ("KV reads allowed / declined", f"{report.reads} / {report.declined_reads}", ""),
        ("leases granted", str(report.leases_granted), ""),
        ("leases lost", str(report.leases_lost), "0"),
        ("stale hints", str(report.stale_hints), "0"),
        ("stale reads", str(report.stale_reads), "0"),
        ("replica kills (leader)", f"{report.replica_kills} ({report.leader_kills})", ""),
        ("etcd restarts", str(report.etcd_restarts), ""),
        ("reuse again after a leader kill, s", _spread(report.recovery_s), ""),
        ("reuse again after etcd restarted, s", _spread(report.etcd_recovery_s), ""),
        ("etcd hangs", str(report.etcd_hangs), ""),
        ("every replica serving after etcd resumed, s", _spread(report.etcd_hang_rejoin_s), ""),
        ("reuse again after etcd resumed, s", _spread(report.etcd_hang_recovery_s), ""),
        ("replicas stuck after a hang", str(report.replicas_stuck), "0"),
    ]


def write_report(report: SoakReport, output: Path) -> Path:
    output.mkdir(parents=True, exist_ok=True)
    path = output / "failover.json"
    path.write_text(json.dumps(report.to_json(), indent=2) + "\n")
    return path
