"""Each turn's path (``controlplane/placement/planner.py``): the cost model alone, and as the
registry applies it to a hint (on a fake clock, no server)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvbroker.common.rules.clock import to_timestamp
from kvbroker.common.rules.costs import DEFAULT_COSTS, GPU_COSTS, Costs
from kvbroker.common.rules.labels import label
from kvbroker.controlplane.errors import InvalidArgument
from kvbroker.controlplane.placement import planner
from kvbroker.controlplane.placement.planner import PlannerConfig, Prefill, Turn, TurnRequest
from kvbroker.controlplane.records import codec
from kvbroker.controlplane.records.model import NodeLoad
from kvbroker.controlplane.records.requests import Heartbeat
from kvbroker.controlplane.registry import Registry
from kvbroker.v1 import lease_pb2, node_pb2, registry_pb2
from kvbroker_tools.harness.factories import node_spec
from tests.test_registry_unit import CONFIG, Harness

CFG = PlannerConfig()


def turn(retained: int, new: int, **rest: object) -> Turn:
    fields: dict[str, object] = {
        "retained_tokens": retained,
        "new_tokens": new,
        "block_size": 16,
        "decode_running": 0,
    }
    fields.update(rest)
    return Turn(**fields)  # type: ignore[arg-type]


def p(
    node_id: str = "p0", running: int = 0, cached: int = 0, costs: Costs = DEFAULT_COSTS
) -> Prefill:
    return Prefill(node_id, costs, running, cached)


def plan(t: Turn, *prefills: Prefill, config: PlannerConfig = CFG) -> planner.Plan:
    return planner.plan(t, prefills or (p(),), DEFAULT_COSTS, config)


def chosen(t: Turn, *prefills: Prefill, config: PlannerConfig = CFG) -> str:
    return label(registry_pb2.TurnPath, plan(t, *prefills, config=config).path)


def estimate(found: planner.Plan, path: int, prefill: str = "p0") -> planner.Estimate:
    return next(e for e in found.estimates if e.path == path and e.prefill_node_id in ("", prefill))


# GPU_COSTS' READ figures (the H200 table of issue 35) with a GPU prefill: an 8B-class model
# in vLLM on one H200, assumed at about 50k tokens/s (24k tokens in ~0.5 s; transformers eager
# took 1.05 s on the same GPU, docs/gpu-transfer.md).
H200_8B = replace(
    GPU_COSTS, prefill_fixed_ms=10.0, prefill_us_per_token=20.0, prefill_ns_per_token_context=0.5
)


def test_a_scattered_24k_read_on_gpus_is_recomputed_and_the_same_blocks_in_runs_are_read() -> None:
    """A 24k-token READ (1,536 blocks of 16) costs its runs on a GPU: scattered, ~0.8 s, more
    than recomputing the prompt; the same number of blocks in 24 runs of 64 (each turn's blocks
    together), ~17 ms."""
    scattered = tuple(range(0, 2 * 1536, 2))  # no two ids abut: 1,536 runs
    in_runs = tuple(b for start in range(0, 48 * 64, 128) for b in range(start, start + 64))
    assert len(in_runs) == len(scattered) == 1536
    # A 3,000-token tool result: over the decode node's local limit, so READ or RECOMPUTE.
    chosen_path = {}
    for name, ids in (("scattered", scattered), ("runs", in_runs)):
        t = turn(retained=24_576, new=3000, retained_block_ids=ids)
        found = planner.plan(t, [p(costs=H200_8B)], H200_8B, CFG)
        chosen_path[name] = label(registry_pb2.TurnPath, found.path)
        if name == "scattered":
            assert estimate(found, planner.READ).ttft_ms > 750
            assert estimate(found, planner.RECOMPUTE).ttft_ms < 600
        else:
            assert estimate(found, planner.READ).ttft_ms < 150
    assert chosen_path == {"scattered": "RECOMPUTE", "runs": "READ"}
    # Without the ids the READ is priced as scattered; on CPU engines runs cost nothing apart.
    unknown = planner.plan(turn(retained=24_576, new=3000), [p(costs=H200_8B)], H200_8B, CFG)
    assert unknown.path == planner.RECOMPUTE
    cpu = [
        estimate(plan(turn(retained=24_576, new=3000, retained_block_ids=ids)), planner.READ)
        for ids in (scattered, in_runs)
    ]
    assert cpu[0].ttft_ms == cpu[1].ttft_ms


def test_the_read_counts_the_runs_beyond_the_prefill_nodes_cache() -> None:
    # Blocks 0-3 abut, then each is alone: P caching the first 4 blocks leaves 4 lone ones.
    t = turn(retained=128, new=10, retained_block_ids=(0, 1, 2, 3, 10, 20, 30, 40))
    assert t.read_runs(0) == 5
    assert t.read_runs(4) == 4
    assert turn(retained=128, new=10).read_runs(0) is None
    lease = lease_pb2.Lease(
        lease_id="l-1",
        handle=lease_pb2.KvHandle(
            remote_request_id="d-1", remote_block_groups=[lease_pb2.BlockIdGroup(block_ids=[4, 5])]
        ),
    )
    assert codec.retained_block_ids(codec.lease_of(lease)) == (4, 5)
    assert codec.retained_block_ids(None) == ()
    # The H200 loopback run's 24,576-token READ in 1,445 runs took 719.7 ms (gpu-transfer.md).
    assert GPU_COSTS.read_ms(1536, 1445) == pytest.approx(719.7, rel=0.05)
    assert GPU_COSTS.read_ms(1536) == GPU_COSTS.read_ms(1536, 1536)  # unknown: scattered


def test_a_one_line_follow_up_moves_no_kv() -> None:
    assert chosen(turn(retained=3000, new=20)) == "DECODE_LOCAL"
    assert chosen(turn(retained=30_000, new=20)) == "DECODE_LOCAL"


def test_a_bulk_suffix_is_computed_on_the_prefill_node() -> None:
    found = plan(turn(3000, 4000))
    local = estimate(found, planner.DECODE_LOCAL)
    assert "over the decode node's local limit of 2048" in local.not_eligible
    assert found.path == planner.READ


def test_no_decode_local_when_the_holder_is_not_the_decode_node() -> None:
    assert chosen(turn(3000, 20, holder_decodes=False)) == "READ"


def test_too_little_retained_to_be_worth_a_read_is_recomputed() -> None:
    assert chosen(turn(retained=40, new=3000)) == "RECOMPUTE"


def test_a_busy_decode_node_sends_the_suffix_to_the_prefill_node() -> None:
    assert chosen(turn(3000, 1500)) == "DECODE_LOCAL"
    assert chosen(turn(3000, 1500, decode_running=4)) == "READ"


def test_slow_reads_make_recomputing_short_conversations_faster() -> None:
    slow_nixl = replace(DEFAULT_COSTS, read_fixed_ms=500.0)
    assert chosen(turn(300, 3000), p(costs=slow_nixl)) == "RECOMPUTE"


@given(
    retained=st.integers(0, 200_000),
    new=st.integers(1, 50_000),
    prefill_running=st.integers(0, 16),
    decode_running=st.integers(0, 16),
    cached=st.integers(0, 250_000),
)
def test_the_choice_is_the_cheapest_eligible_path(
    retained: int, new: int, prefill_running: int, decode_running: int, cached: int
) -> None:
    t = turn(retained, new, decode_running=decode_running)
    found = plan(t, p(running=prefill_running), p("p1", prefill_running, cached))
    eligible = [e for e in found.estimates if not e.not_eligible]
    assert [e.path for e in found.estimates].count(planner.DECODE_LOCAL) == 1
    assert {(e.path, e.prefill_node_id) for e in found.estimates} >= {
        (planner.READ, "p0"), (planner.RECOMPUTE, "p0"), (planner.READ, "p1"),
        (planner.RECOMPUTE, "p1"),
    }  # fmt: skip
    assert found.chosen == min(eligible, key=lambda e: e.ttft_ms)
    assert all(e.ttft_ms > 0 for e in found.estimates)
    # Never slower than what P1's own cache gives for free.
    assert found.chosen.ttft_ms <= estimate(found, planner.RECOMPUTE, "p1").ttft_ms


# ---------------------------------------------------------------------- P's own cache


def test_p_s_cache_shortens_recompute_to_what_lies_beyond_it() -> None:
    """P computed the last prompt (3,000 tokens); the holder retains it with the answer
    (3,200), and 40 new tokens follow: P computes 240 tokens after 3,000 cached ones."""
    t = turn(3200, 40)
    cold, warm = plan(t, p()), plan(t, p(cached=3000))
    recompute = estimate(warm, planner.RECOMPUTE)
    cached = 3000 // 16 * 16  # whole blocks only
    assert recompute.cached_tokens == cached
    assert recompute.ttft_ms == pytest.approx(
        DEFAULT_COSTS.prefill_ms(3240 - cached, cached) + DEFAULT_COSTS.read_ms(-(-3240 // 16))
    )
    assert recompute.ttft_ms < estimate(cold, planner.RECOMPUTE).ttft_ms / 5


def test_p_s_cache_shortens_a_read_to_the_blocks_beyond_it() -> None:
    t = turn(3200, 40)
    read = estimate(plan(t, p(cached=3000)), planner.READ)
    beyond = -(-3200 // 16) - 3000 // 16
    assert read.ttft_ms == pytest.approx(
        CFG.lease_check_ms
        + DEFAULT_COSTS.read_ms(beyond)
        + DEFAULT_COSTS.prefill_ms(40, 3200)
        + DEFAULT_COSTS.read_ms(-(-40 // 16))
    )


def test_a_read_that_brings_too_little_beyond_p_s_cache_is_refused() -> None:
    """As the prefill engine's own rule: 3,200 retained, 3,168 cached: 32 tokens to read."""
    read = estimate(plan(turn(3200, 40), p(cached=3168)), planner.READ)
    assert read.not_eligible == (
        "32 retained tokens beyond the prefill node's own cache are under the read threshold of 64"
    )


