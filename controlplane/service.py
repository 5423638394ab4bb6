"""The gRPC face of the registry: decode requests, call the Registry, map errors to statuses.

With replicas, a call reaches whichever replica the client's channel picked: the leader serves
it, a follower forwards it to the leader and relays the answer. While no leader can be reached
a follower answers hints from its cache (DEGRADED) and everything else with UNAVAILABLE.

This is the one place a domain error becomes a gRPC status: its code, its sentence, and its
reason in the trailing metadata (``errors.status_metadata``); a leader's error is relayed with
its reason intact.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from functools import wraps
from typing import Any, Protocol, TypeVar

import grpc
import structlog
from google.protobuf.message import DecodeError, Message
from google.protobuf.message_factory import GetMessageClass

from kvbroker.common.clock import from_duration, to_duration
from kvbroker.common.grpc_client import from_grpc_error
from kvbroker.controlplane.errors import (
    InvalidArgument,
    NoLeader,
    RegistryError,
    hint_error,
    status_metadata,
)
from kvbroker.controlplane.identity import Credentials, authorize, hide_incarnations
from kvbroker.controlplane.metrics import RegistryMetrics
from kvbroker.controlplane.planner import TurnRequest
from kvbroker.controlplane.registry import Registry
from kvbroker.v1 import registry_pb2, registry_pb2_grpc
from kvbroker.v1.registry_pb2_grpc import RegistryServiceStub

log = structlog.get_logger("kvbroker.registry")

Req = TypeVar("Req")
Resp = TypeVar("Resp")
Handler = Callable[[Any, Registry, Req, grpc.aio.ServicerContext], Awaitable[Resp]]
Served = Callable[[Any, Req, grpc.aio.ServicerContext], Awaitable[Resp]]

# A forwarded call waits at most this long for the leader (less if the caller's deadline is).
FORWARD_TIMEOUT_S = 5.0
_LEADER_UNREACHABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
# Answered from a follower's cache (DEGRADED) while no leader can be reached.
_HINT_METHODS = frozenset({"GetRoutingHint", "BatchGetRoutingHints"})


class Leadership(Protocol):
    """Who serves: this process's registry while it leads, else the leader to forward to."""

    @property
    def registry(self) -> Registry | None: ...

    @property
    def metrics(self) -> RegistryMetrics: ...

    def leader_stub(self) -> RegistryServiceStub | None: ...

    async def cached_hint(
        self, conversation_id: str, model: str, why: str
    ) -> registry_pb2.RoutingHint: ...


@dataclass
class Standalone:
    """One registry with the memory store: it always leads."""

    registry: Registry

    @property
    def metrics(self) -> RegistryMetrics:
        return self.registry.metrics

    def leader_stub(self) -> RegistryServiceStub | None:
        return None

    async def cached_hint(
        self, conversation_id: str, model: str, why: str
    ) -> registry_pb2.RoutingHint:
        raise NoLeader(why)  # unreachable: a standalone registry always leads


async def _abort(
    context: grpc.aio.ServicerContext, error: RegistryError | grpc.aio.AioRpcError
) -> None:
    """Fails the call with ``error``'s status: a RegistryError's own, or a leader's relayed as
    it came, reason included."""
    if isinstance(error, RegistryError):
        code, status = error.code, hint_error(error)
    else:
        relayed = from_grpc_error(error)
        code, status = relayed.code(), relayed.status()
    await context.abort(code, status.message, trailing_metadata=status_metadata(status))


def _served(handler: Handler[Req, Resp]) -> Served[Req, Resp]:
    """Serves on the leader or forwards to it; a RegistryError becomes its status, a leader's
    error is relayed."""
    method = handler.__name__

    @wraps(handler)
    async def wrapped(
        self: RegistryServicer, request: Req, context: grpc.aio.ServicerContext
    ) -> Resp:
        try:
            # Authorized here, where the call entered: a forwarded call reaches the leader
            # with this replica's credential.
            principal = self.credentials.principal(context)
            authorize(principal, method, request)
            registry = self.leadership.registry
            if registry is not None:
                response = await handler(self, registry, request, context)
            else:
                response = await self._forward(method, request, context)
            hide_incarnations(principal, response)
            return response
        except (RegistryError, grpc.aio.AioRpcError) as error:
            await _abort(context, error)
            raise  # unreachable: abort raises

    return wrapped


