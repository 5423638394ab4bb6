"""Placement hints answered in the router's own process (``--local-hints``), on real registry
replicas over a real etcd, real gRPC and a real router on loopback: the router keeps a copy of
the leader's hint state, re-served by the follower it reaches, and answers dry-run hints from
it with no registry computing one; hints it may not answer (the prompt's size said) are the
registry's; a copy that stops hearing from the leader (the follower's link to it held, the
follower gone) is used only up to ``hint_staleness_s``, then the registry is asked; and a
superseded lease such a copy offers is refused by the lease check before a read.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx
import pytest

from kvbroker.common.client.grpc_client import RegistryEndpoint
from kvbroker.common.process.local_etcd import LocalEtcd
from kvbroker.common.process.ports import free_port
from kvbroker.router.config import RouterConfig
from kvbroker.router.handlers import build_app
from kvbroker.router.local_hints import HintSource
from kvbroker.router.placement import HINT_SOURCE_HEADER
from kvbroker.router.proxy import Router
from kvbroker.v1 import lease_pb2, registry_pb2
from kvbroker_tools.harness.engine import serving
from kvbroker_tools.harness.factories import Heartbeats, grant
from tests.conftest import eventually
from tests.test_replica_hints import (
    DECODE,
    PREFILL,
    follower_hints,
    hints_answered,
    read_refusal,
    replicas,
)

pytestmark = pytest.mark.etcd


@dataclass
class LocalRouter:
    """A router serving on loopback with ``--local-hints``, watching ``registry``."""

    router: Router
    http: httpx.AsyncClient
    url: str

    async def place(self, conversation: str, **params: int) -> httpx.Response:
        """The placement endpoint's answer."""
        return await self.http.get(
            f"{self.url}/v1/placement", params={"session_id": conversation, **params}
        )

    async def hint(self, conversation: str) -> tuple[registry_pb2.RoutingHint, HintSource]:
        """The dry-run hint the placement endpoint answers by, with its lease, and who
        answered it."""
        request = registry_pb2.GetRoutingHintRequest(conversation_id=conversation, dry_run=True)
        return await self.router.dry_run_hint(request)

    def answered(self, answer: str) -> float:
        value = self.router.metrics.registry.get_sample_value(
            "kvbroker_router_local_hints_total", {"answer": answer}
        )
        return value or 0.0


@contextlib.asynccontextmanager
async def local_router(
    registry: str, staleness_s: float = 1.0, token: str | None = None
) -> AsyncIterator[LocalRouter]:
    config = RouterConfig(local_hints=True, hint_staleness_s=staleness_s, hint_timeout_s=30)
    router = Router(RegistryEndpoint.parse(registry, token=token), config)
    port = free_port()
    async with serving(build_app(router), port), httpx.AsyncClient(timeout=60) as http:
        yield LocalRouter(router, http, f"http://127.0.0.1:{port}")


async def offered_locally(router: LocalRouter, conversation: str, lease: lease_pb2.Lease) -> bool:
    """The router's copy offers ``lease``."""
    hint, source = await router.hint(conversation)
    return source is HintSource.LOCAL and hint.lease.epoch == lease.epoch


async def test_a_router_answers_placement_from_its_copy(etcd: LocalEtcd) -> None:
    """Watching the follower (which re-serves its copy of the leader's state), the router
    answers placement itself: the leader's answer (REUSE, the lease and epoch it holds), said
    as the router's, with neither replica computing a hint for it. A placement that says the
    prompt's size is the leader's planner's to weigh: the registry answers it."""
    async with (
        replicas(etcd) as pair,
        Heartbeats(pair.to_leader, PREFILL, DECODE),
        local_router(pair.follower.address) as router,
    ):
        lease = await grant(pair.to_leader, DECODE, "conv-1", "req-1")
        await eventually(lambda: offered_locally(router, "conv-1", lease), what="the copy")
        from_leader = await pair.to_leader.GetRoutingHint(
            registry_pb2.GetRoutingHintRequest(conversation_id="conv-1", dry_run=True), timeout=5
        )
        leader_before = hints_answered(pair.leader)
        follower_before = follower_hints(pair.follower, "local")
        local_before = router.answered("local")
        for _ in range(20):
            placed = await router.place("conv-1")
            assert placed.status_code == 200, placed.text
            assert placed.headers[HINT_SOURCE_HEADER] == "router"
            assert placed.json()["decision"] == "REUSE"
            assert placed.json()["decode"] == DECODE.node_id
            hint, _ = await router.hint("conv-1")
            assert (hint.decision, hint.consistency) == (
                from_leader.hint.decision,
                from_leader.hint.consistency,
            )
            assert hint.lease.lease_id == from_leader.hint.lease.lease_id == lease.lease_id
            assert hint.lease.epoch == lease.epoch
            assert 0 < hint.lease.time_to_live.ToNanoseconds() <= 300 * 10**9
        assert router.answered("local") == local_before + 40
        assert hints_answered(pair.leader) == leader_before
        assert follower_hints(pair.follower, "local") == follower_before

        sized = await router.place("conv-1", prompt_tokens=5000)
        assert sized.status_code == 200, sized.text
        assert sized.headers[HINT_SOURCE_HEADER] == "registry"
        assert router.answered("forwarded") == 1
        assert hints_answered(pair.leader) == leader_before + 1

        # A model no ready node serves: the router's copy says so, as the registry would.
        missing = await router.http.get(
            f"{router.url}/v1/placement", params={"session_id": "conv-1", "model": "none"}
        )
        assert missing.status_code == 503
        assert missing.json()["error"]["code"] == "no_ready_node"


