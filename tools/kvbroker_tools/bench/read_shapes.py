"""The NIXL READs a benchmark turn caused, by their shape: blocks and runs of consecutive block
ids (``kvbroker.common.rules.fragmentation`` says why runs are what a READ costs on a GPU).

The connector exports every READ it issues as the histograms ``kvbroker_read_blocks`` and
``kvbroker_read_runs`` (``engine_ext.metric_catalog``), on the engine that issues it: D→P
reads of retained KV on the prefill engine, P→D pulls of a prefill leg on the decode engine.
A turn's READs are the difference of their sums and counts around it, as the benches already
take P's prefill totals (``bench.turns``). With several sessions at once (``bench agentic``)
a turn's window can hold other turns' READs; :func:`summarise_shapes` therefore takes only
windows that saw exactly one READ of a direction, whose figures are that READ's.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, fields

from prometheus_client.parser import text_string_to_metric_families

from kvbroker_tools.bench.stats import quantile

D_TO_P = "d_to_p"
P_TO_D = "p_to_d"
DIRECTIONS = (D_TO_P, P_TO_D)
# The histograms' names (engine_ext.metric_catalog, which is not imported here: the benches'
# reports are read without vLLM) and the ``side`` label's values.
_BLOCKS = "kvbroker_read_blocks"
_RUNS = "kvbroker_read_runs"
_SIDES = {"paired": "runs", "source": "source_runs", "destination": "destination_runs"}


@dataclass(frozen=True, slots=True)
class ShapeTotals:
    """One direction's READs since the engine started: how many, and their blocks and runs
    added up (one /metrics answer); between two answers, a window's READs."""

    reads: float = 0.0
    blocks: float = 0.0
    runs: float = 0.0
    source_runs: float = 0.0
    destination_runs: float = 0.0

    def plus(self, other: ShapeTotals) -> ShapeTotals:
        return ShapeTotals(
            **{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)}
        )

    def minus(self, before: ShapeTotals) -> ShapeTotals:
        return ShapeTotals(
            **{f.name: getattr(self, f.name) - getattr(before, f.name) for f in fields(self)}
        )


def shape_totals(text: str) -> dict[str, ShapeTotals]:
    """Each direction's totals in one /metrics answer (every engine and model name added)."""
    names = [f.name for f in fields(ShapeTotals)]
    sums = {direction: dict.fromkeys(names, 0.0) for direction in DIRECTIONS}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            direction = sample.labels.get("direction")
            if direction not in sums:
                continue
            if sample.name == f"{_BLOCKS}_count":
                sums[direction]["reads"] += sample.value
            elif sample.name == f"{_BLOCKS}_sum":
                sums[direction]["blocks"] += sample.value
            elif sample.name == f"{_RUNS}_sum" and sample.labels.get("side") in _SIDES:
                sums[direction][_SIDES[sample.labels["side"]]] += sample.value
    return {d: ShapeTotals(**values) for d, values in sums.items()}


def turn_shapes(
    before: Mapping[str, ShapeTotals], after: Mapping[str, ShapeTotals]
) -> dict[str, dict[str, float]]:
    """The READs between two answers, by direction, for a turn's record (directions with
    none left out)."""
    out = {}
    for direction in DIRECTIONS:
        window = after[direction].minus(before[direction])
        if window.reads > 0:
            out[direction] = asdict(window)
    return out


def summarise_shapes(records: Iterable[Mapping[str, Mapping[str, float]]]) -> dict[str, object]:
    """Per direction, over the windows (turns' ``read_shapes``) with exactly one READ: how many,
    and the median and p90 of its blocks, its runs (paired: the READ's descriptors per region)
    and each side's runs, and the median of runs per block."""
    windows = list(records)
    out: dict[str, object] = {}
    for direction in DIRECTIONS:
        single = [w[direction] for w in windows if w.get(direction, {}).get("reads") == 1]
        if not single:
            continue
        figures: dict[str, float] = {"reads": len(single)}
        for key in ("blocks", "runs", "source_runs", "destination_runs"):
            values = [w[key] for w in single]
            figures[f"{key}_p50"] = quantile(values, 0.5)
            figures[f"{key}_p90"] = quantile(values, 0.9)
        figures["runs_per_block_p50"] = quantile(
            [w["runs"] / w["blocks"] for w in single if w["blocks"]], 0.5
        )
        out[direction] = figures
    return out
