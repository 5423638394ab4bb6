"""What one ``kvbroker bench fleet`` run measures: the fleet sizes, the offered rate, the
replicas and the trace. Apart from the run (``fleet``) so that its report (``fleet_report``),
which the run imports, can read the settings without importing the run back.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvbroker.controlplane.config import RegistryConfig
from kvbroker_tools.bench.fleet_trace import TraceParams


@dataclass(frozen=True)
class FleetConfig:
    sizes: tuple[int, ...] = (10, 100, 1_000)  # nodes, half of them prefill
    rate: float = 300.0  # offered turns per second
    seconds: float = 10.0  # of turns per size
    saturation_s: float = 5.0  # of hints alone, as fast as they are answered
    replicas: int = 2
    # The registry's defaults: the fleet's heartbeats leave on time from a process of their
    # own (``fleet_heartbeats``), so the replay at the start must keep sessions as they are.
    heartbeat_interval_s: float = RegistryConfig.heartbeat_interval_s
    session_ttl_s: float = RegistryConfig.session_ttl_s
    # A decode engine's KV cache (16-token blocks: 1M tokens) and the share it may retain.
    capacity_blocks: int = 65_536
    retention_share: float = 0.5
    trace: TraceParams = field(default_factory=TraceParams)
