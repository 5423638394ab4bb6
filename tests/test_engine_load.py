"""Reading the engine's load off its /metrics (``sidecar.engine_load.parse_vllm_load``):
whatever the engine answers, the parser returns figures a heartbeat can carry, and says what it
ignored."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvbroker.sidecar.engine_load import parse_vllm_load
from kvbroker.v1 import node_pb2

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
USAGE = "vllm:kv_cache_usage_perc"
MAX_COUNT = 2**32 - 1


def body(*lines: str) -> str:
    return "".join(f"{line}\n" for line in lines)


def assert_sendable(load: node_pb2.NodeLoad) -> None:
    """The load fits its proto: it serialises, and a registry reads back what was meant."""
    assert node_pb2.NodeLoad.FromString(load.SerializeToString()) == load
    assert 0 <= load.running_requests <= MAX_COUNT
    assert 0 <= load.waiting_requests <= MAX_COUNT
    assert 0.0 <= load.kv_cache_usage <= 1.0


def test_a_good_answer_is_read() -> None:
    parsed = parse_vllm_load(
        body(
            f"# TYPE {RUNNING} gauge",
            f'{RUNNING}{{model_name="a"}} 3',
            f'{RUNNING}{{model_name="b"}} 2',
            f'{WAITING}{{model_name="a"}} 7',
            f'{USAGE}{{model_name="a"}} 0.25',
            f'{USAGE}{{model_name="b"}} 0.5',
        )
    )
    assert parsed.ignored == ()
    assert parsed.load == node_pb2.NodeLoad(
        running_requests=5, waiting_requests=7, kv_cache_usage=0.5
    )


@pytest.mark.parametrize(
    "text",
    [
        "<html><body><h1>502 Bad Gateway</h1></body></html>",
        '{"detail": "Internal Server Error"}',
        body(RUNNING + '{model_name="a} 1'),
        body(f"{RUNNING} one"),
        "\x00\xff\ufffd",
    ],
)
def test_a_body_that_is_not_prometheus_text_gives_no_figures(text: str) -> None:
    parsed = parse_vllm_load(text)
    assert parsed.load == node_pb2.NodeLoad()
    assert len(parsed.ignored) == 1 and "not Prometheus text" in parsed.ignored[0]


@pytest.mark.parametrize(
    "bad",
    [
        f"{RUNNING} NaN",
        f"{RUNNING} -3",
        f"{RUNNING} 4294967296",
        f"{RUNNING} 1e300",
        f"{RUNNING} +Inf",
        f"{RUNNING} -Inf",
        f"{USAGE} NaN",
        f"{USAGE} -0.5",
        f"{USAGE} 1.5",
        f"{USAGE} +Inf",
    ],
)
def test_a_figure_that_cannot_be_what_it_says_is_ignored_and_the_rest_kept(bad: str) -> None:
    parsed = parse_vllm_load(body(bad, f"{WAITING} 4", f"{USAGE} 0.125"))
    assert len(parsed.ignored) == 1 and bad.split(maxsplit=1)[0] in parsed.ignored[0]
    assert parsed.load.waiting_requests == 4
    assert parsed.load.kv_cache_usage == 0.125
    assert parsed.load.running_requests == 0
    assert_sendable(parsed.load)


def test_counts_that_add_up_beyond_the_field_saturate() -> None:
    parsed = parse_vllm_load(
        body(f'{RUNNING}{{model_name="a"}} {MAX_COUNT}', f'{RUNNING}{{model_name="b"}} 5')
    )
    assert parsed.ignored == ()
    assert parsed.load.running_requests == MAX_COUNT


@given(st.text())
def test_any_text_gives_sendable_figures(text: str) -> None:
    assert_sendable(parse_vllm_load(text).load)


_NAMES = st.sampled_from([RUNNING, WAITING, USAGE, "vllm:other_gauge"])
_VALUES = st.floats(allow_nan=True, allow_infinity=True) | st.integers(-(2**40), 2**40).map(float)


@given(st.lists(st.tuples(_NAMES, st.sampled_from(["a", "b", "c"]), _VALUES), max_size=12))
def test_any_figures_give_sendable_load_and_every_bad_one_is_named(
    samples: list[tuple[str, str, float]],
) -> None:
    text = body(*(f'{name}{{model_name="{model}"}} {value!r}' for name, model, value in samples))
    parsed = parse_vllm_load(text)
    assert_sendable(parsed.load)

    def fits(name: str, value: float) -> bool:
        top = {RUNNING: MAX_COUNT, WAITING: MAX_COUNT, USAGE: 1}.get(name)
        return top is None or (math.isfinite(value) and 0 <= value <= top)

    assert len(parsed.ignored) == sum(not fits(name, value) for name, _, value in samples)
    running = sum(int(v) for name, _, v in samples if name == RUNNING and fits(name, v))
    assert parsed.load.running_requests == min(running, MAX_COUNT)


def test_a_long_error_page_is_quoted_only_in_part() -> None:
    page = "<html>" + "x" * 100_000 + "</html>"
    (why,) = parse_vllm_load(page).ignored
    assert why.startswith("not Prometheus text") and len(why) < 300
