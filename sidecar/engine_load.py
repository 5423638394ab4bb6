"""Reading vLLM's load off its /metrics text, apart from the probe that fetches it: a pure
function of vLLM's Prometheus format (its metric names, and which of its figures can be
believed), so it follows vLLM's releases on its own and is tested with no engine and no HTTP."""

from __future__ import annotations

import math
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from kvbroker.common.rules.engine_metrics import Totals, TotalsReader
from kvbroker.v1 import node_pb2

# NodeLoad's counts are uint32: a figure beyond this cannot be sent (the proto refuses it).
_MAX_COUNT = 2**32 - 1
_COUNTS = {
    "vllm:num_requests_running": "running_requests",
    "vllm:num_requests_waiting": "waiting_requests",
}
_USAGE = "vllm:kv_cache_usage_perc"
# How much of an unreadable body's parse error a warning quotes.
_QUOTED = 200


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """What one /metrics answer said: the figures that could be read, its running totals of
    work (None when any was unusable), and why any figures were ignored (empty when none
    was)."""

    load: node_pb2.NodeLoad
    totals: Totals | None = None
    ignored: tuple[str, ...] = ()


def parse_vllm_load(text: str) -> EngineLoad:
    """Running/waiting requests and KV usage from vLLM's Prometheus text, and its running
    totals of work (``engine_metrics.TotalsReader``).

    Total: whatever the engine answers, it returns. A body that is not Prometheus text (an HTML
    error page) gives no figures; a count that is not finite, is negative or does not fit the
    proto's uint32, and a usage outside 0..1, is ignored, and a total that is not finite or is
    negative costs the answer its totals; each says why in ``ignored``. A bad answer costs the
    node its load figures (the next good one counts the work of both), never its probe loop
    and so its session."""
    counts = dict.fromkeys(_COUNTS.values(), 0)
    usage = 0.0
    ignored: list[str] = []
    totals = TotalsReader()
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                value = sample.value
                if totals.add(sample):
                    continue
                if sample.name in _COUNTS:
                    if not (math.isfinite(value) and 0 <= value <= _MAX_COUNT):
                        ignored.append(f"{sample.name} = {value!r} is not a count")
                        continue
                    field = _COUNTS[sample.name]
                    # Several series (one per model name) add up; the sum saturates.
                    counts[field] = min(counts[field] + int(value), _MAX_COUNT)
                elif sample.name == _USAGE:
                    if not (math.isfinite(value) and 0 <= value <= 1):
                        ignored.append(f"{sample.name} = {value!r} is not a fraction")
                        continue
                    usage = max(usage, value)
    # The parser is a third party's and raises whatever its line reader hits (ValueError,
    # IndexError, ...): any of it means the body is not Prometheus text. Its message quotes the
    # offending line, which may be a whole error page: the log gets its start.
    except Exception as error:
        why = f"not Prometheus text: {type(error).__name__}: {str(error)[:_QUOTED]}"
        return EngineLoad(node_pb2.NodeLoad(), ignored=(why,))
    return EngineLoad(
        node_pb2.NodeLoad(kv_cache_usage=usage, **counts),
        totals.totals(),
        (*ignored, *totals.ignored),
    )
