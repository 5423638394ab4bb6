"""Runs of consecutive block ids per READ: the rule (``kvbroker.common.rules.fragmentation``),
the pairing vLLM's NIXL worker makes (``engine_ext.fragmentation``), and a READ queued by
vLLM's real scheduler counted into the connector's stats and its Prometheus histograms."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import REGISTRY
from vllm import SamplingParams
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request, RequestStatus

from kvbroker.common.client.engine_link import LeaseAnswer
from kvbroker.common.rules.fragmentation import ReadShape, paired_runs, read_shape, runs
from kvbroker.engine_ext.connector import NixlConnector
from kvbroker.engine_ext.connector_metrics import KvBrokerStats, read_blocks_key, read_runs_key
from kvbroker.engine_ext.fragmentation import D_TO_P, P_TO_D, direction_of, paired_ids
from kvbroker.engine_ext.vllm_compat import VllmConfig
from kvbroker_tools.bench.read_shapes import shape_totals, summarise_shapes, turn_shapes
from tests.test_connector_metrics import build_prom
from tests.test_connector_scheduler import (  # noqa: F401 - fixtures
    BLOCK_SIZE,
    WAIT_S,
    FakeLeaseLink,
    engine_config,
    link,
    prompt,
    real_scheduler,
    request_with_handle,
    scheduler,
)


@pytest.fixture
def vllm_config() -> VllmConfig:
    """A prefill engine as the stack runs it: vLLM reads a remote handle on a P leg only with
    bidirectional transfer on."""
    return engine_config(
        "kv_producer",
        prefix_caching=False,
        extra={
            "bidirectional_kv_xfer": True,
            "kvbroker_lease_check_timeout_s": WAIT_S,
            "kvbroker_idle_step_sleep_s": 0,
        },
    )


def plain_request(request_id: str, tokens: list[int]) -> Request:
    return Request(
        request_id=request_id,
        prompt_token_ids=tokens,
        sampling_params=SamplingParams(max_tokens=1),
        pooling_params=None,
    )


ids = st.lists(st.integers(min_value=0, max_value=64), max_size=40)


def test_runs_count_stretches_of_ids_each_the_previous_plus_one() -> None:
    assert runs([]) == 0
    assert runs([7]) == 1
    assert runs([3, 4, 5, 9, 10, 2]) == 3
    assert runs([5, 4, 3]) == 3  # descending ids do not abut in a READ's order


def test_a_paired_run_needs_both_sides_to_advance() -> None:
    # Both sides in runs, broken at different places: every break on either side counts.
    assert paired_runs([0, 1, 2, 3], [10, 11, 40, 41]) == 2
    assert paired_runs([0, 1, 7, 8], [10, 11, 12, 13]) == 2
    assert paired_runs([0, 1, 7, 8], [10, 11, 40, 13]) == 3
    assert paired_runs([], []) == 0
    with pytest.raises(ValueError, match="one to one"):
        paired_runs([1, 2], [3])
    assert read_shape([0, 1, 7, 8], [10, 11, 12, 20]) == ReadShape(4, 3, 2, 2)


@given(st.data())
def test_paired_runs_are_between_each_sides_runs_and_the_blocks(data: st.DataObject) -> None:
    source = data.draw(ids)
    destination = data.draw(
        st.lists(st.integers(0, 64), min_size=len(source), max_size=len(source))
    )
    paired = paired_runs(source, destination)
    assert max(runs(source), runs(destination)) <= paired <= len(source)
    assert paired <= runs(source) + runs(destination)  # each break is one side's break
    # Splitting a READ anywhere adds at most the one run the split starts.
    cut = data.draw(st.integers(0, len(source)))
    halves = paired_runs(source[:cut], destination[:cut]) + paired_runs(
        source[cut:], destination[cut:]
    )
    assert paired <= halves <= paired + 1


@given(st.integers(1, 200), st.integers(0, 1000), st.integers(0, 1000))
def test_one_range_on_each_side_is_one_run(count: int, first: int, second: int) -> None:
    assert paired_runs(range(first, first + count), range(second, second + count)) == 1


def test_the_remote_list_is_trimmed_from_its_start_to_the_local_blocks() -> None:
    # P's own prefix cache holds the first two blocks: vLLM reads the remote's last three.
    assert paired_ids([10, 11, 12, 13, 14], [3, 4, 9]) == ([12, 13, 14], [3, 4, 9])
    assert paired_ids([10, 11], [3, 4]) == ([10, 11], [3, 4])
    assert paired_ids([10], [3, 4]) == ([10], [3])
    assert paired_ids([10, 11], []) == ([], [])


def test_a_read_under_a_lease_is_d_to_p_and_a_prefill_handoff_p_to_d() -> None:
    assert direction_of({"kvbroker_lease_id": "l-1", "do_remote_decode": True}) == D_TO_P
    assert direction_of({"do_remote_prefill": True, "remote_block_ids": [[1]]}) == P_TO_D


def test_a_read_queued_by_vllms_scheduler_is_counted_and_exported(
    scheduler: Scheduler,  # noqa: F811
    link: FakeLeaseLink,  # noqa: F811
) -> None:
    connector = scheduler.connector
    assert isinstance(connector, NixlConnector)
    connector.get_kv_connector_stats()  # the first step's gauges
    request = request_with_handle("r-read", prompt(), remote_tokens=192, verified_tokens=160)
    scheduler.add_request(request)
    scheduler.schedule()
    link.checks[0][2].set_result(LeaseAnswer(True, "live"))
    scheduler.schedule()
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS

    stats = connector.get_kv_connector_stats()
    assert isinstance(stats, KvBrokerStats)
    blocks = 160 // BLOCK_SIZE
    # The handle's ids are 0..11, trimmed to the verified 10; a fresh pool allocates a range.
    assert stats.data[read_blocks_key(D_TO_P)] == [blocks]
    assert stats.data[read_runs_key(D_TO_P, "source")] == [1]
    assert stats.data[read_runs_key(D_TO_P, "paired")] == [
        stats.data[read_runs_key(D_TO_P, "destination")][0]
    ]
    assert stats.data[read_blocks_key(P_TO_D)] == []
    assert stats.reduce()["READ blocks d_to_p"] == blocks

    prom = build_prom()
    prom.observe(stats.to_dict(), 0)
    labels: dict[str, Any] = {"model_name": "m", "engine": "0", "direction": D_TO_P}
    assert REGISTRY.get_sample_value("kvbroker_read_blocks_sum", labels) == blocks
    assert REGISTRY.get_sample_value("kvbroker_read_blocks_count", labels) == 1
    assert REGISTRY.get_sample_value("kvbroker_read_runs_sum", {**labels, "side": "source"}) == 1
    assert REGISTRY.get_sample_value("kvbroker_read_runs_count", {**labels, "side": "paired"}) == 1


def test_a_turns_reads_are_the_difference_of_the_engines_histograms() -> None:
    def metrics(reads: int, blocks: int, runs: int) -> str:
        labels = 'model_name="m",engine="0",direction="d_to_p"'
        return "\n".join(
            [
                "# TYPE kvbroker_read_blocks histogram",
                f"kvbroker_read_blocks_count{{{labels}}} {reads}",
                f"kvbroker_read_blocks_sum{{{labels}}} {blocks}",
                "# TYPE kvbroker_read_runs histogram",
                *(
                    f'kvbroker_read_runs_sum{{{labels},side="{side}"}} {runs}'
                    for side in ("paired", "source", "destination")
                ),
                "",
            ]
        )

    before, after = shape_totals(metrics(2, 40, 10)), shape_totals(metrics(3, 72, 30))
    window = turn_shapes(before, after)
    assert window == {
        D_TO_P: {"reads": 1, "blocks": 32, "runs": 20, "source_runs": 20, "destination_runs": 20}
    }
    assert turn_shapes(after, after) == {}
    # Only windows with one READ of a direction count: theirs are that READ's figures.
    two = {D_TO_P: {**window[D_TO_P], "reads": 2.0}}
    summary = summarise_shapes([window, two, {}, window])
    assert summary == {
        D_TO_P: {
            "reads": 2,
            **{
                f"{key}_p{q}": window[D_TO_P][key]
                for key in window[D_TO_P]
                if key != "reads"
                for q in (50, 90)
            },
            "runs_per_block_p50": 20 / 32,
        }
    }


def test_a_reads_destination_blocks_are_put_in_ascending_order(vllm_config: VllmConfig) -> None:
    """vLLM frees a request's blocks last first and allocates from the head of the free
    queue: after a free, the READ's fresh destination comes in descending ids (10 runs for a
    source in one). The connector sorts them, in the block table and the queued READ alike."""
    small = real_scheduler(vllm_config, 16)  # 15 usable blocks
    try:
        connector = small.connector
        assert isinstance(connector, NixlConnector)
        fake = FakeLeaseLink()
        connector.link = fake
        filler = plain_request("filler", prompt(13 * BLOCK_SIZE - 8))
        small.add_request(filler)
        small.schedule()
        assert len(small.kv_cache_manager.get_block_ids("filler")[0]) == 13
        small.finish_requests("filler", RequestStatus.FINISHED_ABORTED)  # frees 13, 12, ..., 1
        free = small.kv_cache_manager.block_pool.free_block_queue.get_all_free_blocks()
        assert runs([block.block_id for block in free[:10]]) == 10  # what the READ gets

        request = request_with_handle("r-read", prompt(), remote_tokens=192, verified_tokens=160)
        small.add_request(request)
        small.schedule()
        fake.checks[0][2].set_result(LeaseAnswer(True, "live"))
        output = small.schedule()
        assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS

        table = small.kv_cache_manager.get_block_ids("r-read")[0]
        meta: Any = output.kv_connector_metadata
        sent = list(meta.reqs_to_recv["r-read"].local_block_ids[0])  # what the worker reads into
        assert sent == table == sorted(table) and len(table) == 160 // BLOCK_SIZE
        # Before the sort the free queue gave 13, 12, ..., 4: 10 runs; now one.
        stats = connector.get_kv_connector_stats()
        assert isinstance(stats, KvBrokerStats)
        assert stats.data[read_runs_key(D_TO_P, "destination")] == [1]
        assert stats.data[read_runs_key(D_TO_P, "paired")] == [1]
    finally:
        small.shutdown()
