"""Routing hints as a busy router sends them: concurrent turns share BatchGetRoutingHints calls
(one in flight, the rest in the next; see ``batcher``). Each hint is still answered or refused
on its own, with the error GetRoutingHint would have raised."""

from __future__ import annotations

import grpc

from kvbroker.common.client.batcher import Batcher
from kvbroker.common.client.grpc_client import RegistryCallError, from_grpc_error
from kvbroker.v1 import registry_pb2
from kvbroker.v1.registry_pb2_grpc import RegistryServiceStub


class HintBatcher:
    def __init__(self, stub: RegistryServiceStub, timeout_s: float, max_batch: int = 256) -> None:
        self._stub = stub
        self._timeout_s = timeout_s
        self._batches: Batcher[registry_pb2.GetRoutingHintRequest, registry_pb2.RoutingHint] = (
            Batcher(self._send, max_batch, "kvbroker-hint-batches")
        )

    async def hint(self, request: registry_pb2.GetRoutingHintRequest) -> registry_pb2.RoutingHint:
        """The hint for one request; raises ``RegistryCallError`` (an ``AioRpcError`` with a
        reason) as GetRoutingHint would."""
        while True:
            try:
                return await self._batches.submit(request)
            except RegistryCallError as error:
                if error.reason != registry_pb2.ERROR_REASON_BATCH_FULL:
                    raise
            # The batch's answer was full before this request was looked at: the next batch.

    async def _send(
        self, requests: list[registry_pb2.GetRoutingHintRequest]
    ) -> list[registry_pb2.RoutingHint | BaseException]:
        try:
            response = await self._stub.BatchGetRoutingHints(
                registry_pb2.BatchGetRoutingHintsRequest(requests=requests),
                timeout=self._timeout_s,
            )
        except grpc.aio.AioRpcError as error:
            raise from_grpc_error(error) from error
        return [
            result.hint if result.HasField("hint") else from_grpc_error(result.error)
            for result in response.results
        ]