def test_p_s_cache_never_covers_the_whole_prompt() -> None:
    """vLLM computes at least the prompt's last token itself."""
    t = turn(0, 100)
    assert estimate(plan(t, p(cached=5000)), planner.RECOMPUTE).cached_tokens == 96


def test_nothing_retained_leaves_only_recompute() -> None:
    found = plan(turn(0, 3000), p(), p("p1", cached=2000))
    assert [e.path for e in found.estimates if not e.not_eligible] == [planner.RECOMPUTE] * 2
    assert estimate(found, planner.DECODE_LOCAL).not_eligible == planner.NOTHING_RETAINED
    assert (found.path, found.prefill_node_id) == (planner.RECOMPUTE, "p1")


def test_a_bulk_suffix_goes_to_the_prefill_node_that_caches_the_conversation() -> None:
    """The suffix is over D's local limit: P0 (least loaded) would read 3,200 tokens' blocks
    and P1, which prefilled the last turn, recomputes from its cache instead."""
    found = plan(turn(3200, 3000), p("p0"), p("p1", cached=3000))
    assert found.prefill_node_id == "p1"
    assert found.chosen.prefill_node_id == "p1"


def test_a_busy_caching_prefill_node_loses_to_an_idle_one() -> None:
    found = plan(turn(3200, 3000), p("p0"), p("p1", running=8, cached=3000))
    assert found.prefill_node_id == "p0"


