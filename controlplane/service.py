"""The gRPC face of the registry: decode requests, call the Registry, map errors to statuses."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from functools import wraps
from typing import Any, TypeVar

import grpc
import structlog

from controlplane.errors import RegistryError
from controlplane.registry import Registry
from kvbroker.common.clock import from_duration, to_duration
from kvbroker.v1 import registry_pb2, registry_pb2_grpc

log = structlog.get_logger("kvbroker.registry")

Req = TypeVar("Req")
Resp = TypeVar("Resp")
Handler = Callable[[Any, Req, grpc.aio.ServicerContext], Awaitable[Resp]]


def _status_errors(handler: Handler[Req, Resp]) -> Handler[Req, Resp]:
    """Turns a RegistryError into its status code and sentence; everything else is INTERNAL."""

    @wraps(handler)
    async def wrapped(self: Any, request: Req, context: grpc.aio.ServicerContext) -> Resp:
        try:
            return await handler(self, request, context)
        except RegistryError as error:
            await context.abort(error.code, error.message)
            raise  # unreachable: abort raises

    return wrapped


def _ttl(message: Any) -> float | None:
    return from_duration(message.time_to_live) if message.HasField("time_to_live") else None


class RegistryServicer(registry_pb2_grpc.RegistryServiceServicer):
    def __init__(self, registry: Registry) -> None:
        self.registry = registry

    @_status_errors
    async def RegisterNode(
        self, request: registry_pb2.RegisterNodeRequest, context: grpc.aio.ServicerContext
    ) -> registry_pb2.RegisterNodeResponse:
        node = await self.registry.register_node(request.spec)
        config = self.registry.config
        return registry_pb2.RegisterNodeResponse(
            node=node,
            heartbeat_interval=to_duration(config.heartbeat_interval_s),
            session_ttl=to_duration(config.session_ttl_s),
        )

    @_status_errors
    async def Heartbeat(
        self, request: registry_pb2.HeartbeatRequest, context: grpc.aio.ServicerContext
    ) -> registry_pb2.HeartbeatResponse:
        node = await self.registry.heartbeat(
            request.node_id, request.incarnation, request.engine_ready, request.load
        )
        return registry_pb2.HeartbeatResponse(node=node)

    @_status_errors
    async def DeregisterNode(
        self, request: registry_pb2.DeregisterNodeRequest, context: grpc.aio.ServicerContext
    ) -> registry_pb2.DeregisterNodeResponse:
        node = await self.registry.deregister_node(request.node_id, request.incarnation)
        return registry_pb2.DeregisterNodeResponse(node=node)

    @_status_errors
    async def GetNode(
        self, request: registry_pb2.GetNodeRequest, context: grpc.aio.ServicerContext
    ) -> registry_pb2.GetNodeResponse:
        return registry_pb2.GetNodeResponse(node=await self.registry.get_node(request.node_id))

    @_status_errors
    async def ListNodes(
        self, request: registry_pb2.ListNodesRequest, context: grpc.aio.ServicerContext
    ) -> registry_pb2.ListNodesResponse:
        nodes = await self.registry.list_nodes(request.role, request.model)
        return registry_pb2.ListNodesResponse(nodes=nodes)

    @_status_errors
    async def DrainNode(
        self, request: registry_pb2.DrainNodeRequest, context: grpc.aio.ServicerContext
    ) -> registry_pb2.DrainNodeResponse:
        return registry_pb2.DrainNodeResponse(node=await self.registry.drain_node(request.node_id))

    @_status_errors
    async def GrantLease(
        self, request: registry_pb2.GrantLeaseRequest, context: grpc.aio.ServicerContext
    ) -> registry_pb2.GrantLeaseResponse:
        lease = await self.registry.grant_lease(
            request.conversation_id,
            request.node_id,
            request.node_incarnation,
            request.handle,
            request.block_hashes,
            request.token_count,
            _ttl(request),
        )
        return registry_pb2.GrantLeaseResponse(lease=lease)

    @_status_errors
    async def RenewLease(
        self, request: registry_pb2.RenewLeaseRequest, context: grpc.aio.ServicerContext
    ) -> registry_pb2.RenewLeaseResponse:
        lease = await self.registry.renew_lease(
            request.lease_id, request.conversation_id, _ttl(request)
        )
        return registry_pb2.RenewLeaseResponse(lease=lease)

    @_status_errors
    async def ReleaseLease(
        self, request: registry_pb2.ReleaseLeaseRequest, context: grpc.aio.ServicerContext
    ) -> registry_pb2.ReleaseLeaseResponse:
        lease = await self.registry.release_lease(
            request.lease_id, request.node_id, request.node_incarnation, request.reason
        )
        return registry_pb2.ReleaseLeaseResponse(lease=lease)

    @_status_errors
    async def RevokeLease(
        self, request: registry_pb2.RevokeLeaseRequest, context: grpc.aio.ServicerContext
    ) -> registry_pb2.RevokeLeaseResponse:
        lease = await self.registry.revoke_lease(
            request.lease_id, request.conversation_id, request.reason
        )
        return registry_pb2.RevokeLeaseResponse(lease=lease)

    @_status_errors
    async def GetLease(
        self, request: registry_pb2.GetLeaseRequest, context: grpc.aio.ServicerContext
    ) -> registry_pb2.GetLeaseResponse:
        return registry_pb2.GetLeaseResponse(lease=await self.registry.get_lease(request.lease_id))

    @_status_errors
    async def ListLeases(
        self, request: registry_pb2.ListLeasesRequest, context: grpc.aio.ServicerContext
    ) -> registry_pb2.ListLeasesResponse:
        leases, next_token = await self.registry.list_leases(
            request.node_id,
            request.conversation_id,
            list(request.states),
            request.page_size,
            request.page_token,
        )
        return registry_pb2.ListLeasesResponse(leases=leases, next_page_token=next_token)

    @_status_errors
    async def ReportRetention(
        self, request: registry_pb2.ReportRetentionRequest, context: grpc.aio.ServicerContext
    ) -> registry_pb2.ReportRetentionResponse:
        applied, leases = await self.registry.report_retention(
            request.node_id, request.incarnation, request.events, request.full_snapshot
        )
        return registry_pb2.ReportRetentionResponse(applied_sequence=applied, leases=leases)

    async def WatchLeaseCommands(
        self, request: registry_pb2.WatchLeaseCommandsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[registry_pb2.WatchLeaseCommandsResponse]:
        try:
            async for command in self.registry.watch_commands(request.node_id, request.incarnation):
                yield registry_pb2.WatchLeaseCommandsResponse(command=command)
        except RegistryError as error:
            await context.abort(error.code, error.message)

    @_status_errors
    async def GetConversation(
        self, request: registry_pb2.GetConversationRequest, context: grpc.aio.ServicerContext
    ) -> registry_pb2.GetConversationResponse:
        conversation = await self.registry.get_conversation(request.conversation_id)
        return registry_pb2.GetConversationResponse(conversation=conversation)

    @_status_errors
    async def GetRoutingHint(
        self, request: registry_pb2.GetRoutingHintRequest, context: grpc.aio.ServicerContext
    ) -> registry_pb2.GetRoutingHintResponse:
        hint = await self.registry.routing_hint(
            request.conversation_id, request.model, request.dry_run
        )
        return registry_pb2.GetRoutingHintResponse(hint=hint)
