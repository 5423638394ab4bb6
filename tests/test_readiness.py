"""The sidecar's readiness rule (``sidecar.readiness``): the engine's own word counts at once,
a timeout only when repeated."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvbroker.sidecar.readiness import Probe, Readiness


def test_timeouts_take_the_node_out_only_when_repeated() -> None:
    readiness = Readiness(unready_after_timeouts=3)
    assert readiness.observe(Probe.HEALTHY)
    assert readiness.observe(Probe.TIMED_OUT)
    assert readiness.observe(Probe.TIMED_OUT)
    assert not readiness.observe(Probe.TIMED_OUT)
    assert not readiness.observe(Probe.TIMED_OUT)
    assert readiness.observe(Probe.HEALTHY)


def test_the_engines_own_word_counts_at_once() -> None:
    readiness = Readiness(unready_after_timeouts=3)
    assert not readiness.observe(Probe.TIMED_OUT)  # never seen healthy: not ready
    assert readiness.observe(Probe.HEALTHY)
    assert not readiness.observe(Probe.UNHEALTHY)
    assert not readiness.observe(Probe.TIMED_OUT)  # a timeout does not bring it back


@given(st.lists(st.sampled_from(list(Probe)), max_size=40), st.integers(1, 5))
def test_ready_exactly_when_the_last_answer_was_healthy_and_few_timeouts_followed(
    probes: list[Probe], threshold: int
) -> None:
    readiness = Readiness(unready_after_timeouts=threshold)
    last_answer: int | None = None  # index of the last probe that was not a timeout
    for i, probe in enumerate(probes):
        if probe is not Probe.TIMED_OUT:
            last_answer = i
        expected = (
            last_answer is not None
            and probes[last_answer] is Probe.HEALTHY
            and i - last_answer < threshold
        )
        assert readiness.observe(probe) == expected