def test_without_any_cache_the_least_loaded_candidate_keeps_the_turn() -> None:
    """Equal estimates: the first candidate (routing's least-loaded pick) wins the tie."""
    for first, second in (("p0", "p1"), ("p1", "p0")):
        found = plan(turn(3200, 3000), p(first), p(second))
        assert found.prefill_node_id == first


def test_decode_local_keeps_the_least_loaded_prefill_node() -> None:
    found = plan(turn(3200, 20), p("p0"), p("p1", cached=3000))
    assert (found.path, found.prefill_node_id) == (planner.DECODE_LOCAL, "p0")


def test_an_asked_path_is_taken_on_its_cheapest_prefill_node() -> None:
    t = turn(3200, 20)
    found = planner.plan(t, [p("p0"), p("p1", cached=3000)], DEFAULT_COSTS, CFG, planner.RECOMPUTE)
    assert (found.path, found.prefill_node_id) == (planner.RECOMPUTE, "p1")


def test_an_asked_read_that_cannot_be_taken_keeps_the_p_d_split() -> None:
    """READ under the threshold beyond P's cache: P computes, as vLLM's router would, though
    DECODE_LOCAL is cheaper; any other asked path falls back to the cheapest."""
    t = turn(3200, 16)
    prefills = [p(cached=3168)]
    asked = planner.plan(t, prefills, DEFAULT_COSTS, CFG, planner.READ)
    assert asked.path == planner.RECOMPUTE and asked.chosen.cached_tokens == 3168
    assert planner.plan(t, prefills, DEFAULT_COSTS, CFG).path == planner.DECODE_LOCAL
    far = turn(3200, 16, holder_decodes=False)
    assert planner.plan(far, prefills, DEFAULT_COSTS, CFG, planner.DECODE_LOCAL).path == (
        planner.RECOMPUTE
    )