def _ttl(message: Any) -> float | None:
    return from_duration(message.time_to_live) if message.HasField("time_to_live") else None


class RegistryServicer(registry_pb2_grpc.RegistryServiceServicer):
    def __init__(self, leadership: Leadership, credentials: Credentials | None = None) -> None:
        self.leadership = leadership
        self.credentials = credentials or Credentials()

    async def _forward(self, method: str, request: Any, context: grpc.aio.ServicerContext) -> Any:
        stub = self.leadership.leader_stub()
        outcomes = self.leadership.metrics.forwarded
        if stub is None:
            outcomes.labels("no_leader").inc()
            return await self._leaderless(method, request, "no replica leads (election pending)")
        remaining = context.time_remaining()
        timeout = min(remaining, FORWARD_TIMEOUT_S) if remaining else FORWARD_TIMEOUT_S
        try:
            response = await getattr(stub, method)(request, timeout=timeout)
        except grpc.aio.AioRpcError as error:
            failure = from_grpc_error(error)
            # The leader's word that no node is ready is an answer, not the leader's absence.
            leader_away = (
                failure.code() in _LEADER_UNREACHABLE
                and failure.reason != registry_pb2.ERROR_REASON_NO_READY_NODE
            )
            if not leader_away or method not in _HINT_METHODS:
                outcomes.labels("relayed_error").inc()
                raise failure from error
            outcomes.labels("leader_unreachable").inc()
            return await self._leaderless(method, request, f"leader: {error.details()}")
        outcomes.labels("ok").inc()
        return response

    async def _leaderless(self, method: str, request: Any, why: str) -> Any:
        if method == "GetRoutingHint":
            hint = await self.leadership.cached_hint(request.conversation_id, request.model, why)
            return registry_pb2.GetRoutingHintResponse(hint=hint)
        if method == "BatchGetRoutingHints":
            response = registry_pb2.BatchGetRoutingHintsResponse()
            for item in request.requests:
                try:
                    hint = await self.leadership.cached_hint(item.conversation_id, item.model, why)
                    response.results.add().hint.CopyFrom(hint)
                except RegistryError as error:
                    response.results.add().error.CopyFrom(hint_error(error))
            return response
        raise NoLeader(f"{why}; retry shortly")

    @_served
    async def RegisterNode(
        self,
        registry: Registry,
        request: registry_pb2.RegisterNodeRequest,
        context: grpc.aio.ServicerContext,
    ) -> registry_pb2.RegisterNodeResponse:
        node = await registry.register_node(request.spec)
        config = registry.config
        return registry_pb2.RegisterNodeResponse(
            node=node,
            heartbeat_interval=to_duration(config.heartbeat_interval_s),
            session_ttl=to_duration(config.session_ttl_s),
        )

    @_served
    async def Heartbeat(
        self,
        registry: Registry,
        request: registry_pb2.HeartbeatRequest,
        context: grpc.aio.ServicerContext,
    ) -> registry_pb2.HeartbeatResponse:
        node = await registry.heartbeat(
            request.node_id,
            request.incarnation,
            request.engine_ready,
            request.load,
            request.work if request.HasField("work") else None,
        )
        return registry_pb2.HeartbeatResponse(node=node)

    @_served
    async def DeregisterNode(
        self,
        registry: Registry,
        request: registry_pb2.DeregisterNodeRequest,
        context: grpc.aio.ServicerContext,
    ) -> registry_pb2.DeregisterNodeResponse:
        node = await registry.deregister_node(request.node_id, request.incarnation)
        return registry_pb2.DeregisterNodeResponse(node=node)

    @_served
    async def GetNode(
        self,
        registry: Registry,
        request: registry_pb2.GetNodeRequest,
        context: grpc.aio.ServicerContext,
    ) -> registry_pb2.GetNodeResponse:
        return registry_pb2.GetNodeResponse(node=await registry.get_node(request.node_id))

    @_served
    async def ListNodes(
        self,
        registry: Registry,
        request: registry_pb2.ListNodesRequest,
        context: grpc.aio.ServicerContext,
    ) -> registry_pb2.ListNodesResponse:
        nodes = await registry.list_nodes(request.role, request.model)
        return registry_pb2.ListNodesResponse(nodes=nodes)

    @_served
    async def DrainNode(
        self,
        registry: Registry,
        request: registry_pb2.DrainNodeRequest,
        context: grpc.aio.ServicerContext,
    ) -> registry_pb2.DrainNodeResponse:
        return registry_pb2.DrainNodeResponse(node=await registry.drain_node(request.node_id))

    @_served
    async def GrantLease(
        self,
        registry: Registry,
        request: registry_pb2.GrantLeaseRequest,
        context: grpc.aio.ServicerContext,
    ) -> registry_pb2.GrantLeaseResponse:
        lease = await registry.grant_lease(
            request.conversation_id,
            request.node_id,
            request.node_incarnation,
            request.handle,
            request.block_hashes,
            request.token_count,
            _ttl(request),
            request.block_hash_stride,
        )
        return registry_pb2.GrantLeaseResponse(lease=lease)

    @_served
    async def RenewLease(
        self,
        registry: Registry,
        request: registry_pb2.RenewLeaseRequest,
        context: grpc.aio.ServicerContext,
    ) -> registry_pb2.RenewLeaseResponse:
        lease = await registry.renew_lease(request.lease_id, request.conversation_id, _ttl(request))
        return registry_pb2.RenewLeaseResponse(lease=lease)

    @_served
    async def ReleaseLease(
        self,
        registry: Registry,
        request: registry_pb2.ReleaseLeaseRequest,
        context: grpc.aio.ServicerContext,
    ) -> registry_pb2.ReleaseLeaseResponse:
        lease = await registry.release_lease(
            request.lease_id, request.node_id, request.node_incarnation, request.reason
        )
        return registry_pb2.ReleaseLeaseResponse(lease=lease)

    @_served
    async def RevokeLease(
        self,
        registry: Registry,
        request: registry_pb2.RevokeLeaseRequest,
        context: grpc.aio.ServicerContext,
    ) -> registry_pb2.RevokeLeaseResponse:
        lease = await registry.revoke_lease(
            request.lease_id, request.conversation_id, request.reason
        )
        return registry_pb2.RevokeLeaseResponse(lease=lease)

    @_served
    async def GetLease(
        self,
        registry: Registry,
        request: registry_pb2.GetLeaseRequest,
        context: grpc.aio.ServicerContext,
    ) -> registry_pb2.GetLeaseResponse:
        return registry_pb2.GetLeaseResponse(lease=await registry.get_lease(request.lease_id))

    @_served
    async def ListLeases(
        self,
        registry: Registry,
        request: registry_pb2.ListLeasesRequest,
        context: grpc.aio.ServicerContext,
    ) -> registry_pb2.ListLeasesResponse:
        leases, next_token = await registry.list_leases(
            request.node_id,
            request.conversation_id,
            list(request.states),
            request.page_size,
            request.page_token,
        )
        return registry_pb2.ListLeasesResponse(leases=leases, next_page_token=next_token)

    @_served
    async def ReportRetention(
        self,
        registry: Registry,
        request: registry_pb2.ReportRetentionRequest,
        context: grpc.aio.ServicerContext,
    ) -> registry_pb2.ReportRetentionResponse:
        return await registry.report_retention(
            request.node_id, request.incarnation, request.events, request.full_snapshot
        )

    async def WatchLeaseCommands(
        self, request: registry_pb2.WatchLeaseCommandsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[registry_pb2.WatchLeaseCommandsResponse]:
        try:
            authorize(self.credentials.principal(context), "WatchLeaseCommands", request)
            registry = self.leadership.registry
            if registry is not None:
                async for command in registry.watch_commands(request.node_id, request.incarnation):
                    yield registry_pb2.WatchLeaseCommandsResponse(command=command)
                return
            stub = self.leadership.leader_stub()
            if stub is None:
                raise NoLeader("no replica leads (election pending); retry shortly")
            async for response in stub.WatchLeaseCommands(request):
                yield response
        except (RegistryError, grpc.aio.AioRpcError) as error:
            await _abort(context, error)

    @_served
    async def GetConversation(
        self,
        registry: Registry,
        request: registry_pb2.GetConversationRequest,
        context: grpc.aio.ServicerContext,
    ) -> registry_pb2.GetConversationResponse:
        conversation = await registry.get_conversation(request.conversation_id)
        return registry_pb2.GetConversationResponse(conversation=conversation)

    @_served
    async def BatchGetRoutingHints(
        self,
        registry: Registry,
        request: registry_pb2.BatchGetRoutingHintsRequest,
        context: grpc.aio.ServicerContext,
    ) -> registry_pb2.BatchGetRoutingHintsResponse:
        return await registry.routing_hints(request.requests, context.time_remaining())

    @_served
    async def SetCostProfile(
        self,
        registry: Registry,
        request: registry_pb2.SetCostProfileRequest,
        context: grpc.aio.ServicerContext,
    ) -> registry_pb2.SetCostProfileResponse:
        node = await registry.set_cost_profile(request.node_id, request.cost)
        return registry_pb2.SetCostProfileResponse(node=node)

    @_served
    async def GetRoutingHint(
        self,
        registry: Registry,
        request: registry_pb2.GetRoutingHintRequest,
        context: grpc.aio.ServicerContext,
    ) -> registry_pb2.GetRoutingHintResponse:
        hint = await registry.routing_hint(
            request.conversation_id,
            request.model,
            request.dry_run,
            TurnRequest.of(request),
            context.time_remaining(),
        )
        return registry_pb2.GetRoutingHintResponse(hint=hint)


# ---------------------------------------------------------------- registration


def add_registry_service(servicer: RegistryServicer, server: grpc.aio.Server) -> None:
    """Serves ``servicer`` on ``server`` as the generated ``add_RegistryServiceServicer_to_
    server`` does, except that requests are decoded here: one that does not decode is refused
    with INVALID_ARGUMENT and its reason (gRPC's own decoding answers UNKNOWN)."""
    service = registry_pb2.DESCRIPTOR.services_by_name["RegistryService"]
    handlers = {}
    for method in service.methods:
        request_type = GetMessageClass(method.input_type)
        serialize = GetMessageClass(method.output_type).SerializeToString
        behavior = getattr(servicer, method.name)
        if method.server_streaming:
            handlers[method.name] = grpc.unary_stream_rpc_method_handler(
                _decoding_stream(behavior, request_type), response_serializer=serialize
            )
        else:
            handlers[method.name] = grpc.unary_unary_rpc_method_handler(
                _decoding(behavior, request_type), response_serializer=serialize
            )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(service.full_name, handlers),)
    )


async def _decode(
    raw: bytes, request_type: type[Message], context: grpc.aio.ServicerContext
) -> Message:
    try:
        return request_type.FromString(raw)
    except DecodeError as error:
        name = request_type.DESCRIPTOR.full_name
        await _abort(context, InvalidArgument(f"the request is not a valid {name}: {error}"))
        raise  # unreachable: abort raises


def _decoding(
    behavior: Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]],
    request_type: type[Message],
) -> Callable[[bytes, grpc.aio.ServicerContext], Awaitable[Any]]:
    async def handle(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
        return await behavior(await _decode(raw, request_type, context), context)

    return handle


def _decoding_stream(
    behavior: Callable[[Any, grpc.aio.ServicerContext], AsyncIterator[Any]],
    request_type: type[Message],
) -> Callable[[bytes, grpc.aio.ServicerContext], AsyncIterator[Any]]:
    async def handle(raw: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        async for response in behavior(await _decode(raw, request_type, context), context):
            yield response

    return handle
