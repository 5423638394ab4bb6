"""A node's live cost correction: its costs kept fresh between calibrations from the work its
engine reports with each heartbeat (``EngineWork``, read by the sidecar off vLLM's /metrics).

For each heartbeat's work the registry computes what the node's calibrated costs (or the
defaults) predict for that same work, and the ratio observed / predicted, separately for
prefill and for reads. Each factor is an exponentially weighted average of those ratios, taken
in log space (a node twice as slow and one twice as fast weigh alike), each ratio clamped to
``MIN_FACTOR``..``MAX_FACTOR`` so one outlier cannot swing it far; work predicted to take less
than ``MIN_PREDICTED_MS`` is not timed well enough to count. The planner weighs the costs
scaled by the factors (``planned_costs``). A new calibration starts them again from 1.

The prediction for a heartbeat's prefills prices each as the mean request (computed tokens
and cached tokens over the requests): exact for the fixed and per-token terms, an
approximation for the attention term. vLLM's prefill time runs from the request being
scheduled to its first token, so under load it includes the batching with other requests,
which the planner's load factor counts too: a busy node's prefill factor rises with its load,
and the planner then weighs that load twice. Soft state: a new leader starts from 1.
"""

from __future__ import annotations

import math

from kvbroker.common.rules.costs import DEFAULT_COSTS, Costs
from kvbroker.controlplane.records.answers import Correction
from kvbroker.controlplane.records.model import EngineWork

MIN_FACTOR = 0.25
MAX_FACTOR = 4.0
# The weight of each heartbeat's ratio: the factor follows a change within a few heartbeats
# of work, and one odd interval moves it at most a fifth of the way (in log) to the clamp.
WEIGHT = 0.2
# Work predicted below this is mostly scheduling noise.
MIN_PREDICTED_MS = 10.0


def _blend(factor: float, observed_ms: float, predicted_ms: float) -> float | None:
    """The factor moved toward observed / predicted; None if the sample does not count."""
    if not (predicted_ms >= MIN_PREDICTED_MS and observed_ms > 0 and math.isfinite(observed_ms)):
        return None
    ratio = min(max(observed_ms / predicted_ms, MIN_FACTOR), MAX_FACTOR)
    return math.exp((1 - WEIGHT) * math.log(factor) + WEIGHT * math.log(ratio))


def observed(correction: Correction, work: EngineWork, costs: Costs) -> Correction | None:
    """``correction`` moved by ``work``, weighed against what ``costs`` (the uncorrected ones)
    predict for it; None when no factor moved."""
    prefill, read = correction.prefill, correction.read
    prefill_samples, read_samples = correction.prefill_samples, correction.read_samples
    if work.prefills:
        mean_new = work.prefill_computed_tokens / work.prefills
        mean_cached = work.prefill_cached_tokens / work.prefills
        predicted = work.prefills * costs.prefill_ms(mean_new, mean_cached)
        moved = _blend(prefill, work.prefill_seconds * 1e3, predicted)
        if moved is not None:
            prefill, prefill_samples = moved, prefill_samples + 1
    if work.reads:
        predicted = work.reads * costs.read_ms(work.read_blocks / work.reads)
        moved = _blend(read, work.read_seconds * 1e3, predicted)
        if moved is not None:
            read, read_samples = moved, read_samples + 1
    if (prefill_samples, read_samples) == (correction.prefill_samples, correction.read_samples):
        return None
    return Correction(prefill, read, prefill_samples, read_samples)


def planned_costs(
    calibrated: Costs | None, correction: Correction, defaults: Costs = DEFAULT_COSTS
) -> Costs:
    """The costs the planner weighs for a node: its calibrated profile (its ``defaults``
    until it is calibrated) scaled by its live correction."""
    return (calibrated or defaults).scaled(correction.prefill, correction.read)
