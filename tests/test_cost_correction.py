"""A node's live cost correction (``controlplane/sessions/cost_correction.py``): the weighted
average of observed over predicted time, clamped, blind to tiny samples; and as the registry
keeps it (on a fake clock, no server): the costs the planner weighs follow it, a calibration
resets it."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvbroker.common.rules.clock import to_timestamp
from kvbroker.common.rules.costs import DEFAULT_COSTS, Costs
from kvbroker.controlplane.errors import InvalidArgument
from kvbroker.controlplane.records import codec
from kvbroker.controlplane.records.answers import Correction
from kvbroker.controlplane.records.model import EngineWork, NodeLoad
from kvbroker.controlplane.records.requests import Heartbeat
from kvbroker.controlplane.sessions.cost_correction import (
    MAX_FACTOR,
    MIN_FACTOR,
    WEIGHT,
    observed,
    planned_costs,
)
from kvbroker.v1 import node_pb2
from tests.test_registry_unit import Harness

COSTS = Costs(
    prefill_fixed_ms=10.0,
    prefill_us_per_token=100.0,
    prefill_ns_per_token_context=0.0,
    read_fixed_ms=5.0,
    read_us_per_block=500.0,
)


def prefills(requests: int, tokens_each: int, seconds: float) -> EngineWork:
    return EngineWork(
        prefills=requests,
        prefill_computed_tokens=requests * tokens_each,
        prefill_seconds=seconds,
    )


def reads(transfers: int, blocks_each: int, seconds: float) -> EngineWork:
    return EngineWork(reads=transfers, read_blocks=transfers * blocks_each, read_seconds=seconds)


def weighed(correction: Correction, work: EngineWork, costs: Costs = COSTS) -> Correction:
    """The correction after ``work``, moved or not."""
    return observed(correction, work, costs) or correction


def test_one_sample_moves_the_factor_a_weight_of_the_way_in_log() -> None:
    # 4 requests of 400 tokens: 4 * (10 + 40) = 200 ms predicted; 400 ms observed.
    correction = observed(Correction(), prefills(4, 400, 0.4), COSTS)
    assert correction is not None
    assert correction.prefill == pytest.approx(2**WEIGHT)
    assert (correction.read, correction.prefill_samples, correction.read_samples) == (1.0, 1, 0)


def test_a_steadily_slower_node_converges_to_its_ratio() -> None:
    correction = Correction()
    for _ in range(60):
        correction = weighed(correction, prefills(4, 400, 0.6))  # 3x the 200 ms predicted
        correction = weighed(correction, reads(2, 16, 0.013))  # 2 * (5 + 8) = 26 ms: half
    assert correction.prefill == pytest.approx(3.0, rel=1e-4)
    assert correction.read == pytest.approx(0.5, rel=1e-4)


def test_an_outlier_is_clamped() -> None:
    correction = weighed(Correction(), prefills(4, 400, 1000.0))  # 5000x
    assert correction.prefill == pytest.approx(MAX_FACTOR**WEIGHT)
    for _ in range(200):
        correction = weighed(correction, prefills(4, 400, 0.0001))
    assert correction.prefill == pytest.approx(MIN_FACTOR, rel=1e-6)


def test_tiny_samples_and_empty_parts_move_nothing() -> None:
    # One 10-token request on a node priced at 0.1 ms fixed: under a millisecond predicted.
    fast = Costs(0.1, 10.0, 0.0, 0.1, 10.0)
    assert observed(Correction(), prefills(1, 10, 5.0), fast) is None
    assert observed(Correction(), reads(1, 1, 5.0), fast) is None
    assert observed(Correction(), EngineWork(), COSTS) is None
    # No time: no measurement.
    assert observed(Correction(), prefills(4, 400, 0.0), COSTS) is None


def test_cached_tokens_are_priced_as_context() -> None:
    with_context = Costs(10.0, 100.0, 1000.0, 5.0, 500.0)
    # Each request: 10 + 100 * 0.1 + 100 * 1000 * 1000 / 1e6 = 120 ms; 240 ms for both.
    work = replace(prefills(2, 100, 0.0), prefill_cached_tokens=2 * 1000, prefill_seconds=0.240)
    correction = weighed(Correction(), work, with_context)
    assert correction.prefill == pytest.approx(1.0)
    assert correction.prefill_samples == 1


def test_the_planner_weighs_the_calibrated_costs_scaled() -> None:
    correction = Correction(prefill=2.0, read=0.5)
    planned = planned_costs(COSTS, correction)
    assert planned.prefill_ms(400, 1000) == pytest.approx(2 * COSTS.prefill_ms(400, 1000))
    assert planned.read_ms(16) == pytest.approx(0.5 * COSTS.read_ms(16))
    assert planned_costs(None, Correction()) == DEFAULT_COSTS


@given(
    st.lists(
        st.tuples(
            st.integers(0, 2**20),
            st.integers(0, 2**30),
            st.floats(0, 1e9),
            st.integers(0, 2**20),
            st.floats(0, 1e9),
            st.floats(0, 1e9),
        ),
        max_size=20,
    )
)
def test_the_factors_stay_in_range_whatever_is_reported(
    samples: list[tuple[int, int, float, int, float, float]],
) -> None:
    correction = Correction()
    for requests, tokens, seconds, transfers, blocks, read_seconds in samples:
        work = EngineWork(
            prefills=requests,
            prefill_computed_tokens=tokens,
            prefill_seconds=seconds,
            reads=transfers,
            read_blocks=blocks,
            read_seconds=read_seconds,
        )
        correction = weighed(correction, work, DEFAULT_COSTS)
        for factor in (correction.prefill, correction.read):
            assert math.isfinite(factor) and MIN_FACTOR - 1e-9 <= factor <= MAX_FACTOR + 1e-9


async def test_the_registry_scales_a_node_s_costs_and_a_calibration_resets_them() -> None:
    h = Harness()
    await h.fleet()
    spec = h.prefill
    runtime = h.registry.nodes.runtime[spec.node_id]
    assert runtime.costs == DEFAULT_COSTS
    # 4 requests of 400 tokens at the defaults: 4 * (25 + 180) = 820 ms predicted.
    slow = prefills(4, 400, 1.64)
    for _ in range(3):
        await h.registry.heartbeat(
            Heartbeat(spec.node_id, spec.incarnation, True, NodeLoad(), slow)
        )
    factor = 2 ** (1 - (1 - WEIGHT) ** 3)
    assert runtime.costs.prefill_us_per_token == pytest.approx(
        DEFAULT_COSTS.prefill_us_per_token * factor
    )
    assert runtime.costs.read_us_per_block == DEFAULT_COSTS.read_us_per_block
    view = await h.registry.get_node(spec.node_id)
    correction = view.cost_correction
    assert correction is not None and correction.prefill == pytest.approx(factor)
    assert (correction.read, correction.prefill_samples) == (1.0, 3)
    assert view.cost is None  # no calibrated profile: the defaults apply

    profile = node_pb2.CostProfile(
        prefill_fixed_ms=5.0, prefill_us_per_token=200.0, calibrated_time=to_timestamp(1.0)
    )
    view = await h.registry.set_cost_profile(spec.node_id, codec.cost_of(profile))
    assert view.cost_correction == Correction(prefill=1.0, read=1.0)
    assert runtime.costs == Costs.of(profile)
    # Against the new profile: 4 * (5 + 80) = 340 ms predicted, 1.64 s observed: clamped to 4.
    await h.registry.heartbeat(Heartbeat(spec.node_id, spec.incarnation, True, NodeLoad(), slow))
    assert runtime.costs.prefill_fixed_ms == pytest.approx(5.0 * MAX_FACTOR**WEIGHT)


async def test_work_that_cannot_be_is_refused_and_moves_nothing() -> None:
    h = Harness()
    await h.fleet()
    spec = h.prefill
    bad = prefills(4, 400, float("nan"))
    with pytest.raises(InvalidArgument, match="not a finite non-negative"):
        await h.registry.heartbeat(Heartbeat(spec.node_id, spec.incarnation, True, NodeLoad(), bad))
    assert h.registry.nodes.runtime[spec.node_id].correction == Correction()
