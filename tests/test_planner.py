"""Each turn's path (``controlplane/planner.py``): the cost model alone, and as the registry
applies it to a hint (on a fake clock, no server)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from controlplane import planner
from controlplane.errors import InvalidArgument
from controlplane.planner import PlannerConfig, Turn, TurnRequest
from controlplane.registry import Registry
from kvbroker.common.clock import to_timestamp
from kvbroker.common.costs import DEFAULT_COSTS
from kvbroker.common.labels import label
from kvbroker.v1 import lease_pb2, node_pb2, registry_pb2
from tests.test_registry_unit import CONFIG, Harness

CFG = PlannerConfig()


def turn(retained: int, new: int, **rest: object) -> Turn:
    fields: dict[str, object] = {
        "retained_tokens": retained,
        "new_tokens": new,
        "block_size": 16,
        "prefill_running": 0,
        "decode_running": 0,
    }
    fields.update(rest)
    return Turn(**fields)  # type: ignore[arg-type]


def chosen(t: Turn, config: PlannerConfig = CFG) -> str:
    return label(
        registry_pb2.TurnPath,
        planner.choose(planner.estimates(t, DEFAULT_COSTS, DEFAULT_COSTS, config)),
    )


def test_a_one_line_follow_up_moves_no_kv() -> None:
    assert chosen(turn(retained=3000, new=20)) == "DECODE_LOCAL"
    assert chosen(turn(retained=30_000, new=20)) == "DECODE_LOCAL"


def test_a_bulk_suffix_is_computed_on_the_prefill_node() -> None:
    found = planner.estimates(turn(3000, 4000), DEFAULT_COSTS, DEFAULT_COSTS, CFG)
    local = next(e for e in found if e.path == planner.DECODE_LOCAL)
    assert "over the decode node's local limit of 2048" in local.not_eligible
    assert planner.choose(found) == planner.READ


def test_no_decode_local_when_the_holder_is_not_the_decode_node() -> None:
    assert chosen(turn(3000, 20, holder_decodes=False)) == "READ"


def test_too_little_retained_to_be_worth_a_read_is_recomputed() -> None:
    assert chosen(turn(retained=40, new=3000)) == "RECOMPUTE"


def test_a_busy_decode_node_sends_the_suffix_to_the_prefill_node() -> None:
    assert chosen(turn(3000, 1500)) == "DECODE_LOCAL"
    assert chosen(turn(3000, 1500, decode_running=4)) == "READ"


def test_slow_reads_make_recomputing_short_conversations_faster() -> None:
    slow_nixl = replace(DEFAULT_COSTS, read_fixed_ms=500.0)
    found = planner.estimates(turn(300, 3000), slow_nixl, DEFAULT_COSTS, CFG)
    assert planner.choose(found) == planner.RECOMPUTE


@given(
    retained=st.integers(0, 200_000),
    new=st.integers(1, 50_000),
    prefill_running=st.integers(0, 16),
    decode_running=st.integers(0, 16),
)
def test_the_choice_is_the_cheapest_eligible_path(
    retained: int, new: int, prefill_running: int, decode_running: int
) -> None:
    t = turn(retained, new, prefill_running=prefill_running, decode_running=decode_running)
    found = planner.estimates(t, DEFAULT_COSTS, DEFAULT_COSTS, CFG)
    eligible = [e for e in found if not e.not_eligible]
    assert {e.path for e in found} == {planner.DECODE_LOCAL, planner.READ, planner.RECOMPUTE}
    assert planner.choose(found) == min(eligible, key=lambda e: e.ttft_ms).path
    assert all(e.ttft_ms > 0 for e in found)


def test_the_router_s_estimates_give_the_suffix() -> None:
    assert TurnRequest(prompt_tokens=3100, new_tokens=40).new_after(3000) == 40
    assert TurnRequest(prompt_tokens=3100).new_after(3000) == 100
    assert TurnRequest(prompt_tokens=2000).new_after(3000) == 1
    assert TurnRequest().new_after(3000) is None


# ---------------------------------------------------------------------- in the registry


async def reused(h: Harness, size: TurnRequest, dry_run: bool = False) -> registry_pb2.RoutingHint:
    return await h.registry.routing_hint("conv-1", "", dry_run, size)


async def test_the_hint_carries_the_path_and_the_estimates_behind_it() -> None:
    h = Harness()
    await h.fleet()
    await h.grant("conv-1", "req-1")  # 64 tokens retained
    short = await reused(h, TurnRequest(prompt_tokens=90, new_tokens=20), dry_run=True)
    assert short.decision == registry_pb2.HINT_DECISION_REUSE
    assert short.path == registry_pb2.TURN_PATH_DECODE_LOCAL
    assert short.decode.node_id == "decode-0"
    assert short.estimates[0].path == registry_pb2.TURN_PATH_DECODE_LOCAL
    assert len(short.estimates) == 3
    unknown = await reused(h, TurnRequest(), dry_run=True)
    assert (unknown.path, list(unknown.estimates)) == (registry_pb2.TURN_PATH_READ, [])


async def test_a_recompute_choice_claims_nothing() -> None:
    """With reads made slow by the prefill node's calibration, recomputing a short retained
    prefix wins: the hint says RECOMPUTE and the lease stays ACTIVE for a later turn."""
    h = Harness()
    await h.fleet()
    lease = await h.grant("conv-1", "req-1")
    slow = node_pb2.CostProfile(
        prefill_fixed_ms=5, prefill_us_per_token=50, read_fixed_ms=900, read_us_per_block=900,
        calibrated_time=to_timestamp(h.clock.t),
    )  # fmt: skip
    await h.registry.set_cost_profile("prefill-0", slow)
    hint = await reused(h, TurnRequest(prompt_tokens=4000, new_tokens=3900))
    assert hint.decision == registry_pb2.HINT_DECISION_RECOMPUTE
    assert hint.path == registry_pb2.TURN_PATH_RECOMPUTE
    assert "recomputing is estimated fastest" in hint.reason
    assert (await h.registry.get_lease(lease.lease_id)).state == lease_pb2.LEASE_STATE_ACTIVE


async def test_cost_profiles_are_checked_stored_and_survive_re_registration() -> None:
    h = Harness()
    await h.fleet()
    profile = node_pb2.CostProfile(prefill_fixed_ms=1.5, calibrated_time=to_timestamp(1.0))
    node = await h.registry.set_cost_profile("decode-0", profile)
    assert node.cost.prefill_fixed_ms == 1.5
    for bad in (
        node_pb2.CostProfile(prefill_fixed_ms=float("nan"), calibrated_time=to_timestamp(1.0)),
        node_pb2.CostProfile(read_us_per_block=-1, calibrated_time=to_timestamp(1.0)),
        node_pb2.CostProfile(prefill_fixed_ms=1.0),  # not said when it was measured
    ):
        with pytest.raises(InvalidArgument):
            await h.registry.set_cost_profile("decode-0", bad)
    await h.registry.register_node(h.decode)  # the same engine again
    assert (await h.registry.get_node("decode-0")).cost.prefill_fixed_ms == 1.5
    costs = h.registry.nodes.runtime["decode-0"].costs
    assert costs is not None and costs.prefill_fixed_ms == 1.5


def test_the_local_limit_is_a_registry_setting() -> None:
    config = replace(CONFIG, planner=PlannerConfig(max_local_prefill_tokens=10))
    assert Registry(Harness().store, config).config.planner.max_local_prefill_tokens == 10


async def test_a_turn_that_just_finished_does_not_count_as_load() -> None:
    """The holder's last heartbeat saw the previous turn running; its retention report since
    says it finished, so the next turn is not priced as if the holder were busy."""
    h = Harness()
    await h.fleet()
    await h.registry.heartbeat(
        h.decode.node_id, h.decode.incarnation, True, node_pb2.NodeLoad(running_requests=1)
    )
    await h.grant("conv-1", "req-1")  # that turn finished: its blocks are retained
    hint = await reused(h, TurnRequest(prompt_tokens=1600, new_tokens=1500), dry_run=True)
    assert hint.path == registry_pb2.TURN_PATH_DECODE_LOCAL
    assert h.registry.nodes.runtime["decode-0"].pending == 0
