"""Who serves a call: ``Leadership`` says whether this replica leads (its ``Registry``
serves) or which leader a follower relays to, and what a follower answers hints with itself
(its copy of the leader's state, its cache). ``replication.replica.Replica`` is the replica
over etcd, ``Standalone`` a registry that always leads.

The calls themselves have one implementer, the ``Registry``: a follower relays the request
whole (``api.forwarder``), so no second implementation of each call has to follow the first.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

from kvbroker.controlplane.errors import NoLeader
from kvbroker.controlplane.metrics import RegistryMetrics
from kvbroker.controlplane.registry import Registry
from kvbroker.v1 import registry_pb2
from kvbroker.v1.registry_pb2_grpc import RegistryServiceStub


class HintFeed(Protocol):
    """The leader's state as followers copy it."""

    def subscribe(self) -> AsyncIterator[registry_pb2.WatchHintStateResponse]: ...


class Leadership(Protocol):
    """Who serves: this process's registry while it leads, else the leader to relay to."""

    @property
    def registry(self) -> Registry | None: ...

    @property
    def metrics(self) -> RegistryMetrics: ...

    @property
    def address(self) -> str:
        """Where this replica serves ("": a standalone registry)."""
        ...

    @property
    def leader_address(self) -> str | None: ...

    def leader_stub(self) -> RegistryServiceStub | None: ...

    def local_hint(self, conversation_id: str, model: str) -> registry_pb2.RoutingHint | None:
        """A dry-run hint a follower answers itself (``fed_hints.served_locally``); None: the
        leader's to answer."""
        ...

    async def cached_hint(
        self, conversation_id: str, model: str, why: str
    ) -> registry_pb2.RoutingHint: ...

    def hint_feed(self) -> HintFeed | None:
        """Over etcd: the leader's state for its followers (``replication.hint_state.HintFeed``),
        or a follower's copy of it (``HintRelay``)."""
        ...


@dataclass
class Standalone:
    """One registry with the memory store: it always leads."""

    registry: Registry

    @property
    def metrics(self) -> RegistryMetrics:
        return self.registry.metrics

    address = ""
    leader_address = None

    def leader_stub(self) -> RegistryServiceStub | None:
        return None

    def local_hint(self, conversation_id: str, model: str) -> registry_pb2.RoutingHint | None:
        return None  # unreachable: a standalone registry always leads

    def hint_feed(self) -> HintFeed | None:
        return None

    async def cached_hint(
        self, conversation_id: str, model: str, why: str
    ) -> registry_pb2.RoutingHint:
        raise NoLeader(why)  # unreachable: a standalone registry always leads
