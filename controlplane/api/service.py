"""The gRPC face of the registry: decode requests, make the call, map errors to statuses.

With replicas, a call reaches whichever replica the client's channel picked. Whether this
replica serves it or relays it is decided in one place, ``_served`` (``_serving`` says who):
while it leads, a handler converts the request (``api.convert``), makes its one call on the
``Registry`` and converts the answer; else a ``Forwarder`` (``api.forwarder``) relays the
request whole to the leader and returns the leader's response unchanged, but for the hints it
answers itself (from its copy of the leader's state, or from its cache, DEGRADED, while no
leader can be reached). Either way the call is authorized here, where it entered, and the
incarnations its caller may not see are hidden on the way out. A hint's trailing metadata
names the replica whose answer it is (``SERVED_BY_METADATA_KEY``).

This is the one place a domain error becomes a gRPC status: its code, its sentence, and its
reason in the trailing metadata (``errors.status_metadata``); a leader's error is relayed with
its reason intact.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from functools import wraps
from typing import Any, TypeVar, cast

import grpc
import structlog
from google.protobuf.message import DecodeError, Message
from google.protobuf.message_factory import GetMessageClass

from kvbroker.common.client.grpc_client import SERVED_BY_METADATA_KEY, from_grpc_error
from kvbroker.controlplane.api import convert
from kvbroker.controlplane.api.forwarder import HINT_CALLS, Forwarder
from kvbroker.controlplane.api.identity import (
    Credentials,
    HintStateViews,
    authorize,
    hide_incarnations,
)
from kvbroker.controlplane.api.interface import Leadership
from kvbroker.controlplane.errors import (
    InvalidArgument,
    NoLeader,
    RegistryError,
    hint_error,
    status_metadata,
)
from kvbroker.controlplane.placement.planner import TurnRequest
from kvbroker.controlplane.records import codec
from kvbroker.controlplane.registry import Registry
from kvbroker.v1 import registry_pb2, registry_pb2_grpc

log = structlog.get_logger("kvbroker.registry")

Req = TypeVar("Req")
Resp = TypeVar("Resp")
Handler = Callable[[Any, Registry, Req, grpc.aio.ServicerContext], Awaitable[Resp]]
Served = Callable[[Any, Req, grpc.aio.ServicerContext], Awaitable[Resp]]

# A forwarded call waits at most this long for the leader (less if the caller's deadline is).
FORWARD_TIMEOUT_S = 5.0


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
    """Serves the call on the leader (``handler``) or relays it to the leader whole
    (``Forwarder.answer``); a RegistryError becomes its status, a leader's error is
    relayed."""
    method = handler.__name__

    @wraps(handler)
    async def wrapped(
        self: RegistryServicer, request: Req, context: grpc.aio.ServicerContext
    ) -> Resp:
        try:
            # Authorized here, where the call entered: a relayed call reaches the leader with
            # this replica's credential.
            principal = self.credentials.principal(context)
            authorize(principal, method, request)
            serving = self._serving(context)
            response: Any
            if isinstance(serving, Forwarder):
                response = await serving.answer(method, request)
                served_by = serving.served_by
            else:
                response = await handler(self, serving, request, context)
                served_by = self.leadership.address
            if served_by and method in HINT_CALLS:
                context.set_trailing_metadata(((SERVED_BY_METADATA_KEY, served_by),))
            hide_incarnations(principal, response)
            # The leader's response to this method is this method's response.
            return cast(Resp, response)
        except (RegistryError, grpc.aio.AioRpcError) as error:
            await _abort(context, error)
            raise  # unreachable: abort raises

    return wrapped


class RegistryServicer(registry_pb2_grpc.RegistryServiceServicer):
    """Each handler is the leader's: a follower never runs one (``_served``)."""

    def __init__(self, leadership: Leadership, credentials: Credentials | None = None) -> None:
        self.leadership = leadership
        self.credentials = credentials or Credentials()
        self._hint_views = HintStateViews()

    def _serving(self, context: grpc.aio.ServicerContext) -> Registry | Forwarder:
        """Who serves this call: the registry while this replica leads, else the leader
        through a forwarder bounded by the caller's deadline."""
        registry = self.leadership.registry
        if registry is not None:
            return registry
        remaining = context.time_remaining()
        timeout = min(remaining, FORWARD_TIMEOUT_S) if remaining else FORWARD_TIMEOUT_S
        return Forwarder(self.leadership, timeout)

    @_served
    async def RegisterNode(
        self,
        registry: Registry,
        request: registry_pb2.RegisterNodeRequest,
        context: grpc.aio.ServicerContext,
    ) -> registry_pb2.RegisterNodeResponse:
        return convert.registration_response(await registry.register_node(request.spec))

    @_served
    async def Heartbeat(
        self,
        registry: Registry,
        request: registry_pb2.HeartbeatRequest,
        context: grpc.aio.ServicerContext,
    ) -> registry_pb2.HeartbeatResponse:
        node = await registry.heartbeat(convert.heartbeat_of(request))
        return registry_pb2.HeartbeatResponse(node=convert.node_message(node))

    @_served
    async def DeregisterNode(
        self,
        registry: Registry,
        request: registry_pb2.DeregisterNodeRequest,
        context: grpc.aio.ServicerContext,
    ) -> registry_pb2.DeregisterNodeResponse:
        node = await registry.deregister_node(request.node_id, request.incarnation)
        return registry_pb2.DeregisterNodeResponse(node=convert.node_message(node))

    @_served
    async def GetNode(
        self,
        registry: Registry,
        request: registry_pb2.GetNodeRequest,
        context: grpc.aio.ServicerContext,
    ) -> registry_pb2.GetNodeResponse:
        return registry_pb2.GetNodeResponse(
            node=convert.node_message(await registry.get_node(request.node_id))
        )

    @_served
    async def ListNodes(
        self,
        registry: Registry,
        request: registry_pb2.ListNodesRequest,
        context: grpc.aio.ServicerContext,
    ) -> registry_pb2.ListNodesResponse:
        nodes = await registry.list_nodes(request.role, request.model)
        return registry_pb2.ListNodesResponse(nodes=[convert.node_message(n) for n in nodes])

    @_served
    async def DrainNode(
        self,
        registry: Registry,
        request: registry_pb2.DrainNodeRequest,
        context: grpc.aio.ServicerContext,
    ) -> registry_pb2.DrainNodeResponse:
        return registry_pb2.DrainNodeResponse(
            node=convert.node_message(await registry.drain_node(request.node_id))
        )

    @_served
    async def SetCostProfile(
        self,
        registry: Registry,
        request: registry_pb2.SetCostProfileRequest,
        context: grpc.aio.ServicerContext,
    ) -> registry_pb2.SetCostProfileResponse:
        node = await registry.set_cost_profile(request.node_id, codec.cost_of(request.cost))
        return registry_pb2.SetCostProfileResponse(node=convert.node_message(node))

    @_served
    async def GrantLease(
        self,
        registry: Registry,
        request: registry_pb2.GrantLeaseRequest,
        context: grpc.aio.ServicerContext,
    ) -> registry_pb2.GrantLeaseResponse:
        lease = await registry.grant_lease(convert.grant_of(request))
        return registry_pb2.GrantLeaseResponse(lease=convert.lease_message(lease))

    @_served
    async def RenewLease(
        self,
        registry: Registry,
        request: registry_pb2.RenewLeaseRequest,
        context: grpc.aio.ServicerContext,
    ) -> registry_pb2.RenewLeaseResponse:
        lease = await registry.renew_lease(
            request.lease_id, request.conversation_id, convert.ttl_of(request)
        )
        return registry_pb2.RenewLeaseResponse(lease=convert.lease_message(lease))

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
        return registry_pb2.ReleaseLeaseResponse(lease=convert.lease_message(lease))

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
        return registry_pb2.RevokeLeaseResponse(lease=convert.lease_message(lease))

    @_served
    async def GetLease(
        self,
        registry: Registry,
        request: registry_pb2.GetLeaseRequest,
        context: grpc.aio.ServicerContext,
    ) -> registry_pb2.GetLeaseResponse:
        return registry_pb2.GetLeaseResponse(
            lease=convert.lease_message(await registry.get_lease(request.lease_id))
        )

    @_served
    async def ListLeases(
        self,
        registry: Registry,
        request: registry_pb2.ListLeasesRequest,
        context: grpc.aio.ServicerContext,
    ) -> registry_pb2.ListLeasesResponse:
        leases, next_token = await registry.list_leases(convert.listing_of(request))
        return registry_pb2.ListLeasesResponse(
            leases=[convert.lease_message(lease) for lease in leases], next_page_token=next_token
        )

    @_served
    async def GetConversation(
        self,
        registry: Registry,
        request: registry_pb2.GetConversationRequest,
        context: grpc.aio.ServicerContext,
    ) -> registry_pb2.GetConversationResponse:
        conversation = await registry.get_conversation(request.conversation_id)
        return registry_pb2.GetConversationResponse(
            conversation=convert.conversation_message(conversation)
        )

    @_served
    async def ReportRetention(
        self,
        registry: Registry,
        request: registry_pb2.ReportRetentionRequest,
        context: grpc.aio.ServicerContext,
    ) -> registry_pb2.ReportRetentionResponse:
        return await registry.report_retention(convert.report_of(request))

    async def WatchLeaseCommands(
        self, request: registry_pb2.WatchLeaseCommandsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[registry_pb2.WatchLeaseCommandsResponse]:
        """The one stream a follower relays (``_serving`` says whose it is)."""
        try:
            authorize(self.credentials.principal(context), "WatchLeaseCommands", request)
            serving = self._serving(context)
            if isinstance(serving, Forwarder):
                async for response in serving.watch(request):
                    yield response
                return
            commands = serving.watch_commands(request.node_id, request.incarnation)
            async for command in commands:
                yield registry_pb2.WatchLeaseCommandsResponse(command=command)
        except (RegistryError, grpc.aio.AioRpcError) as error:
            await _abort(context, error)

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

    @_served
    async def BatchGetRoutingHints(
        self,
        registry: Registry,
        request: registry_pb2.BatchGetRoutingHintsRequest,
        context: grpc.aio.ServicerContext,
    ) -> registry_pb2.BatchGetRoutingHintsResponse:
        return await registry.routing_hints(request.requests, context.time_remaining())

    async def WatchHintState(
        self, request: registry_pb2.WatchHintStateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[registry_pb2.WatchHintStateResponse]:
        """The leader's state for a follower (``replication.hint_state``), or a follower's
        copy of it for a router's own (``HintRelay``): whole to replicas and operators, to a
        router with incarnations hidden (``HintStateViews``: one copy for all routers); never to a
        node."""
        try:
            principal = self.credentials.principal(context)
            authorize(principal, "WatchHintState", request)
            feed = self.leadership.hint_feed()
            if feed is None:
                raise NoLeader("this replica does not lead: follow the leader's hint state")
            async for message in feed.subscribe():
                yield self._hint_views.for_principal(principal, message)
        except RegistryError as error:
            await _abort(context, error)

    @_served
    async def MatchPrefix(
        self,
        registry: Registry,
        request: registry_pb2.MatchPrefixRequest,
        context: grpc.aio.ServicerContext,
    ) -> registry_pb2.MatchPrefixResponse:
        match = await registry.match_prefix(convert.probe_of(request))
        return convert.match_message(match)

    @_served
    async def EndReadPin(
        self,
        registry: Registry,
        request: registry_pb2.EndReadPinRequest,
        context: grpc.aio.ServicerContext,
    ) -> registry_pb2.EndReadPinResponse:
        await registry.end_read_pin(request.node_id, request.lease_id, request.pin_id)
        return registry_pb2.EndReadPinResponse()


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
