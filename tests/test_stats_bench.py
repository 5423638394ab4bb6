"""The benchmarks' one quantile (``kvbroker_tools.bench.stats``), pinned on small inputs: each
report's figures are what its own function gave before they were merged."""

from __future__ import annotations

import math

import pytest

from kvbroker_tools.bench.multiturn import Spread
from kvbroker_tools.bench.registry_report import summarise
from kvbroker_tools.bench.stats import Method, quantile

# Quartiles of these differ in the last place between 4 parts and 100 (see the module).
ULP_APART = [362.3787683441612, 633.6975831717522, 2867.559180369951, 4021.2120527825086]
THOUSAND = [float(i) for i in range(1, 1001)]


@pytest.mark.parametrize("method", ["inclusive", "rank"])
def test_none_is_nan_and_one_is_itself(method: Method) -> None:
    assert math.isnan(quantile([], 0.99, method=method))
    assert quantile([7.0], 0.99, method=method) == 7.0
    assert quantile([7.0], 0.25, method=method, parts=4) == 7.0


def test_inclusive_interpolates_in_hundredths() -> None:
    assert quantile([1.0, 2.0, 3.0], 0.5) == 2.0
    assert quantile([3.0, 1.0, 2.0], 0.5) == 2.0  # unsorted
    assert quantile([1.0, 2.0], 0.99) == 1.99
    assert quantile([10.0, 20.0, 30.0, 40.0], 0.5) == 25.0
    assert quantile([100.0, 200.0, 300.0, 400.0, 5000.0], 0.9) == 3160.0
    assert quantile(THOUSAND, 0.99) == 990.01


def test_quartiles_keep_their_own_cut() -> None:
    assert quantile([100.0, 110.0, 120.0, 130.0, 140.0], 0.25, parts=4) == 110.0
    assert quantile([90.0, 100.0, 110.0], 0.75, parts=4) == 105.0
    assert quantile(ULP_APART, 0.25, parts=4) == 565.8678794648544
    assert quantile(ULP_APART, 0.25) == 565.8678794648545


def test_rank_takes_a_value_without_interpolating() -> None:
    assert quantile([1.0, 2.0], 0.99, method="rank") == 2.0
    assert quantile([3.0, 1.0, 2.0], 0.5, method="rank") == 2.0
    assert quantile([10.0, 20.0, 30.0, 40.0], 0.5, method="rank") == 30.0
    assert quantile(THOUSAND, 0.99, method="rank") == 991.0
    assert quantile(THOUSAND, 0.999, method="rank") == 1000.0


@pytest.mark.parametrize(("q", "parts"), [(0.999, 100), (0.001, 100), (0.3, 4), (1.0, 100)])
def test_inclusive_refuses_a_q_off_its_cuts(q: float, parts: int) -> None:
    with pytest.raises(ValueError):
        quantile([1.0, 2.0], q, parts=parts)


def test_the_reports_figures() -> None:
    assert Spread.of([7.0]) == Spread(1, 7.0, 7.0, 7.0, 7.0, 7.0)
    spread = Spread.of(ULP_APART)
    assert (spread.q1_ms, spread.q3_ms) == (565.8678794648544, 3155.9723984730904)
    load = summarise("RenewLease", 10.0, [0.001, 0.002, 0.003, 0.004], 2.0, 0, 0.5)
    assert (load.p50_ms, load.p99_ms, load.p999_ms) == (2.5, 4.0, 4.0)
    empty = summarise("RenewLease", 10.0, [], 2.0, 0, 0.5)
    assert math.isnan(empty.p99_ms) and math.isnan(empty.p999_ms)