async def test_a_router_whose_feed_is_held_asks_the_registry(etcd: LocalEtcd) -> None:
    """The follower's link to the leader held while the lease is superseded at the leader:
    the follower relays nothing, so the router's copy ages; up to a second behind the router
    answers from it (the old lease, which the read check refuses), past it never: it asks the
    registry, whose answer once the link is back is the leader's, with the new epoch."""
    async with (
        replicas(etcd, staleness_s=1.0) as pair,
        Heartbeats(pair.to_leader, PREFILL, DECODE),
        local_router(pair.follower.address, staleness_s=1.0) as router,
    ):
        first = await grant(pair.to_leader, DECODE, "conv-1", "req-1")
        await eventually(lambda: offered_locally(router, "conv-1", first), what="the copy")
        stale_before = router.answered("stale")
        pair.link.hold()
        second = await grant(pair.to_leader, DECODE, "conv-1", "req-2")
        assert second.epoch > first.epoch
        answers: list[tuple[registry_pb2.RoutingHint, HintSource]] = []

        async def keep_asking() -> None:
            while True:
                answers.append(await router.hint("conv-1"))
                # Paced: an answer from the copy never yields, and the replicas share this loop.
                await asyncio.sleep(0.01)

        asking = asyncio.create_task(keep_asking())
        try:
            await eventually(
                lambda: router.answered("stale") > stale_before, what="the copy a second behind"
            )
            held = len(answers)
            pair.link.release()
            await eventually(lambda: any(s is HintSource.STALE for _, s in answers[held:]))
        finally:
            asking.cancel()
            await asyncio.gather(asking, return_exceptions=True)
        superseded = await pair.to_leader.GetLease(
            registry_pb2.GetLeaseRequest(lease_id=first.lease_id), timeout=5
        )
        assert superseded.lease.end_cause == lease_pb2.LEASE_END_CAUSE_SUPERSEDED
        # Until the copy was a second behind: the old lease, which the check refuses.
        assert all(
            read_refusal(superseded.lease, hint.lease) is not None
            for hint, source in answers[:held]
            if source is HintSource.LOCAL
        )
        # From then on, nothing from the copy the link held: the registry's (the leader's)
        # answer, or the copy's once it caught up, with the new lease.
        for hint, _ in answers[held:]:
            assert (hint.decision, hint.lease.epoch) == (
                registry_pb2.HINT_DECISION_REUSE,
                second.epoch,
            )


async def test_a_router_whose_registry_is_gone_stops_answering(etcd: LocalEtcd) -> None:
    """The replica the router watches stops: the router's copy is dropped with its stream (a
    copy that missed events is never served), and placement is the registry's to answer:
    503 while it is gone."""
    async with (
        replicas(etcd) as pair,
        Heartbeats(pair.to_leader, PREFILL, DECODE),
        local_router(pair.follower.address, staleness_s=30.0) as router,
    ):
        lease = await grant(pair.to_leader, DECODE, "conv-1", "req-1")
        await eventually(lambda: offered_locally(router, "conv-1", lease), what="the copy")
        await pair.follower.stop(0)

        async def refused() -> bool:
            placed = await router.place("conv-1")
            if placed.status_code == 200:
                # Only until the router saw its stream break.
                assert placed.headers[HINT_SOURCE_HEADER] == "router"
                return False
            assert placed.status_code == 503, placed.text
            assert placed.json()["error"]["code"] == "registry_unavailable"
            return True

        await eventually(refused, what="placement refused with the registry gone")
        # Once broken, never served from the copy again, however long it may lag.
        local = router.answered("local")
        for _ in range(5):
            assert (await router.place("conv-1")).status_code == 503
        assert router.answered("local") == local


async def test_a_lagging_router_offers_only_what_the_read_check_refuses(
    etcd: LocalEtcd,
) -> None:
    """Allowed to lag (30 s), a router whose copy's feed is held answers from a copy that
    still holds the superseded lease: the lease check a prefill node makes before reading, on
    the leader's record of that lease, refuses it (superseded, and never claimed), so no read
    follows the stale hint."""
    async with (
        replicas(etcd, staleness_s=30.0) as pair,
        Heartbeats(pair.to_leader, PREFILL, DECODE),
        local_router(pair.follower.address, staleness_s=30.0) as router,
    ):
        first = await grant(pair.to_leader, DECODE, "conv-1", "req-1")
        await eventually(lambda: offered_locally(router, "conv-1", first), what="the copy")
        pair.link.hold()
        try:
            second = await grant(pair.to_leader, DECODE, "conv-1", "req-2")
            stale, source = await router.hint("conv-1")
            assert source is HintSource.LOCAL
            assert (stale.decision, stale.lease.epoch) == (
                registry_pb2.HINT_DECISION_REUSE,
                first.epoch,
            )
            current = await pair.to_leader.GetLease(
                registry_pb2.GetLeaseRequest(lease_id=stale.lease.lease_id), timeout=5
            )
            assert current.lease.end_cause == lease_pb2.LEASE_END_CAUSE_SUPERSEDED
            assert read_refusal(current.lease, stale.lease) is not None
        finally:
            pair.link.release()
        await eventually(lambda: offered_locally(router, "conv-1", second), what="caught up")