def test_the_router_s_estimates_give_the_suffix() -> None:
    assert TurnRequest(prompt_tokens=3100, new_tokens=40).new_after(3000) == 40
    assert TurnRequest(prompt_tokens=3100).new_after(3000) == 100
    assert TurnRequest(prompt_tokens=2000).new_after(3000) == 1
    assert TurnRequest().new_after(3000) is None


def test_the_router_s_estimates_give_the_whole_prompt() -> None:
    assert TurnRequest(prompt_tokens=3100, new_tokens=40).prompt_after(3000) == 3100
    assert TurnRequest(new_tokens=40).prompt_after(3000) == 3040
    assert TurnRequest().prompt_after(3000) is None


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
    await h.registry.set_cost_profile("prefill-0", codec.cost_of(slow))
    hint = await reused(h, TurnRequest(prompt_tokens=4000, new_tokens=3900))
    assert hint.decision == registry_pb2.HINT_DECISION_RECOMPUTE
    assert hint.path == registry_pb2.TURN_PATH_RECOMPUTE
    assert "recomputing is estimated fastest" in hint.reason
    assert (await h.registry.get_lease(lease.lease_id)).state == lease_pb2.LEASE_STATE_ACTIVE


async def test_a_decode_local_turn_claims_nothing_and_a_read_claims() -> None:
    """No read happens on DECODE_LOCAL: its lease stays ACTIVE, so the holder may release it
    under pressure (a claim would keep it for the whole claim)."""
    h = Harness()
    await h.fleet()
    lease = await h.grant("conv-1", "req-1")
    local = await reused(h, TurnRequest(prompt_tokens=90, new_tokens=20))
    assert local.path == registry_pb2.TURN_PATH_DECODE_LOCAL
    assert (await h.registry.get_lease(lease.lease_id)).state == lease_pb2.LEASE_STATE_ACTIVE
    read = await reused(h, TurnRequest(wanted=registry_pb2.TURN_PATH_READ))
    assert read.path == registry_pb2.TURN_PATH_READ
    assert (await h.registry.get_lease(lease.lease_id)).state == lease_pb2.LEASE_STATE_CLAIMED


async def test_cost_profiles_are_checked_stored_and_survive_re_registration() -> None:
    h = Harness()
    await h.fleet()
    profile = node_pb2.CostProfile(prefill_fixed_ms=1.5, calibrated_time=to_timestamp(1.0))
    node = await h.registry.set_cost_profile("decode-0", codec.cost_of(profile))
    assert node.cost is not None and node.cost.costs.prefill_fixed_ms == 1.5
    for bad in (
        node_pb2.CostProfile(prefill_fixed_ms=float("nan"), calibrated_time=to_timestamp(1.0)),
        node_pb2.CostProfile(read_us_per_block=-1, calibrated_time=to_timestamp(1.0)),
        node_pb2.CostProfile(prefill_fixed_ms=1.0),  # not said when it was measured
    ):
        with pytest.raises(InvalidArgument):
            await h.registry.set_cost_profile("decode-0", codec.cost_of(bad))
    await h.registry.register_node(h.decode)  # the same engine again
    stored = (await h.registry.get_node("decode-0")).cost
    assert stored is not None and stored.costs.prefill_fixed_ms == 1.5
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
        Heartbeat(
            h.decode.node_id,
            h.decode.incarnation,
            True,
            NodeLoad(running_requests=1),
        )
    )
    await h.grant("conv-1", "req-1")  # that turn finished: its blocks are retained
    hint = await reused(h, TurnRequest(prompt_tokens=1600, new_tokens=1500), dry_run=True)
    assert hint.path == registry_pb2.TURN_PATH_DECODE_LOCAL
    assert h.registry.nodes.runtime["decode-0"].pending == 0


