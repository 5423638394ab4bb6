"""vLLM's path from a connector in the engine-core process to the API server's /metrics: the
stats dataclass the scheduler aggregates and ships, and the per-connector Prometheus class
the API server builds from the connector class (``engine_ext.connector_metrics`` extends
NIXL's two).
"""

from __future__ import annotations

from prometheus_client import REGISTRY
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats import (
    NixlKVConnectorStats,
    NixlPromMetrics,
)
from vllm.v1.metrics.utils import create_metric_per_engine

__all__ = [
    "KVConnectorPromMetrics",
    "KVConnectorStats",
    "NixlKVConnectorStats",
    "NixlPromMetrics",
    "PromMetric",
    "PromMetricT",
    "create_metric_per_engine",
    "unregister_metrics",
]


def unregister_metrics(prefix: str) -> None:
    """Drops the default registry's collectors whose name starts with ``prefix``, as vLLM's
    ``unregister_vllm_metrics`` does for ``vllm:`` before it registers its metrics again (a
    second stat logger in one process, e.g. a second engine): prometheus_client refuses a
    name registered twice, and vLLM only clears its own prefix."""
    for collector in list(REGISTRY._collector_to_names):
        if getattr(collector, "_name", "").startswith(prefix):
            REGISTRY.unregister(collector)
