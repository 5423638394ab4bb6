"""The call batcher in isolation: one call in flight, the rest in the next, results in order."""

from __future__ import annotations

import asyncio

import pytest

from kvbroker.common.client.batcher import Batcher
from tests.conftest import eventually


async def test_concurrent_items_share_calls_and_get_their_own_results() -> None:
    calls: list[list[int]] = []
    answer = asyncio.Event()  # a call in flight answers once this is set
    answer.set()

    async def send(items: list[int]) -> list[int | BaseException]:
        calls.append(items)
        await answer.wait()
        return [ValueError(f"odd {i}") if i % 2 else i * 10 for i in items]

    batcher: Batcher[int, int] = Batcher(send, max_batch=4, name="test")
    assert await batcher.submit(2) == 20 and calls == [[2]]  # alone: sent at once
    answer.clear()
    first = asyncio.ensure_future(batcher.submit(0))
    await eventually(lambda: calls == [[2], [0]])  # its call is in flight
    rest = [asyncio.ensure_future(batcher.submit(i)) for i in range(1, 10)]
    await asyncio.sleep(0)  # each of the rest is submitted, behind the call in flight
    answer.set()
    results = await asyncio.gather(first, *rest, return_exceptions=True)
    assert [r for r in results if not isinstance(r, BaseException)] == [0, 20, 40, 60, 80]
    assert [str(r) for r in results if isinstance(r, BaseException)] == [
        f"odd {i}" for i in (1, 3, 5, 7, 9)
    ]
    # The rest queued behind the call in flight and went in the next ones, at most 4 a call.
    assert calls[1:] == [[0], [1, 2, 3, 4], [5, 6, 7, 8], [9]]


async def test_a_failed_call_fails_its_items_and_the_next_batch_still_goes() -> None:
    failures = iter([ConnectionError("registry gone")])

    async def send(items: list[str]) -> list[str | BaseException]:
        await asyncio.sleep(0.01)
        failure = next(failures, None)
        if failure is not None:
            raise failure
        return [item.upper() for item in items]

    batcher: Batcher[str, str] = Batcher(send, max_batch=100, name="test")
    first = asyncio.ensure_future(batcher.submit("a"))
    await asyncio.sleep(0)
    queued = asyncio.gather(batcher.submit("b"), batcher.submit("c"))
    with pytest.raises(ConnectionError):
        await first
    assert list(await queued) == ["B", "C"]


async def test_a_wrong_number_of_results_is_an_error_for_every_item() -> None:
    async def send(items: list[int]) -> list[int | BaseException]:
        return [1]

    batcher: Batcher[int, int] = Batcher(send, max_batch=10, name="test")
    results = await asyncio.gather(batcher.submit(1), batcher.submit(2), return_exceptions=True)
    assert all("1 results came back for 2 items" in str(r) for r in results)


async def test_callers_are_not_left_waiting_when_the_sender_is_cancelled() -> None:
    sending = asyncio.Event()

    async def send(items: list[int]) -> list[int | BaseException]:
        sending.set()
        await asyncio.sleep(3600)
        return list[int | BaseException](items)

    batcher: Batcher[int, int] = Batcher(send, max_batch=10, name="test")
    waiting = asyncio.ensure_future(batcher.submit(1))
    await asyncio.wait_for(sending.wait(), 5)
    for task in asyncio.all_tasks():
        if task.get_name() == "test":
            task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(waiting, 1)
