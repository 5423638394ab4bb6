"""The series kvbroker's connector adds to the engine's own ``/metrics``: names, kinds and
meanings in one place, read by the connector's Prometheus metrics
(``engine_ext.connector_metrics``) and by the generated metrics reference. Plain Python, so
the reference is built without importing vLLM."""

from __future__ import annotations

from dataclasses import dataclass

# vLLM's own labels on every connector series; kvbroker's reads-declined adds ``reason``, the
# READ shapes ``direction`` (and ``side``).
VLLM_LABELS = ("model_name", "engine")


@dataclass(frozen=True, slots=True)
class EngineMetric:
    name: str  # counters without their ``_total``, as prometheus_client takes them
    kind: str
    documentation: str
    extra_labels: tuple[str, ...] = ()


RETAINED_BLOCKS = EngineMetric(
    "kvbroker_retained_blocks", "gauge", "KV blocks this engine holds for retention now."
)
BUDGET_FREE_RATIO = EngineMetric(
    "kvbroker_retention_budget_free_ratio",
    "gauge",
    "1 - retained blocks / retention budget: the retention headroom (below 0 when over budget).",
)
LEASES_LIVE = EngineMetric(
    "kvbroker_leases_live", "gauge", "Retained requests whose lease is live."
)
READS_SERVED = EngineMetric(
    "kvbroker_reads_served",
    "counter",
    "Reads of this engine's retained KV by prefill engines that completed (the blocks were "
    "then freed).",
)
READS_DECLINED = EngineMetric(
    "kvbroker_reads_declined",
    "counter",
    "Remote handles this engine did not read, by the verdict: decline (the registry refused "
    "the lease) or recompute (not worth a read, or the lease could not be checked).",
    ("reason",),
)
# Powers of two up to a 256k-token READ of 16-token blocks.
READ_SHAPE_BUCKETS = tuple(float(2**i) for i in range(15))
READ_BLOCKS = EngineMetric(
    "kvbroker_read_blocks",
    "histogram",
    "KV blocks per NIXL READ this engine issued, by direction: d_to_p (a prefill engine "
    "reading retained KV under a lease) or p_to_d (a decode engine pulling a prefill leg).",
    ("direction",),
)
READ_RUNS = EngineMetric(
    "kvbroker_read_runs",
    "histogram",
    "Runs of consecutive block ids per NIXL READ this engine issued (what NIXL posts per "
    "region: descriptors after merging abutting ones), by direction and side: paired (the "
    "source and the destination id both the previous + 1: the READ's descriptors), source, "
    "destination.",
    ("direction", "side"),
)
ENGINE_METRICS = (
    RETAINED_BLOCKS,
    BUDGET_FREE_RATIO,
    LEASES_LIVE,
    READS_SERVED,
    READS_DECLINED,
    READ_BLOCKS,
    READ_RUNS,
)
