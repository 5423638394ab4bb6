"""The gRPC face of the registry: decode requests, make the call, map errors to statuses.

With replicas, a call reaches whichever replica the client's channel picked. Each handler
makes its one call on a ``RegistryApi`` (``api.interface``): the ``Registry`` while this
replica leads, else a ``Forwarder``, which answers hints that write nothing from this
replica's copy of the leader's state, relays the leader's answer to everything else and,
while no leader can be reached, answers hints from its cache (DEGRADED) and everything else
with UNAVAILABLE. A hint's trailing metadata names the replica whose answer it is
(``SERVED_BY_METADATA_KEY``).

This is the one place a domain error becomes a gRPC status: its code, its sentence, and its
reason in the trailing metadata (``errors.status_metadata``); a leader's error is relayed with
its reason intact.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from functools import wraps
from typing import Any, TypeVar

import grpc
import structlog
from google.protobuf.message import DecodeError, Message
from google.protobuf.message_factory import GetMessageClass

from kvbroker.common.client.grpc_client import SERVED_BY_METADATA_KEY, from_grpc_error
from kvbroker.controlplane.api import convert
from kvbroker.controlplane.api.forwarder import Forwarder
from kvbroker.controlplane.api.identity import Credentials, authorize, hide_incarnations
from kvbroker.controlplane.api.interface import Leadership, RegistryApi
from kvbroker.controlplane.errors import (
    InvalidArgument,
    NoLeader,
    RegistryError,
    hint_error,
    status_metadata,
)
from kvbroker.controlplane.placement.planner import TurnRequest
from kvbroker.controlplane.records import codec
from kvbroker.v1 import registry_pb2, registry_pb2_grpc

log = structlog.get_logger("kvbroker.registry")

Req = TypeVar("Req")
Resp = TypeVar("Resp")
Handler = Callable[[Any, RegistryApi, Req, grpc.aio.ServicerContext], Awaitable[Resp]]
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
    """Serves on the leader or forwards to it (``RegistryServicer.api``); a RegistryError
    becomes its status, a leader's error is relayed."""
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
            response = await handler(self, self.api(context), request, context)
            hide_incarnations(principal, response)
            return response
        except (RegistryError, grpc.aio.AioRpcError) as error:
            await _abort(context, error)
            raise  # unreachable: abort raises

    return wrapped