async def test_a_turn_on_the_decode_node_alone_is_no_load_on_a_prefill_node() -> None:
    h = Harness()
    await h.fleet()
    await h.grant("conv-1", "req-1")
    local = await reused(h, TurnRequest(prompt_tokens=90, new_tokens=20))
    assert local.path == registry_pb2.TURN_PATH_DECODE_LOCAL
    prefill = h.registry.nodes.runtime["prefill-0"]
    assert prefill.pending == 0
    bulk = await h.registry.routing_hint("conv-2", "", False, TurnRequest(prompt_tokens=4000))
    assert bulk.path == registry_pb2.TURN_PATH_RECOMPUTE
    assert prefill.pending == 1


async def test_the_registry_remembers_which_prefill_node_computed_each_prompt() -> None:
    """Set by a hint that sends the turn to a prefill node (not a dry run, not DECODE_LOCAL);
    counted only while that node is the same engine, caches prefixes, and is READY."""
    h = Harness()
    h.prefill.prefix_caching = True
    other = node_spec("prefill-1", node_pb2.NODE_ROLE_PREFILL, port=5702)
    other.prefix_caching = True
    await h.fleet()
    await h.registry.register_node(other)
    caches = h.registry.hints.prefill_caches

    def cached(conversation: str = "conv-1") -> tuple[str, int] | None:
        found = caches.cached(conversation, "", h.registry.nodes.runtime)
        return (found[0].node_id, found[1]) if found is not None else None

    await h.registry.routing_hint("conv-2", "", True, TurnRequest(prompt_tokens=3000))
    assert cached("conv-2") is None  # a dry run computes nothing
    first = await h.registry.routing_hint("conv-1", "", False, TurnRequest(prompt_tokens=3000))
    assert cached() == (first.prefill.node_id, 3000)
    await h.heartbeat(h.decode, h.prefill, other)  # the first turn's load is reported gone
    await h.grant("conv-1", "req-1")  # 64 tokens retained
    local = await reused(h, TurnRequest(prompt_tokens=90, new_tokens=20))
    assert local.path == registry_pb2.TURN_PATH_DECODE_LOCAL
    assert cached() == (first.prefill.node_id, 3000)  # as it was
    # The lease was consumed by that turn: the next recomputes, on the node that caches it.
    again = await reused(h, TurnRequest(prompt_tokens=3200), dry_run=True)
    assert (again.decision, again.path) == (
        registry_pb2.HINT_DECISION_RECOMPUTE, registry_pb2.TURN_PATH_RECOMPUTE,
    )  # fmt: skip
    assert again.prefill.node_id == first.prefill.node_id
    assert {e.prefill_node_id for e in again.estimates} >= {first.prefill.node_id}
    caching = h.prefill if first.prefill.node_id == h.prefill.node_id else other
    await h.registry.heartbeat(Heartbeat(caching.node_id, caching.incarnation, False, NodeLoad()))
    assert cached() is None  # not READY
    restarted = node_spec(caching.node_id, node_pb2.NODE_ROLE_PREFILL, port=5704)
    restarted.prefix_caching = True
    # Its sidecar ends the old engine's session, then registers the new one.
    await h.registry.deregister_node(caching.node_id, caching.incarnation)
    await h.registry.register_node(restarted)
    assert cached() is None  # a new engine: its cache is empty
