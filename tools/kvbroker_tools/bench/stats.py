"""The quantiles of the benchmarks' reports, in one place: the agentic bench's TTFT
percentiles, the multi-turn bench's quartiles and the registry bench's latency percentiles
were three functions with the same edge cases (no values, one value) handled three times.

They do not all mean the same quantile, and their published figures must not move, so the
definition is a parameter rather than a choice made here:

* ``inclusive`` (the default) interpolates between the two nearest values, the smallest being
  the 0th percentile and the largest the 100th: :func:`statistics.quantiles` with
  ``method="inclusive"``, cut into ``parts`` (hundredths for percentiles, 4 for quartiles).
  The cut matters to the last bit: 4 parts and 100 parts interpolate with other integer
  weights, so the same quartile can differ in its last place.
* ``rank`` does not interpolate: the sorted value at index ``int(q * n)`` (the largest when
  that is past the end), as the registry bench's p99 and p99.9 have always been read.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Literal

Method = Literal["inclusive", "rank"]


def quantile(
    values: Sequence[float], q: float, *, method: Method = "inclusive", parts: int = 100
) -> float:
    """The q-quantile (0 < q < 1) of ``values`` by ``method``: NaN if there are none, the
    value itself if there is one. For ``inclusive``, q is a whole number of ``1 / parts``
    (ValueError otherwise); ``parts`` is not used by ``rank``."""
    cut = round(parts * q)
    if method == "inclusive" and not (0 < cut < parts and math.isclose(parts * q, cut)):
        raise ValueError(f"q = {q!r} is not a whole number of 1/{parts} between 0 and 1")
    if not values:
        return math.nan
    if len(values) == 1:
        return float(values[0])
    if method == "rank":
        ordered = sorted(values)
        return float(ordered[min(int(q * len(ordered)), len(ordered) - 1)])
    return statistics.quantiles(values, n=parts, method="inclusive")[cut - 1]


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """``numerator / denominator``, or None when either was not measured."""
    if numerator is None or denominator is None:
        return None
    return numerator / denominator
