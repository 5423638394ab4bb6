"""Routing hints batched the way group commit batches writes: one BatchGetRoutingHints call in
flight at a time, and whatever arrives meanwhile goes in the next one. An idle router sends each
hint alone and at once; a busy one pays the per-call cost (most of a hint's price in a Python
gRPC server) once per batch instead of once per turn."""

from __future__ import annotations

import asyncio

import grpc

from kvbroker.v1 import registry_pb2
from kvbroker.v1.registry_pb2_grpc import RegistryServiceStub

_STATUS_BY_CODE = {status.value[0]: status for status in grpc.StatusCode}


def _refusal(error: registry_pb2.HintError) -> grpc.aio.AioRpcError:
    """A per-request error as the error GetRoutingHint would have raised, so callers handle
    batched and single hints alike."""
    code = _STATUS_BY_CODE.get(error.code, grpc.StatusCode.UNKNOWN)
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), error.message)


class HintBatcher:
    def __init__(self, stub: RegistryServiceStub, timeout_s: float, max_batch: int = 256) -> None:
        self._stub = stub
        self._timeout_s = timeout_s
        self._max_batch = max_batch
        self._pending: list[
            tuple[registry_pb2.GetRoutingHintRequest, asyncio.Future[registry_pb2.RoutingHint]]
        ] = []
        self._sender: asyncio.Task[None] | None = None

    async def hint(self, request: registry_pb2.GetRoutingHintRequest) -> registry_pb2.RoutingHint:
        """The hint for one request; raises ``grpc.aio.AioRpcError`` as GetRoutingHint would."""
        future: asyncio.Future[registry_pb2.RoutingHint] = (
            asyncio.get_running_loop().create_future()
        )
        self._pending.append((request, future))
        if self._sender is None or self._sender.done():
            self._sender = asyncio.create_task(self._send(), name="kvbroker-hint-batches")
        return await future

    async def _send(self) -> None:
        while self._pending:
            batch = self._pending[: self._max_batch]
            del self._pending[: self._max_batch]
            try:
                response = await self._stub.BatchGetRoutingHints(
                    registry_pb2.BatchGetRoutingHintsRequest(requests=[r for r, _ in batch]),
                    timeout=self._timeout_s,
                )
            except grpc.aio.AioRpcError as error:
                for _, future in batch:
                    if not future.done():
                        future.set_exception(error)
                continue
            results = list(response.results)
            if len(results) != len(batch):
                mismatch = registry_pb2.HintError(
                    code=grpc.StatusCode.INTERNAL.value[0],
                    message=f"{len(results)} hints came back for {len(batch)} requests",
                )
                results = [registry_pb2.RoutingHintResult(error=mismatch)] * len(batch)
            for (_, future), result in zip(batch, results, strict=True):
                if future.done():
                    continue  # its caller gave up waiting
                if result.HasField("hint"):
                    future.set_result(result.hint)
                else:
                    future.set_exception(_refusal(result.error))
