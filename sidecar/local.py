"""The engine-facing endpoint: SidecarService on a Unix socket (or loopback TCP).

It trusts its caller as the engine it serves: ``ResolveHandle`` names any conversation (the
engine's session middleware has applied the tenant rule before asking), ``AttachEngine``
speaks for the node. So it listens only where nothing off the node can reach it
(``config.check_local_listen``); the socket's directory decides who on the node can."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from kvbroker.sidecar.agent import Agent
from kvbroker.sidecar.session import RPC_TIMEOUT_S, SessionLostError
from kvbroker.v1 import registry_pb2, sidecar_pb2, sidecar_pb2_grpc


class SidecarServicer(sidecar_pb2_grpc.SidecarServiceServicer):
    def __init__(self, agent: Agent) -> None:
        self.agent = agent

    async def AttachEngine(
        self, request: sidecar_pb2.AttachEngineRequest, context: grpc.aio.ServicerContext
    ) -> sidecar_pb2.AttachEngineResponse:
        engine = request.engine
        if not engine.engine_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "engine.engine_id is required")
        if engine.block_size == 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "engine.block_size is required")
        self.agent.attach_engine(engine, request.retained)
        return sidecar_pb2.AttachEngineResponse(
            node_id=self.agent.config.node_id, incarnation=self.agent.incarnation
        )

    async def SubmitRetentionEvents(
        self, request: sidecar_pb2.SubmitRetentionEventsRequest, context: grpc.aio.ServicerContext
    ) -> sidecar_pb2.SubmitRetentionEventsResponse:
        if self.agent.engine is None:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION, "attach the engine before reporting"
            )
        for event in request.events:
            if event.WhichOneof("event") is None:
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    "an event names no kind (retained, released, reclaim or not_retained)",
                )
        depth = self.agent.submit(request.events)
        return sidecar_pb2.SubmitRetentionEventsResponse(queue_depth=depth)

    async def CheckLease(
        self, request: sidecar_pb2.CheckLeaseRequest, context: grpc.aio.ServicerContext
    ) -> sidecar_pb2.CheckLeaseResponse:
        if not request.lease_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "lease_id is required")
        return await self.agent.check_lease(request.lease_id, request.epoch)

    async def ResolveHandle(
        self, request: sidecar_pb2.ResolveHandleRequest, context: grpc.aio.ServicerContext
    ) -> sidecar_pb2.ResolveHandleResponse:
        if not request.conversation_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "conversation_id is required")
        if request.path not in registry_pb2.TurnPath.values():
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"path {request.path} is not a TurnPath"
            )
        remaining = context.time_remaining()
        try:
            hint = await self.agent.resolve_handle(
                request, remaining if remaining is not None else RPC_TIMEOUT_S
            )
        except SessionLostError as error:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(error))
        except grpc.aio.AioRpcError as error:
            # The registry's own answer (a bad conversation id, an unknown node), as it gave it.
            await context.abort(error.code(), error.details() or "")
        return sidecar_pb2.ResolveHandleResponse(hint=hint)

    async def ResolvePrefix(
        self, request: sidecar_pb2.ResolvePrefixRequest, context: grpc.aio.ServicerContext
    ) -> sidecar_pb2.ResolvePrefixResponse:
        if request.block_size == 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "block_size is required")
        remaining = context.time_remaining()
        try:
            match = await self.agent.resolve_prefix(
                request, remaining if remaining is not None else RPC_TIMEOUT_S
            )
        except SessionLostError as error:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(error))
        except grpc.aio.AioRpcError as error:
            await context.abort(error.code(), error.details() or "")
        return sidecar_pb2.ResolvePrefixResponse(match=match)

    async def EndPin(
        self, request: sidecar_pb2.EndPinRequest, context: grpc.aio.ServicerContext
    ) -> sidecar_pb2.EndPinResponse:
        if not request.lease_id or not request.pin_id:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "lease_id and pin_id are required"
            )
        await self.agent.end_pin(request.lease_id, request.pin_id)
        return sidecar_pb2.EndPinResponse()

    async def WatchDeadlines(
        self, request: sidecar_pb2.WatchDeadlinesRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[sidecar_pb2.WatchDeadlinesResponse]:
        async for command in self.agent.deadlines():
            yield sidecar_pb2.WatchDeadlinesResponse(command=command)
