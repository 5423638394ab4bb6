"""Keeping a copy of the leader's hint state current: ``FollowedHints`` subscribes to
``WatchHintState`` and starts over after each break, for a registry follower (whose copy holds
the registry's records) and for a router that answers dry-run hints in process
(``MessageHintView``: the stored messages themselves, as a router may not import the
registry's records).

A broken stream drops the copy: the next one starts from a snapshot, so a copy that missed
events is never served as current (``kvbroker.common.rules.fed_hints.FeedClock``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

import grpc
import structlog

from kvbroker.common.rules import routing
from kvbroker.common.rules.clock import from_timestamp
from kvbroker.common.rules.fed_hints import FeedClock
from kvbroker.v1 import lease_pb2, node_pb2, registry_pb2
from kvbroker.v1.registry_pb2_grpc import RegistryServiceStub

log = structlog.get_logger("kvbroker.hints")


class FedView(Protocol):
    clock: FeedClock

    def apply(self, message: registry_pb2.WatchHintStateResponse) -> None: ...


V = TypeVar("V", bound=FedView)


class FollowedHints(Generic[V]):
    """The current copy (``view``, None while there is none whole) of the feed behind a stub,
    kept by ``run``. ``relay`` is told every message applied and every break (a follower
    re-serves its copy: ``controlplane.replication.hint_state.HintRelay``)."""

    def __init__(self, new_view: Callable[[], V], retry_s: float, relay: Relay | None = None):
        self.view: V | None = None
        self._new_view = new_view
        self.retry_s = retry_s
        self._relay = relay
        # The code the last break was logged with: a break that repeats is logged once (a
        # credential refused the watch is refused every retry).
        self._logged: grpc.StatusCode | None = None

    async def run(self, stub: RegistryServiceStub) -> None:
        """Subscribes to the feed behind ``stub``, again after each break, until cancelled."""
        try:
            while True:
                view = self._new_view()
                try:
                    async for message in stub.WatchHintState(registry_pb2.WatchHintStateRequest()):
                        view.apply(message)
                        self._logged = None
                        if view.clock.complete:
                            self.view = view
                            if self._relay is not None:
                                self._relay.relay(message, view)
                except grpc.aio.AioRpcError as error:
                    if error.code() != self._logged:
                        log.info("hint_feed_broken", code=error.code().name, why=error.details())
                        self._logged = error.code()
                self._drop()
                await asyncio.sleep(self.retry_s)
        finally:
            self._drop()

    def _drop(self) -> None:
        self.view = None
        if self._relay is not None:
            self._relay.broken()


class Relay(Protocol):
    def relay(self, message: registry_pb2.WatchHintStateResponse, view: FedView) -> None: ...

    def broken(self) -> None: ...


class MessageHintView:
    """A router's copy of the leader's hint state: each record as the message the registry
    stores it as (``fed_hints.HintState``)."""

    def __init__(self, clock: FeedClock) -> None:
        self.clock = clock
        self._nodes: dict[str, node_pb2.Node] = {}
        self._conversations: dict[str, lease_pb2.Conversation] = {}
        self._leases: dict[str, lease_pb2.Lease] = {}
        self._routes: dict[str, routing.Routes[routing.RoutedNode[node_pb2.Node]]] = {}
        self._routed: dict[str, routing.RoutedNode[node_pb2.Node]] = {}

    def apply(self, message: registry_pb2.WatchHintStateResponse) -> None:
        for record in message.records:
            if record.kind == registry_pb2.HINT_RECORD_KIND_NODE:
                _set(self._nodes, record.id, record.record, node_pb2.Node)
                self._routes.clear()
                self._routed.pop(record.id, None)
            elif record.kind == registry_pb2.HINT_RECORD_KIND_CONVERSATION:
                _set(self._conversations, record.id, record.record, lease_pb2.Conversation)
            elif record.kind == registry_pb2.HINT_RECORD_KIND_LEASE:
                _set(self._leases, record.id, record.record, lease_pb2.Lease)
        self.clock.heard(from_timestamp(message.leader_time), message.snapshot_complete)

    def routes(self, model: str) -> routing.Routes[routing.RoutedNode[node_pb2.Node]]:
        """The ready nodes for ``model`` as the leader last said them (raises
        ``routing.NoReadyNode``); kept until a node record changes."""
        routes = self._routes.get(model)
        if routes is None:
            nodes = [routing.RoutedNode.of_record(node) for node in self._nodes.values()]
            routes = self._routes[model] = routing.candidates(nodes, model)
        return routes

    def node(self, node_id: str) -> routing.RoutedNode[node_pb2.Node] | None:
        routed = self._routed.get(node_id)
        if routed is None:
            node = self._nodes.get(node_id)
            if node is None:
                return None
            routed = self._routed[node_id] = routing.RoutedNode.of_record(node)
        return routed

    def conversation(self, conversation_id: str) -> lease_pb2.Conversation | None:
        return self._conversations.get(conversation_id)

    def lease(self, lease_id: str) -> lease_pb2.Lease | None:
        return self._leases.get(lease_id)

    def leader_now(self) -> float:
        return self.clock.leader_now()

    @staticmethod
    def expire_time(lease: lease_pb2.Lease) -> float:
        return from_timestamp(lease.expire_time)

    @staticmethod
    def generation(lease: lease_pb2.Lease) -> int:
        return lease.handle.remote_registration_generation

    @staticmethod
    def lease_into(lease: lease_pb2.Lease, into: lease_pb2.Lease) -> None:
        into.CopyFrom(lease)


R = TypeVar("R", node_pb2.Node, lease_pb2.Conversation, lease_pb2.Lease)


def _set(records: dict[str, R], ident: str, raw: bytes, kind: type[R]) -> None:
    """Sets one record to its stored bytes (empty: the record is gone)."""
    if raw:
        records[ident] = kind.FromString(raw)
    else:
        records.pop(ident, None)
