"""Leader and follower behind one interface (``controlplane/api/interface.py``): the leader's
``Registry`` and a follower's ``Forwarder`` implement the same ``RegistryApi``, and a forwarder
against a real leader on loopback answers each call with the records the leader's registry
gives (``records.answers``, converted at the edge by ``api.convert``), passes on what only the
leader knows (its heartbeat pace) and relays the leader's typed errors."""

from __future__ import annotations

import asyncio
import inspect
from dataclasses import dataclass, field, replace

import grpc
import pytest

from kvbroker.common.client.grpc_client import RegistryCallError, RegistryEndpoint, open_channel
from kvbroker.common.rules.costs import Costs
from kvbroker.controlplane.api import convert
from kvbroker.controlplane.api.forwarder import Forwarder
from kvbroker.controlplane.api.interface import HintFeed, RegistryApi
from kvbroker.controlplane.config import RegistryConfig
from kvbroker.controlplane.errors import NoLeader
from kvbroker.controlplane.metrics import RegistryMetrics
from kvbroker.controlplane.records.answers import LeaseAnswer, NodeAnswer
from kvbroker.controlplane.records.model import Conversation, CostProfile, EngineWork, NodeLoad
from kvbroker.controlplane.registry import Registry
from kvbroker.controlplane.server import RunningRegistry
from kvbroker.testing.factories import block_hashes, handle, node_spec
from kvbroker.v1 import lease_pb2, node_pb2, registry_pb2, registry_pb2_grpc
from kvbroker.v1.registry_pb2_grpc import RegistryServiceStub

# A pace unlike the defaults, so that a follower passing on its own would show.
PACED = RegistryConfig(heartbeat_interval_s=0.7, session_ttl_s=4.5)


@dataclass
class Following:
    """A follower's leadership: the leader it forwards to (None: none is known), and the
    reasons its cache was asked for a hint."""

    stub: RegistryServiceStub | None
    metrics: RegistryMetrics = field(default_factory=RegistryMetrics)
    cache_asked: list[str] = field(default_factory=list)

    @property
    def registry(self) -> Registry | None:
        return None

    def leader_stub(self) -> RegistryServiceStub | None:
        return self.stub

    # No copy of the leader's state: every hint is the leader's (or, without one, the cache's).
    address = "follower"

    @property
    def leader_address(self) -> str | None:
        return "leader"

    def local_hint(self, conversation_id: str, model: str) -> registry_pb2.RoutingHint | None:
        return None

    def hint_feed(self) -> HintFeed | None:
        return None

    async def cached_hint(
        self, conversation_id: str, model: str, why: str
    ) -> registry_pb2.RoutingHint:
        self.cache_asked.append(why)
        return registry_pb2.RoutingHint(consistency=registry_pb2.HINT_CONSISTENCY_DEGRADED)


def _calls(implementation: type) -> dict[str, inspect.Signature]:
    return {
        name: inspect.signature(getattr(implementation, name))
        for name in dir(RegistryApi)
        if not name.startswith("_")
    }


def test_leader_and_follower_implement_the_same_calls() -> None:
    assert _calls(Forwarder) == _calls(Registry)


@pytest.fixture
def registry_config() -> RegistryConfig:
    return PACED


async def test_a_follower_answers_as_the_leader(
    registry_server: RunningRegistry, stub: RegistryServiceStub
) -> None:
    leader = registry_server.registry
    assert leader is not None
    follower = Forwarder(Following(stub), timeout=5.0)
    spec = node_spec("decode-0")

    registration = await follower.register_node(spec)

    assert (registration.heartbeat_interval_s, registration.session_ttl_s) == (0.7, 4.5)
    assert wire(registration.node) == wire(await leader.get_node(spec.node_id))
    lease = await follower.grant_lease(
        "c", spec.node_id, spec.incarnation, handle("r", 64, spec), block_hashes(64), 64
    )
    held = await leader.get_lease(lease.lease_id)
    assert (lease.epoch, lease.handle) == (held.epoch, held.handle)
    # The leader's answers, rebuilt from its responses, are the records its registry gave.
    by_follower, by_leader = await follower.get_lease(lease.lease_id), held
    assert wire(replace(by_follower, time_to_live=None)) == wire(
        replace(by_leader, time_to_live=None)
    )
    assert wire(await follower.get_node(spec.node_id)) == wire(await leader.get_node(spec.node_id))
    assert wire(await follower.get_conversation("c")) == wire(await leader.get_conversation("c"))
    listed, _ = await follower.list_leases(node_id=spec.node_id)
    assert [listed_lease.lease_id for listed_lease in listed] == [lease.lease_id]
    renewed = await follower.renew_lease(conversation_id="c")
    revoked = await follower.revoke_lease(lease.lease_id, reason="closed")
    assert renewed.lease_id == revoked.lease_id == lease.lease_id
    assert revoked.state == lease_pb2.LEASE_STATE_REVOKED


