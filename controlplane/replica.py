"""A registry replica over etcd: one replica leads, the others forward to it.

Leadership is etcd's election recipe: the leader key is created in a transaction that succeeds
only if it does not exist, attached to an etcd lease that the leader keeps alive. Its create
revision is the fence every write compares against (``EtcdStore.commit``), so a replica that
lost the key can never write again, and expiry, grants and revocations happen exactly once.
A new leader reloads the store and rebuilds its deadlines before it serves (``takeover``); a
follower keeps a watch-fed cache, forwards calls to the leader, and answers hints from its
cache as DEGRADED while no leader can be reached.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from dataclasses import dataclass

import grpc
import structlog
from aetcd import rpc

from controlplane.config import RegistryConfig
from controlplane.errors import StoreUnavailable
from controlplane.etcd_store import ETCD_ERRORS, EtcdStore
from controlplane.hints import cached_hint
from controlplane.metrics import RegistryMetrics
from controlplane.registry import Registry
from kvbroker.common.clock import MonotonicClock
from kvbroker.common.grpc_client import RegistryEndpoint, open_channel, registry_stub
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
    # Replicas forward with the same bearer token clients present.
    token: str | None = None


class Replica:
    def __init__(
        self,
        store: EtcdStore,
        options: ReplicaOptions,
        config: RegistryConfig | None = None,
        metrics: RegistryMetrics | None = None,
    ) -> None:
        self.store = store
        self.options = options
        self.config = config or RegistryConfig()
        self.metrics = metrics or RegistryMetrics()
        self.clock = MonotonicClock().now
        # Set while this replica leads; the servicer serves from it.
        self.registry: Registry | None = None
        self.leader_address: str | None = None
        self._leader_channel: grpc.aio.Channel | None = None
        self._leader_stub: RegistryServiceStub | None = None
        self._deposed = asyncio.Event()
        self._turn = itertools.count()

    # ------------------------------------------------------------ what the servicer asks

    def leader_stub(self) -> RegistryServiceStub | None:
        """The leader's stub while another replica leads; None while none is known."""
        return self._leader_stub if self.registry is None else None

    async def cached_hint(
        self, conversation_id: str, model: str, why: str
    ) -> registry_pb2.RoutingHint:
        return await cached_hint(self.store, conversation_id, model, why, next(self._turn))

    # ------------------------------------------------------------ the election loop

    async def run(self) -> None:
        """Campaigns, leads or follows, until cancelled."""
        poll_s = self.options.election_ttl_s / 4
        follower: asyncio.Task[None] | None = None
        try:
            while True:
                try:
                    leader, fence, lease_id = await self._campaign()
                except Exception as error:  # the election loop must outlive anything
                    if isinstance(error, (StoreUnavailable, *ETCD_ERRORS)):
                        log.warning("election_failed", error=str(error))
                    else:
                        log.exception("election_error")
                    await self.store.reconnect()
                    await asyncio.sleep(poll_s)
                    continue
                if fence is not None and lease_id is not None:
                    # A follower's cache that has seen its own election is complete: no reload.
                    current = await self.store.catch_up(fence, self.options.election_ttl_s)
                    if follower is not None:
                        follower.cancel()
                        await asyncio.gather(follower, return_exceptions=True)
                        follower = None
                    await self._lead(fence, lease_id, reload=not current)
                    continue
                self._follow_leader(leader)
                if follower is None or follower.done():
                    follower = asyncio.create_task(self.store.follow(), name="kvbroker-follow")
                await asyncio.sleep(poll_s)
        finally:
            if follower is not None:
                follower.cancel()
            self._follow_leader(None)

    async def _campaign(self) -> tuple[str | None, int | None, int | None]:
        """(leader address, fence, etcd lease) — the last two only if this replica won."""
        client = await self.store.client()
        current = await client.get(self.store.leader_key)
        if current is not None:
            return current.value.decode(), None, None
        lease = await client.lease(self.options.election_ttl_s)
        response = await client.kvstub.Txn(
            rpc.TxnRequest(
                compare=[self.store.leader_key_created_at(0)],
                success=[
                    rpc.RequestOp(
                        request_put=rpc.PutRequest(
                            key=self.store.leader_key,
                            value=self.options.advertise.encode(),
                            lease=lease.id,
                        )
                    )
                ],
            ),
            timeout=self.store.timeout_s,
        )
        if not response.succeeded:
            await client.revoke_lease(lease.id)
            return None, None, None
        return self.options.advertise, response.header.revision, lease.id

    async def _lead(self, fence: int, lease_id: int, reload: bool) -> None:
        """Takes over, serves until the leader key's lease cannot be kept, then steps down."""
        started = time.perf_counter()
        self.store.fence = fence
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
            )
            await registry.restore()
            registry.start()
            self.registry = registry
            self._follow_leader(self.options.advertise)
            took = time.perf_counter() - started
            self.metrics.leader.set(1)
            self.metrics.takeovers.inc()
            self.metrics.takeover_seconds.observe(took)
            log.info("registry_leading", fence=fence, reloaded=reload, takeover_s=round(took, 3))
            await self._keep_alive(lease_id)
        except (StoreUnavailable, *ETCD_ERRORS) as error:
            log.warning("registry_leadership_failed", error=str(error))
        except Exception:  # step down and campaign again rather than die leading
            log.exception("registry_leadership_error")
        finally:
            self.registry = None
            self.store.fence = None
            self.metrics.leader.set(0)
            if registry is not None:
                await registry.stop()
            log.warning("registry_stepped_down", fence=fence)
            with contextlib.suppress(*ETCD_ERRORS):
                # Lets another replica take over at once rather than after the TTL.
                client = await self.store.client()
                await asyncio.wait_for(client.revoke_lease(lease_id), self.store.timeout_s)
            await self.store.reconnect()

    async def _keep_alive(self, lease_id: int) -> None:
        """Refreshes the leader key's lease; returns when it is lost or may be: a leader that
        has not refreshed for half the TTL stops serving before anyone else can take over."""
        ttl = self.options.election_ttl_s
        last_refresh = time.monotonic()
        while time.monotonic() - last_refresh < ttl / 2:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._deposed.wait(), ttl / 6)
            if self._deposed.is_set():
                return
            try:
                client = await self.store.client()
                reply = await asyncio.wait_for(client.refresh_lease(lease_id), ttl / 4)
            except (*ETCD_ERRORS, TimeoutError) as error:
                log.warning("leader_keepalive_failed", error=str(error))
                await self.store.reconnect()
                continue
            if reply is None or reply.TTL <= 0:
                return  # the lease is gone: someone else may lead already
            last_refresh = time.monotonic()

    def _follow_leader(self, address: str | None) -> None:
        """Points forwarding at the leader (or at nobody)."""
        if address == self.leader_address:
            return
        self.leader_address = address
        channel, self._leader_channel, self._leader_stub = self._leader_channel, None, None
        if channel is not None:
            asyncio.get_running_loop().create_task(channel.close())
        if address is not None and address != self.options.advertise:
            self._leader_channel = open_channel(
                RegistryEndpoint.parse(address, token=self.options.token)
            )
            self._leader_stub = registry_stub(self._leader_channel)
            log.info("registry_following", leader=address)