class RegistryServicer(registry_pb2_grpc.RegistryServiceServicer):
    def __init__(self, leadership: Leadership, credentials: Credentials | None = None) -> None:
        self.leadership = leadership
        self.credentials = credentials or Credentials()

    def api(self, context: grpc.aio.ServicerContext) -> RegistryApi:
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
        api: RegistryApi,
        request: registry_pb2.RegisterNodeRequest,
        context: grpc.aio.ServicerContext,
    ) -> registry_pb2.RegisterNodeResponse:
        return convert.registration_response(await api.register_node(request.spec))

    @_served
    async def Heartbeat(
        self,
        api: RegistryApi,
        request: registry_pb2.HeartbeatRequest,
        context: grpc.aio.ServicerContext,
    ) -> registry_pb2.HeartbeatResponse:
        node = await api.heartbeat(
            request.node_id,
            request.incarnation,
            request.engine_ready,
            codec.load_of(request.load),
            convert.work_of(request),
        )
        return registry_pb2.HeartbeatResponse(node=convert.node_message(node))

    @_served
    async def DeregisterNode(
        self,
        api: RegistryApi,
        request: registry_pb2.DeregisterNodeRequest,
        context: grpc.aio.ServicerContext,
    ) -> registry_pb2.DeregisterNodeResponse:
        node = await api.deregister_node(request.node_id, request.incarnation)
        return registry_pb2.DeregisterNodeResponse(node=convert.node_message(node))

    @_served
    async def GetNode(
        self,
        api: RegistryApi,
        request: registry_pb2.GetNodeRequest,
        context: grpc.aio.ServicerContext,
    ) -> registry_pb2.GetNodeResponse:
        return registry_pb2.GetNodeResponse(
            node=convert.node_message(await api.get_node(request.node_id))
        )

    @_served
    async def ListNodes(
        self,
        api: RegistryApi,
        request: registry_pb2.ListNodesRequest,
        context: grpc.aio.ServicerContext,
    ) -> registry_pb2.ListNodesResponse:
        nodes = await api.list_nodes(request.role, request.model)
        return registry_pb2.ListNodesResponse(nodes=[convert.node_message(n) for n in nodes])

    @_served
    async def DrainNode(
        self,
        api: RegistryApi,
        request: registry_pb2.DrainNodeRequest,
        context: grpc.aio.ServicerContext,
    ) -> registry_pb2.DrainNodeResponse:
        return registry_pb2.DrainNodeResponse(
            node=convert.node_message(await api.drain_node(request.node_id))
        )

    @_served
    async def GrantLease(
        self,
        api: RegistryApi,
        request: registry_pb2.GrantLeaseRequest,
        context: grpc.aio.ServicerContext,
    ) -> registry_pb2.GrantLeaseResponse:
        lease = await api.grant_lease(
            request.conversation_id,
            request.node_id,
            request.node_incarnation,
            request.handle,
            request.block_hashes,
            request.token_count,
            convert.ttl_of(request),
            request.block_hash_stride,
        )
        return registry_pb2.GrantLeaseResponse(lease=convert.lease_message(lease))

    @_served
    async def RenewLease(
        self,
        api: RegistryApi,
        request: registry_pb2.RenewLeaseRequest,
        context: grpc.aio.ServicerContext,
    ) -> registry_pb2.RenewLeaseResponse:
        lease = await api.renew_lease(
            request.lease_id, request.conversation_id, convert.ttl_of(request)
        )
        return registry_pb2.RenewLeaseResponse(lease=convert.lease_message(lease))

    @_served
    async def ReleaseLease(
        self,
        api: RegistryApi,
        request: registry_pb2.ReleaseLeaseRequest,
        context: grpc.aio.ServicerContext,
    ) -> registry_pb2.ReleaseLeaseResponse:
        lease = await api.release_lease(
            request.lease_id, request.node_id, request.node_incarnation, request.reason
        )
        return registry_pb2.ReleaseLeaseResponse(lease=convert.lease_message(lease))

    @_served
    async def RevokeLease(
        self,
        api: RegistryApi,
        request: registry_pb2.RevokeLeaseRequest,
        context: grpc.aio.ServicerContext,
    ) -> registry_pb2.RevokeLeaseResponse:
        lease = await api.revoke_lease(request.lease_id, request.conversation_id, request.reason)
        return registry_pb2.RevokeLeaseResponse(lease=convert.lease_message(lease))

    @_served
    async def GetLease(
        self,
        api: RegistryApi,
        request: registry_pb2.GetLeaseRequest,
        context: grpc.aio.ServicerContext,
    ) -> registry_pb2.GetLeaseResponse:
        return registry_pb2.GetLeaseResponse(
            lease=convert.lease_message(await api.get_lease(request.lease_id))
        )

    @_served
    async def ListLeases(
        self,
        api: RegistryApi,
        request: registry_pb2.ListLeasesRequest,
        context: grpc.aio.ServicerContext,
    ) -> registry_pb2.ListLeasesResponse:
        leases, next_token = await api.list_leases(
            request.node_id,
            request.conversation_id,
            list(request.states),
            request.page_size,
            request.page_token,
        )
        return registry_pb2.ListLeasesResponse(
            leases=[convert.lease_message(lease) for lease in leases], next_page_token=next_token
        )

    @_served
    async def ReportRetention(
        self,
        api: RegistryApi,
        request: registry_pb2.ReportRetentionRequest,
        context: grpc.aio.ServicerContext,
    ) -> registry_pb2.ReportRetentionResponse:
        return await api.report_retention(
            request.node_id, request.incarnation, request.events, request.full_snapshot
        )

    async def WatchLeaseCommands(
        self, request: registry_pb2.WatchLeaseCommandsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[registry_pb2.WatchLeaseCommandsResponse]:
        try:
            authorize(self.credentials.principal(context), "WatchLeaseCommands", request)
            commands = self.api(context).watch_commands(request.node_id, request.incarnation)
            async for command in commands:
                yield registry_pb2.WatchLeaseCommandsResponse(command=command)
        except (RegistryError, grpc.aio.AioRpcError) as error:
            await _abort(context, error)

    @_served
    async def GetConversation(
        self,
        api: RegistryApi,
        request: registry_pb2.GetConversationRequest,
        context: grpc.aio.ServicerContext,
    ) -> registry_pb2.GetConversationResponse:
        conversation = await api.get_conversation(request.conversation_id)
        return registry_pb2.GetConversationResponse(
            conversation=convert.conversation_message(conversation)
        )

    @_served
    async def BatchGetRoutingHints(
        self,
        api: RegistryApi,
        request: registry_pb2.BatchGetRoutingHintsRequest,
        context: grpc.aio.ServicerContext,
    ) -> registry_pb2.BatchGetRoutingHintsResponse:
        response = await api.routing_hints(request.requests, context.time_remaining())
        self._say_who_served(api, context)
        return response

    @_served
    async def SetCostProfile(
        self,
        api: RegistryApi,
        request: registry_pb2.SetCostProfileRequest,
        context: grpc.aio.ServicerContext,
    ) -> registry_pb2.SetCostProfileResponse:
        node = await api.set_cost_profile(request.node_id, codec.cost_of(request.cost))
        return registry_pb2.SetCostProfileResponse(node=convert.node_message(node))

    @_served
    async def GetRoutingHint(
        self,
        api: RegistryApi,
        request: registry_pb2.GetRoutingHintRequest,
        context: grpc.aio.ServicerContext,
    ) -> registry_pb2.GetRoutingHintResponse:
        hint = await api.routing_hint(
            request.conversation_id,
            request.model,
            request.dry_run,
            TurnRequest.of(request),
            context.time_remaining(),
        )
        self._say_who_served(api, context)
        return registry_pb2.GetRoutingHintResponse(hint=hint)

    def _say_who_served(self, api: RegistryApi, context: grpc.aio.ServicerContext) -> None:
        """Names the replica whose answer a hint is (``SERVED_BY_METADATA_KEY``): this one
        when it leads or answered from its copy, else its leader (nothing for a standalone
        registry)."""
        served_by = api.served_by if isinstance(api, Forwarder) else self.leadership.address
        if served_by:
            context.set_trailing_metadata(((SERVED_BY_METADATA_KEY, served_by),))

    async def WatchHintState(
        self, request: registry_pb2.WatchHintStateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[registry_pb2.WatchHintStateResponse]:
        """The leader's state for a follower (``replication.hint_state``); only the leader
        serves it, and only to replicas (and operators)."""
        try:
            authorize(self.credentials.principal(context), "WatchHintState", request)
            feed = self.leadership.hint_feed()
            if feed is None:
                raise NoLeader("this replica does not lead: follow the leader's hint state")
            async for message in feed.subscribe():
                yield message
        except RegistryError as error:
            await _abort(context, error)

    @_served
    async def MatchPrefix(
        self,
        api: RegistryApi,
        request: registry_pb2.MatchPrefixRequest,
        context: grpc.aio.ServicerContext,
    ) -> registry_pb2.MatchPrefixResponse:
        match = await api.match_prefix(
            request.node_id,
            request.conversation_id,
            request.model,
            request.block_size,
            request.probe_hashes,
        )
        return convert.match_message(match)

    @_served
    async def EndReadPin(
        self,
        api: RegistryApi,
        request: registry_pb2.EndReadPinRequest,
        context: grpc.aio.ServicerContext,
    ) -> registry_pb2.EndReadPinResponse:
        await api.end_read_pin(request.node_id, request.lease_id, request.pin_id)
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