async def test_a_follower_relays_the_leaders_typed_error(
    registry_server: RunningRegistry, stub: RegistryServiceStub
) -> None:
    follower = Forwarder(Following(stub), timeout=5.0)

    with pytest.raises(RegistryCallError) as raised:
        await follower.heartbeat("nobody", "x", True, NodeLoad())

    assert raised.value.code() == grpc.StatusCode.NOT_FOUND
    assert raised.value.reason == registry_pb2.ERROR_REASON_NODE_NOT_REGISTERED


async def test_without_a_leader_hints_come_from_the_cache_and_the_rest_fail() -> None:
    following = Following(stub=None)
    follower = Forwarder(following, timeout=5.0)

    hint = await follower.routing_hint("c", "m")
    batch = await follower.routing_hints([registry_pb2.GetRoutingHintRequest(model="m")])

    assert hint.consistency == registry_pb2.HINT_CONSISTENCY_DEGRADED
    assert batch.results[0].hint.consistency == registry_pb2.HINT_CONSISTENCY_DEGRADED
    assert len(following.cache_asked) == 2
    with pytest.raises(NoLeader):
        await follower.get_node("decode-0")


async def test_a_follower_passes_on_a_nodes_work_and_costs(
    registry_server: RunningRegistry, stub: RegistryServiceStub
) -> None:
    leader = registry_server.registry
    assert leader is not None
    follower = Forwarder(Following(stub), timeout=5.0)
    spec = node_spec("prefill-0", node_pb2.NODE_ROLE_PREFILL)
    await follower.register_node(spec)
    profile = CostProfile(Costs(5.0, 50.0, 0.0, 900.0, 900.0), calibrated_time=1.0)

    calibrated = await follower.set_cost_profile(spec.node_id, profile)
    # Four prefills of 400 tokens, each far slower than the profile predicts.
    work = EngineWork(prefills=4, prefill_computed_tokens=1600, prefill_seconds=4.0)
    beat = await follower.heartbeat(spec.node_id, spec.incarnation, True, NodeLoad(1, 2, 0.5), work)

    assert calibrated.cost == profile
    assert beat.load == NodeLoad(1, 2, 0.5)
    assert beat.cost_correction is not None and beat.cost_correction.prefill > 1.0
    assert wire(beat) == wire(await leader.get_node(spec.node_id))


def wire(answer: NodeAnswer | LeaseAnswer | Conversation | None) -> object:
    """An answer as it travels: a follower rebuilds the leader's records from responses whose
    times have nanosecond resolution, so they are compared at that resolution."""
    if isinstance(answer, NodeAnswer):
        return convert.node_message(answer)
    if isinstance(answer, LeaseAnswer):
        return convert.lease_message(answer)
    assert answer is not None
    return convert.conversation_message(answer)


class _Stalled(registry_pb2_grpc.RegistryServiceServicer):
    """A leader whose heartbeat never answers: the call is in flight when its channel closes."""

    def __init__(self) -> None:
        self.entered = asyncio.Event()

    async def Heartbeat(
        self, request: registry_pb2.HeartbeatRequest, context: grpc.aio.ServicerContext
    ) -> registry_pb2.HeartbeatResponse:
        self.entered.set()
        await asyncio.Event().wait()
        raise AssertionError("unreachable")


async def test_a_call_cut_off_by_a_change_of_leader_fails_as_no_leader() -> None:
    """A follower closes its channel to the leader when the leader it follows changes; grpc.aio
    then ends the calls in flight on it with a bare ``CancelledError``. That is a failed call
    (NO_LEADER, retried by the caller), never the server's CANCELLED."""
    leader = _Stalled()
    server = grpc.aio.server()
    registry_pb2_grpc.add_RegistryServiceServicer_to_server(leader, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        channel = open_channel(RegistryEndpoint.parse(f"127.0.0.1:{port}"))
        follower = Forwarder(Following(registry_pb2_grpc.RegistryServiceStub(channel)), 5.0)
        call = asyncio.create_task(follower.heartbeat("decode-0", "x", True, NodeLoad()))
        await asyncio.wait_for(leader.entered.wait(), 10)

        await channel.close()

        with pytest.raises(NoLeader):
            await asyncio.wait_for(call, 10)
    finally:
        await server.stop(None)
