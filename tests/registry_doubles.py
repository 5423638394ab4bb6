"""A follower replica for the registry-API tests: the one ``Leadership`` double, and a real
gRPC server that serves it (``serve``), so a test calls a follower as a client would
and the follower relays to a real leader on loopback.

The double leads nothing and keeps no copy of the leader's state: every hint is the leader's,
or, while no leader is known (``leader`` None) or reachable, its cache's (the real
``hints.cached_hint`` over ``cache``: empty, so it cannot route, unless a test fills it)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc

from kvbroker.controlplane.api.interface import HintFeed, Leadership
from kvbroker.controlplane.api.service import RegistryServicer, add_registry_service
from kvbroker.controlplane.metrics import RegistryMetrics
from kvbroker.controlplane.placement.hints import cached_hint
from kvbroker.controlplane.registry import Registry
from kvbroker.controlplane.storage.cached_store import MemoryStore
from kvbroker.controlplane.storage.store import Store
from kvbroker.v1 import registry_pb2
from kvbroker.v1.registry_pb2_grpc import RegistryServiceStub


@dataclass
class Following:
    """A follower's leadership: the leader it relays to (None: none is known), its cache, and
    the reasons its cache was asked for a hint."""

    leader: RegistryServiceStub | None
    cache: Store = field(default_factory=MemoryStore)
    metrics: RegistryMetrics = field(default_factory=RegistryMetrics)
    cache_asked: list[str] = field(default_factory=list)
    registry: Registry | None = None
    address = "follower"

    @property
    def leader_address(self) -> str | None:
        return "leader"

    def leader_stub(self) -> RegistryServiceStub | None:
        return self.leader

    def local_hint(self, conversation_id: str, model: str) -> registry_pb2.RoutingHint | None:
        return None

    def hint_feed(self) -> HintFeed | None:
        return None

    async def cached_hint(
        self, conversation_id: str, model: str, why: str
    ) -> registry_pb2.RoutingHint:
        self.cache_asked.append(why)
        return await cached_hint(self.cache, conversation_id, model, why, 0)

    def forwarded(self, outcome: str) -> float:
        """How many calls ended with ``outcome`` (``kvbroker_registry_forwarded_total``)."""
        value = self.metrics.registry.get_sample_value(
            "kvbroker_registry_forwarded_total", {"outcome": outcome}
        )
        return value or 0.0


@contextlib.asynccontextmanager
async def serve(
    leadership: Leadership, *interceptors: grpc.aio.ServerInterceptor
) -> AsyncIterator[str]:
    """A gRPC server on loopback serving the registry's calls as ``leadership`` says (a
    ``Following``, or a leader's ``Standalone``), as the registry's own server does
    (``add_registry_service``); yields its address."""
    server = grpc.aio.server(interceptors=interceptors)
    add_registry_service(RegistryServicer(leadership), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(0)
