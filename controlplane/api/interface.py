"""The registry's calls as one typed interface, and who serves them.

``RegistryApi`` is every call the gRPC face makes: the leader's ``Registry`` implements it by
serving, a follower's ``Forwarder`` (``api.forwarder``) by calling the leader's RPC of the
same name, so the servicer turns a request into one call and its answer into one response
whichever replica it reached. ``Leadership`` says which of the two a call gets.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Protocol

from kvbroker.controlplane.errors import NoLeader
from kvbroker.controlplane.metrics import RegistryMetrics
from kvbroker.controlplane.placement.planner import UNSAID, TurnRequest
from kvbroker.controlplane.placement.prefix_match import PrefixMatch
from kvbroker.controlplane.records.answers import LeaseAnswer, NodeAnswer, Registration
from kvbroker.controlplane.records.model import Conversation, CostProfile, EngineWork, NodeLoad
from kvbroker.controlplane.registry import Registry
from kvbroker.v1 import lease_pb2, node_pb2, registry_pb2
from kvbroker.v1.registry_pb2_grpc import RegistryServiceStub


class RegistryApi(Protocol):
    """The registry's calls, as the leader serves them (``Registry``'s docstrings say what each
    does), in the records' own types (``records.answers``). Protobuf stays where it was
    measured to matter (``records.answers`` says which) and where the record itself keeps a
    message (a node's spec)."""

    async def register_node(self, spec: node_pb2.NodeSpec) -> Registration: ...

    async def heartbeat(
        self,
        node_id: str,
        incarnation: str,
        engine_ready: bool,
        load: NodeLoad,
        work: EngineWork | None = None,
    ) -> NodeAnswer: ...

    async def deregister_node(self, node_id: str, incarnation: str) -> NodeAnswer: ...

    async def drain_node(self, node_id: str) -> NodeAnswer: ...

    async def set_cost_profile(self, node_id: str, cost: CostProfile | None) -> NodeAnswer: ...

    async def get_node(self, node_id: str) -> NodeAnswer: ...

    async def list_nodes(self, role: int = 0, model: str = "") -> list[NodeAnswer]: ...

    async def grant_lease(
        self,
        conversation_id: str,
        node_id: str,
        incarnation: str,
        handle: lease_pb2.KvHandle,
        block_hashes: Sequence[bytes],
        token_count: int,
        ttl: float | None = None,
        block_hash_stride: int = 1,
    ) -> LeaseAnswer: ...

    async def renew_lease(
        self, lease_id: str = "", conversation_id: str = "", ttl: float | None = None
    ) -> LeaseAnswer: ...

    async def release_lease(
        self, lease_id: str, node_id: str, incarnation: str, reason: str
    ) -> LeaseAnswer: ...

    async def revoke_lease(
        self, lease_id: str = "", conversation_id: str = "", reason: str = ""
    ) -> LeaseAnswer: ...

    async def get_lease(self, lease_id: str) -> LeaseAnswer: ...

    async def list_leases(
        self,
        node_id: str = "",
        conversation_id: str = "",
        states: Sequence[int] = (),
        page_size: int = 0,
        page_token: str = "",
    ) -> tuple[list[LeaseAnswer], str]: ...

    async def get_conversation(self, conversation_id: str) -> Conversation: ...

    async def report_retention(
        self,
        node_id: str,
        incarnation: str,
        events: Sequence[registry_pb2.RetentionEvent],
        full_snapshot: bool,
    ) -> registry_pb2.ReportRetentionResponse: ...

    def watch_commands(
        self, node_id: str, incarnation: str
    ) -> AsyncIterator[registry_pb2.LeaseCommand]: ...

    async def routing_hint(
        self,
        conversation_id: str,
        model: str,
        dry_run: bool = False,
        asked: TurnRequest = UNSAID,
        time_remaining: float | None = None,
    ) -> registry_pb2.RoutingHint: ...

    async def routing_hints(
        self,
        requests: Sequence[registry_pb2.GetRoutingHintRequest],
        time_remaining: float | None = None,
    ) -> registry_pb2.BatchGetRoutingHintsResponse: ...

    async def match_prefix(
        self,
        node_id: str,
        conversation_id: str,
        model: str,
        block_size: int,
        probes: Sequence[bytes],
    ) -> PrefixMatch: ...

    async def end_read_pin(self, node_id: str, lease_id: str, pin_id: str) -> None: ...


class HintFeed(Protocol):
    """The leader's state as followers copy it."""

    def subscribe(self) -> AsyncIterator[registry_pb2.WatchHintStateResponse]: ...


class Leadership(Protocol):
    """Who serves: this process's registry while it leads, else the leader to forward to."""

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
        """A dry-run hint a follower answers itself (``hints.served_locally``); None: the
        leader's to answer."""
        ...

    async def cached_hint(
        self, conversation_id: str, model: str, why: str
    ) -> registry_pb2.RoutingHint: ...

    def hint_feed(self) -> HintFeed | None:
        """While this replica leads over etcd: its state for the followers
        (``replication.hint_state.HintFeed``)."""
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
