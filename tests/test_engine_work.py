"""The engine's work between two /metrics readings (``kvbroker.common.rules.engine_metrics``,
read by ``sidecar.engine_load.parse_vllm_load``): counter deltas, a restart resetting the baseline,
nothing for an interval with no work, and bad samples costing the totals, never the probe."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvbroker.calibration import read_cost_us_per_block
from kvbroker.common.rules.engine_metrics import (
    Totals,
    WorkMeter,
    read_gauges,
    read_totals,
    work_between,
)
from kvbroker.sidecar.engine_load import parse_vllm_load
from kvbroker.v1 import node_pb2

BYTES_PER_BLOCK = 65536


def vllm_metrics(
    prefills: float = 0,
    prefill_seconds: float = 0,
    computed: float = 0,
    prompt: float = 0,
    reads: float = 0,
    read_seconds: float = 0,
    read_bytes: float = 0,
    running: int = 0,
) -> str:
    """/metrics text as vLLM 0.32 writes it (histograms with buckets, one series per engine)."""
    labels = 'engine="0",model_name="tiny-qwen3"'

    def histogram(name: str, count: float, total: float) -> list[str]:
        return [
            f"# HELP {name} help",
            f"# TYPE {name} histogram",
            f'{name}_bucket{{{labels},le="1.0"}} {count}',
            f'{name}_bucket{{{labels},le="+Inf"}} {count}',
            f"{name}_count{{{labels}}} {count}",
            f"{name}_sum{{{labels}}} {total}",
        ]

    lines = [
        "# TYPE vllm:num_requests_running gauge",
        f"vllm:num_requests_running{{{labels}}} {running}",
        "# TYPE vllm:prompt_tokens counter",
        f"vllm:prompt_tokens_total{{{labels}}} {prompt}",
        *histogram("vllm:request_prefill_time_seconds", prefills, prefill_seconds),
        *histogram("vllm:request_prefill_kv_computed_tokens", prefills, computed),
        *histogram("vllm:request_prompt_tokens", prefills, prompt),
        *histogram("vllm:nixl_xfer_time_seconds", reads, read_seconds),
        *histogram("vllm:nixl_bytes_transferred", reads, read_bytes),
    ]
    return "".join(f"{line}\n" for line in lines)


def totals_of(text: str) -> Totals | None:
    return parse_vllm_load(text).totals


def test_vllm_s_histograms_give_the_running_totals() -> None:
    parsed = parse_vllm_load(
        vllm_metrics(3, 0.6, 900, 1500, 2, 0.05, 8 * BYTES_PER_BLOCK, running=2)
    )
    assert parsed.ignored == ()
    assert parsed.load.running_requests == 2
    assert parsed.totals == Totals(3, 0.6, 900, 1500, 2, 0.05, 8 * BYTES_PER_BLOCK)
    assert read_totals(vllm_metrics(prefills=4)) == Totals(prefills=4)


def test_gauges_are_read_as_they_stand_and_their_series_add_up() -> None:
    text = vllm_metrics(prefills=3, running=2) + (
        "# TYPE vllm:kv_cache_usage_perc gauge\n"
        'vllm:kv_cache_usage_perc{engine="0",model_name="tiny-qwen3"} 0.25\n'
        'vllm:kv_cache_usage_perc{engine="1",model_name="tiny-qwen3"} 0.5\n'
    )
    gauges = {
        "usage": "vllm:kv_cache_usage_perc",
        "running": "vllm:num_requests_running",
        "waiting": "vllm:num_requests_waiting",  # not in the answer
        "prefills": "vllm:request_prefill_time_seconds",  # a histogram's samples are not it
    }
    assert read_gauges(text, gauges) == {
        "usage": 0.75,
        "running": 2.0,
        "waiting": 0.0,
        "prefills": 0.0,
    }
    assert read_gauges(text, {}) == {}
    with pytest.raises(ValueError):
        read_gauges("<html><body><h1>502 Bad Gateway</h1></body></html>", gauges)


def test_the_work_of_an_interval_is_the_difference_of_its_readings() -> None:
    before = Totals(3, 0.6, 900, 1500, 2, 0.05, 8 * BYTES_PER_BLOCK)
    after = Totals(5, 1.0, 1300, 2500, 5, 0.11, 20 * BYTES_PER_BLOCK)
    work = work_between(before, after, BYTES_PER_BLOCK)
    assert work.prefills == 2
    assert work.prefill_computed_tokens == 400
    assert work.prefill_cached_tokens == 600  # 1000 prompt tokens, 400 of them computed
    assert work.prefill_seconds == pytest.approx(0.4)
    assert work.reads == 3
    assert work.read_blocks == pytest.approx(12)
    assert work.read_seconds == pytest.approx(0.06)


def test_a_part_with_no_requests_is_left_empty() -> None:
    work = work_between(Totals(3, 0.6, 900, 1500), Totals(3, 0.6, 900, 1500, 1, 0.01, 65536), 65536)
    assert (work.prefills, work.prefill_seconds, work.prefill_computed_tokens) == (0, 0, 0)
    assert (work.reads, work.read_blocks) == (1, 1)


def test_the_first_reading_is_a_baseline_and_each_next_adds_its_interval() -> None:
    meter = WorkMeter()
    meter.observe(Totals(10, 2.0, 3000, 3000), BYTES_PER_BLOCK)  # work done before we looked
    assert meter.take() is None
    meter.observe(Totals(12, 2.5, 3400, 3600), BYTES_PER_BLOCK)
    meter.observe(Totals(13, 2.7, 3500, 3800), BYTES_PER_BLOCK)  # two probes, one heartbeat
    work = meter.take()
    assert work is not None
    assert (work.prefills, work.prefill_computed_tokens, work.prefill_cached_tokens) == (
        3,
        500,
        300,
    )
    assert work.prefill_seconds == pytest.approx(0.7)
    assert meter.take() is None  # taken: reported once


def test_nothing_is_reported_for_an_interval_with_no_work() -> None:
    meter = WorkMeter()
    for _ in range(3):
        meter.observe(Totals(4, 1.0, 100, 100, 2, 0.1, 65536), BYTES_PER_BLOCK)
        assert meter.take() is None


def test_counters_that_go_back_reset_the_baseline() -> None:
    meter = WorkMeter()
    meter.observe(Totals(100, 20.0, 30_000, 30_000, 5, 0.5, 5 * 65536), BYTES_PER_BLOCK)
    # The engine restarted: its prefills began again, and it has read more since than the old
    # one had: no difference with the old reading means anything.
    meter.observe(Totals(2, 0.4, 600, 600, 8, 0.2, 8 * 65536), BYTES_PER_BLOCK)
    assert meter.take() is None
    meter.observe(Totals(3, 0.6, 900, 900, 9, 0.3, 10 * 65536), BYTES_PER_BLOCK)
    work = meter.take()
    assert work is not None
    assert (work.prefills, work.prefill_computed_tokens, work.reads, work.read_blocks) == (
        1,
        300,
        1,
        2,
    )


def test_an_unusable_reading_is_skipped_and_the_next_counts_both_intervals() -> None:
    meter = WorkMeter()
    meter.observe(totals_of(vllm_metrics(prefills=1, prefill_seconds=0.1)), BYTES_PER_BLOCK)
    meter.observe(totals_of("<html>502</html>"), BYTES_PER_BLOCK)
    meter.observe(totals_of(vllm_metrics(prefills=4, prefill_seconds=0.7)), BYTES_PER_BLOCK)
    work = meter.take()
    assert work is not None and work.prefills == 3
    assert work.prefill_seconds == pytest.approx(0.6)


@pytest.mark.parametrize(
    "bad",
    [
        'vllm:request_prefill_time_seconds_sum{engine="0"} NaN',
        'vllm:request_prefill_time_seconds_count{engine="0"} -1',
        'vllm:nixl_bytes_transferred_sum{engine="0"} +Inf',
    ],
)
def test_a_bad_total_costs_the_answer_its_totals_not_its_load(bad: str) -> None:
    parsed = parse_vllm_load(vllm_metrics(prefills=2, running=3) + bad + "\n")
    assert parsed.totals is None
    assert len(parsed.ignored) == 1 and bad.split("{", maxsplit=1)[0] in parsed.ignored[0]
    assert parsed.load.running_requests == 3


def test_calibration_reads_the_same_totals() -> None:
    text = vllm_metrics(reads=10, read_seconds=0.5, read_bytes=16 * BYTES_PER_BLOCK)
    assert read_cost_us_per_block(text, BYTES_PER_BLOCK) == pytest.approx(0.5e6 / 16)
    assert read_cost_us_per_block(vllm_metrics(), BYTES_PER_BLOCK) is None


def assert_sendable(work: node_pb2.EngineWork) -> None:
    assert node_pb2.EngineWork.FromString(work.SerializeToString()) == work
    for _, value in work.ListFields():
        assert math.isfinite(value) and value >= 0


_TOTALS = st.builds(
    Totals,
    *(
        [st.floats(0, 2**53, allow_nan=False)] * 7  # any figures the parser lets through
    ),
)


@given(st.lists(st.one_of(st.none(), _TOTALS), max_size=8), st.integers(0, 2**20))
def test_any_readings_give_sendable_work(
    readings: list[Totals | None], bytes_per_block: int
) -> None:
    meter = WorkMeter()
    for totals in readings:
        meter.observe(totals, bytes_per_block)
        work = meter.take()
        if work is not None:
            assert_sendable(work)
            assert work.prefills > 0 or work.reads > 0


_NAMES = st.sampled_from(
    [
        "vllm:request_prefill_time_seconds_sum",
        "vllm:request_prefill_time_seconds_count",
        "vllm:request_prefill_kv_computed_tokens_sum",
        "vllm:nixl_xfer_time_seconds_count",
        "vllm:nixl_bytes_transferred_sum",
        "vllm:num_requests_running",
    ]
)
_VALUES = st.floats(allow_nan=True, allow_infinity=True) | st.integers(-(2**70), 2**70).map(float)


@given(st.lists(st.lists(st.tuples(_NAMES, _VALUES), max_size=6), max_size=4))
def test_any_answers_give_sendable_work_and_every_bad_total_is_named(
    answers: list[list[tuple[str, float]]],
) -> None:
    meter = WorkMeter()
    for samples in answers:
        text = "".join(
            f'{name}{{engine="{i}"}} {value!r}\n' for i, (name, value) in enumerate(samples)
        )
        parsed = parse_vllm_load(text)
        bad = [
            n
            for n, v in samples
            if n.endswith(("_sum", "_count")) and not (v >= 0 and math.isfinite(v))
        ]
        assert (parsed.totals is None) == bool(bad)
        assert all(any(name in why for why in parsed.ignored) for name in bad)
        meter.observe(parsed.totals, BYTES_PER_BLOCK)
        work = meter.take()
        if work is not None:
            assert_sendable(work)


@given(st.text())
def test_any_text_gives_usable_totals_or_none(text: str) -> None:
    totals = parse_vllm_load(text).totals
    meter = WorkMeter()
    meter.observe(totals, BYTES_PER_BLOCK)
    meter.observe(totals, BYTES_PER_BLOCK)
    assert meter.take() is None  # the same reading twice: no work between
