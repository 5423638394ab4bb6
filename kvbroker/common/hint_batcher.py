"""Routing hints as a busy router sends them: concurrent turns share BatchGetRoutingHints calls
(one in flight, the rest in the next; see ``batcher``). Each hint is still answered or refused
on its own, with the error GetRoutingHint would have raised."""

from __future__ import annotations

import grpc

from kvbroker.common.batcher import Batcher
from kvbroker.v1 import registry_pb2
from kvbroker.v1.registry_pb2_grpc import RegistryServiceStub

_STATUS_BY_CODE = {status.value[0]: status for status in grpc.StatusCode}


def _refusal(error: registry_pb2.HintError) -> grpc.aio.AioRpcError:
    code = _STATUS_BY_CODE.get(error.code, grpc.StatusCode.UNKNOWN)
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), error.message)


class HintBatcher:
    def __init__(self, stub: RegistryServiceStub, timeout_s: float, max_batch: int = 256) -> None:
        self._stub = stub
        self._timeout_s = timeout_s
        self._batches: Batcher[registry_pb2.GetRoutingHintRequest, registry_pb2.RoutingHint] = (
            Batcher(self._send, max_batch, "kvbroker-hint-batches")
        )

    async def hint(self, request: registry_pb2.GetRoutingHintRequest) -> registry_pb2.RoutingHint:
        """The hint for one request; raises ``grpc.aio.AioRpcError`` as GetRoutingHint would."""
        return await self._batches.submit(request)

    async def _send(
        self, requests: list[registry_pb2.GetRoutingHintRequest]
    ) -> list[registry_pb2.RoutingHint | BaseException]:
        response = await self._stub.BatchGetRoutingHints(
            registry_pb2.BatchGetRoutingHintsRequest(requests=requests), timeout=self._timeout_s
        )
        return [
            result.hint if result.HasField("hint") else _refusal(result.error)
            for result in response.results
        ]
