"""Calls batched the way group commit batches writes: one call in flight at a time, and
whatever arrives meanwhile goes in the next one. An idle caller sends each item alone and at
once; a busy one pays the per-call cost (most of the price of a small call in Python gRPC)
once per batch instead of once per item, and the batches grow with the load instead of the
queue of calls."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Generic, TypeVar

ItemT = TypeVar("ItemT")
ResultT = TypeVar("ResultT")

# Sends one batch; returns one result or exception per item, in order, or raises for all.
SendBatch = Callable[[list[ItemT]], Awaitable[Sequence[ResultT | BaseException]]]


class Batcher(Generic[ItemT, ResultT]):
    def __init__(self, send: SendBatch[ItemT, ResultT], max_batch: int, name: str) -> None:
        self._send_batch = send
        self._max_batch = max_batch
        self._name = name
        self._pending: list[tuple[ItemT, asyncio.Future[ResultT]]] = []
        self._sender: asyncio.Task[None] | None = None

    async def submit(self, item: ItemT) -> ResultT:
        """The item's result once its batch is answered; raises what the batch or the item
        failed with."""
        future: asyncio.Future[ResultT] = asyncio.get_running_loop().create_future()
        self._pending.append((item, future))
        if self._sender is None or self._sender.done():
            self._sender = asyncio.create_task(self._send(), name=self._name)
        return await future

    async def _send(self) -> None:
        while self._pending:
            batch = self._pending[: self._max_batch]
            del self._pending[: self._max_batch]
            try:
                results = await self._send_batch([item for item, _ in batch])
                if len(results) != len(batch):
                    raise RuntimeError(f"{len(results)} results came back for {len(batch)} items")
            except Exception as error:  # every item of the batch fails with it
                results = [error] * len(batch)
            except BaseException:  # cancelled (shutdown): its callers must not wait forever
                for _, future in batch:
                    future.cancel()
                raise
            for (_, future), result in zip(batch, results, strict=True):
                if future.done():
                    continue  # its caller gave up waiting
                if isinstance(result, BaseException):
                    future.set_exception(result)
                else:
                    future.set_result(result)
