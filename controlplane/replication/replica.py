"""A registry replica over etcd: one replica leads, the others forward to it.

Who leads is an ``Election``; the term a replica wins is the fence its store writes under, so
a replica that lost the leader key can never write again, and the floor of the epochs it
grants, so they outrank every earlier leader's. A new leader reloads the nodes (unless its
followed cache has already seen its own election), and its holders' replays bring back the
leases, which are not written (``_lead``); a follower
keeps a watch-fed cache, forwards calls to the leader, and answers hints from its cache as
DEGRADED while no leader can be reached.

Hints that write nothing every replica answers itself: the leader streams its state to each
follower (``hint_state.HintFeed``), and a follower whose copy is at most ``hint_staleness_s``
behind answers from it (``local_hint``), else forwards. A follower re-serves its copy to
routers that keep their own (``hint_state.HintRelay``), so they need not all watch the
leader.

Whether a replica can serve is said to ``on_serving`` (the server's gRPC health) each time it
changes: it can while it leads, or while it follows a leader that a store it reaches names and
whose own health says it serves; not while the store is out of reach or nobody leads, when
every call but a hint would fail. The leader is asked because its key can name it when it
does not lead: etcd restores the key's lease when it restarts, so a leader that stepped down
while etcd was away is named until that lease expires.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import grpc
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvbroker.common.client.grpc_client import RegistryEndpoint, open_channel, registry_stub
from kvbroker.common.client.hint_watch import FollowedHints
from kvbroker.common.process.tasks import own_cancellation
from kvbroker.common.rules import routing
from kvbroker.common.rules.clock import MonotonicClock
from kvbroker.common.rules.fed_hints import EXACT, fed_hint
from kvbroker.controlplane.config import RegistryConfig
from kvbroker.controlplane.errors import NoReadyNode, StoreUnavailable
from kvbroker.controlplane.metrics import RegistryMetrics
from kvbroker.controlplane.placement.hints import cached_hint
from kvbroker.controlplane.records.validation import Validation
from kvbroker.controlplane.registry import Registry
from kvbroker.controlplane.replication.election import Election, Term
from kvbroker.controlplane.replication.hint_state import HintFeed, HintRelay, HintView
from kvbroker.controlplane.storage.etcd_store import EtcdStore
from kvbroker.v1 import registry_pb2
from kvbroker.v1.registry_pb2_grpc import RegistryServiceStub

log = structlog.get_logger("kvbroker.registry")


@dataclass(frozen=True)
class ReplicaOptions:
    # Where the other replicas reach this one (its gRPC address).
    advertise: str
    # The leader key's etcd lease: a dead leader is replaced within about this long. etcd
    # raises TTLs below its own minimum (2 s with default timing).
    election_ttl_s: int = 2
    # How replicas reach each other: the credentials a forwarded call carries (the shared
    # token, or a certificate whose common name is "replica") and the CA that signs their
    # server certificates. Its address is ignored.
    peers: RegistryEndpoint | None = None
    # How far behind the leader a follower's copy of its state may be for the follower to
    # answer a dry-run hint itself; further behind, it forwards the hint (docs/design.md,
    # "Hints on every replica", says why this bounds quality, not safety).
    hint_staleness_s: float = 1.0


class Replica:
    def __init__(
        self,
        store: EtcdStore,
        options: ReplicaOptions,
        config: RegistryConfig | None = None,
        metrics: RegistryMetrics | None = None,
        on_serving: Callable[[bool], Awaitable[None]] | None = None,
    ) -> None:
        self.store = store
        self.options = options
        self.election = Election(store.connection, store.leader_key, options.election_ttl_s)
        self.config = config or RegistryConfig()
        self.metrics = metrics or RegistryMetrics()
        self.clock = MonotonicClock().now
        # Set while this replica leads; the servicer serves from it.
        self.registry: Registry | None = None
        self.leader_address: str | None = None
        self._leader_channel: grpc.aio.Channel | None = None
        self._leader_stub: RegistryServiceStub | None = None
        self._leader_health: health_pb2_grpc.HealthStub | None = None
        self._deposed = asyncio.Event()
        self._turn = itertools.count()
        self._validate = Validation(self.config)
        # While leading: the stream of its state to the followers.
        self.feed: HintFeed | None = None
        # While following: the copy of the leader's state, and the task that keeps it.
        self._followed: FollowedHints[HintView] | None = None
        # While following: its copy re-served to routers that keep their own.
        self._relay = HintRelay()
        self._followed_task: asyncio.Task[None] | None = None
        # Whether it can serve, as last told to ``on_serving``.
        self._serving = False
        self._on_serving = on_serving

    # ------------------------------------------------------------ what the servicer asks

    def leader_stub(self) -> RegistryServiceStub | None:
        """The leader's stub while another replica leads; None while none is known."""
        return self._leader_stub if self.registry is None else None

    @property
    def address(self) -> str:
        return self.options.advertise

    def hint_feed(self) -> HintFeed | HintRelay | None:
        """The leader's own feed; a follower's copy of it (``HintRelay``), which refuses a
        watcher while the follower has none whole."""
        return self.feed if self.registry is not None else self._relay

    def local_hint(self, conversation_id: str, model: str) -> registry_pb2.RoutingHint | None:
        """A dry-run hint (``fed_hints.served_locally``) from this follower's copy of the
        leader's state; None when its copy is further behind than ``hint_staleness_s`` (or
        it has none), and the hint is the leader's to answer."""
        view = self._followed.view if self._followed is not None else None
        behind = view.clock.behind_s() if view is not None else math.inf
        self.metrics.hint_state_behind.set(behind)
        if view is None or behind > self.options.hint_staleness_s:
            self.metrics.follower_hints.labels("stale").inc()
            return None
        self._validate.hint(conversation_id, model)
        try:
            hint = fed_hint(view, conversation_id, model, next(self._turn))
        except routing.NoReadyNode as error:
            raise NoReadyNode(error.message) from error
        self.metrics.follower_hints.labels("local").inc()
        self.metrics.hint(hint.decision, hint.consistency == EXACT, hint.path)
        return hint

    async def cached_hint(
        self, conversation_id: str, model: str, why: str
    ) -> registry_pb2.RoutingHint:
        return await cached_hint(self.store, conversation_id, model, why, next(self._turn))

    # ------------------------------------------------------------ the election loop

    async def run(self) -> None:
        """Campaigns, leads or follows, until cancelled. The loop never ends on its own: a
        failure anywhere in it is logged and the loop starts over (no replica is left with no
        election running)."""
        await _until_cancelled(self._elect, "election", self.options.election_ttl_s / 4)

    async def _elect(self) -> None:
        poll_s = self.options.election_ttl_s / 4
        follower: asyncio.Task[None] | None = None
        try:
            while True:
                try:
                    leader = await self.election.observe()
                    term = (
                        await self.election.campaign(self.options.advertise)
                        if leader is None
                        else None
                    )
                except StoreUnavailable as error:
                    log.warning("election_failed", error=error.message)
                    await self._can_serve(False)
                    await asyncio.sleep(poll_s)
                    continue
                except Exception:  # the election loop must outlive anything
                    log.exception("election_error")
                    await self._can_serve(False)
                    await self.store.connection.reconnect()
                    await asyncio.sleep(poll_s)
                    continue
                if term is not None:
                    # A follower's cache that has seen its own election is complete: no reload.
                    current = await self.store.catch_up(term.revision, self.options.election_ttl_s)
                    if follower is not None:
                        follower.cancel()
                        await asyncio.gather(follower, return_exceptions=True)
                        follower = None
                    await self._lead(term, reload=not current)
                    continue
                self._follow_leader(leader)
                await self._can_serve(await self._leader_serves())
                if follower is None:
                    follower = asyncio.create_task(
                        _until_cancelled(self.store.follow, "follow", poll_s),
                        name="kvbroker-follow",
                    )
                await asyncio.sleep(poll_s)
        finally:
            if follower is not None:
                follower.cancel()
            self._follow_leader(None)

    async def _lead(self, term: Term, reload: bool) -> None:
        """Takes over, serves until the term cannot be kept, then steps down."""
        started = time.perf_counter()
        self.store.fence = term.revision
        self._deposed.clear()
        registry: Registry | None = None
        try:
            if reload:
                await self.store.load()
            registry = Registry(
                self.store,
                self.config,
                self.metrics,
                self.clock,
                on_store_failure=lambda error: self._deposed.set(),
                # A successor's revision is later: its epochs outrank every one granted before.
                term=term.revision,
            )
            await registry.restore()
            registry.start()
            self.registry = registry
            self._follow_leader(self.options.advertise)
            self.feed = HintFeed(self.store, self.clock)
            self.feed.start()
            await self._can_serve(True)
            took = time.perf_counter() - started
            self.metrics.leader.set(1)
            self.metrics.takeovers.inc()
            self.metrics.takeover_seconds.observe(took)
            log.info(
                "registry_leading",
                fence=term.revision,
                reloaded=reload,
                takeover_s=round(took, 3),
            )
            await self.election.keep_alive(term, self._deposed)
        except StoreUnavailable as error:
            log.warning("registry_leadership_failed", error=error.message)
        except Exception:  # step down and campaign again rather than die leading
            log.exception("registry_leadership_error")
        except asyncio.CancelledError:
            if own_cancellation():
                raise
            log.exception("registry_leadership_cut_off")
        finally:
            self.registry = None
            if self.feed is not None:
                await self.feed.close()
                self.feed = None
            await self._can_serve(False)
            self.store.fence = None
            self.metrics.leader.set(0)
            if registry is not None:
                await registry.stop()
            log.warning("registry_stepped_down", fence=term.revision)
            await self.election.resign(term)
            await self.store.connection.reconnect()

    async def _can_serve(self, serving: bool) -> None:
        if serving == self._serving:
            return
        self._serving = serving
        log.info("registry_health", serving=serving, leader=self.leader_address)
        if self._on_serving is not None:
            await self._on_serving(serving)

    async def _leader_serves(self) -> bool:
        """Whether another replica leads and its health says it serves (a leader key naming
        this replica is its own last term, not yet expired)."""
        if self._leader_health is None:
            return False
        try:
            answer = await self._leader_health.Check(
                health_pb2.HealthCheckRequest(), timeout=self.options.election_ttl_s / 2
            )
        except grpc.aio.AioRpcError:
            return False
        return bool(answer.status == health_pb2.HealthCheckResponse.SERVING)

    def _follow_leader(self, address: str | None) -> None:
        """Points forwarding at the leader (or at nobody)."""
        if address == self.leader_address:
            return
        self.leader_address = address
        channel, self._leader_channel = self._leader_channel, None
        self._leader_stub = self._leader_health = None
        if self._followed_task is not None:
            self._followed_task.cancel()
        self._followed = self._followed_task = None
        if channel is not None:
            asyncio.get_running_loop().create_task(channel.close())
        if address is not None and address != self.options.advertise:
            peers = self.options.peers or RegistryEndpoint([address])
            self._leader_channel = open_channel(peers.at(address))
            stub = self._leader_stub = registry_stub(self._leader_channel)
            self._leader_health = health_pb2_grpc.HealthStub(self._leader_channel)
            # A new copy for each leader: one term's state is never mixed with another's.
            followed = self._followed = FollowedHints(
                lambda: HintView(self.clock), self.options.election_ttl_s / 4, self._relay
            )
            self._followed_task = asyncio.get_running_loop().create_task(
                _until_cancelled(lambda: followed.run(stub), "hint_state", followed.retry_s),
                name="kvbroker-hint-state",
            )
            log.info("registry_following", leader=address)


async def _until_cancelled(step: Callable[[], Awaitable[None]], loop: str, pause_s: float) -> None:
    """Runs ``step`` again and again until this task is cancelled. A failure in it, or a
    ``CancelledError`` that is not this task's own cancellation (a call whose channel was closed
    under it: etcd calls make that a ``StoreUnavailable`` already, in ``EtcdConnection.call``;
    this guards the loops against any other call ended so), is logged and ``step`` starts over
    after ``pause_s``: a replica's loops never end without a word."""
    while True:
        try:
            await step()
        except asyncio.CancelledError:
            if own_cancellation():
                raise
            log.exception("replica_loop_cut_off", loop=loop)
        except Exception:
            log.exception("replica_loop_failed", loop=loop)
        else:
            log.error("replica_loop_ended", loop=loop)
        await asyncio.sleep(pause_s)
