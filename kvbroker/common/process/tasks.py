"""Running a session's loops together, and waiting for something to come up."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


async def until_first_exits(*loops: Coroutine[Any, Any, None]) -> None:
    """Runs loops that should never end; when one does (or fails), cancels the others and
    re-raises its error, so the caller can tear the session down and start a new one."""
    tasks = [asyncio.create_task(loop) for loop in loops]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            task.result()
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def poll_until(
    check: Callable[[], Awaitable[T]],
    within_s: float,
    what: str,
    every_s: float = 0.1,
    retrying: tuple[type[BaseException], ...] = (Exception,),
) -> T:
    """Calls ``check`` until it returns something truthy, and returns that. Its errors of the
    ``retrying`` kinds count as "not yet" (by default all: a server that is still starting
    refuses calls); any other error ends the wait. Raises TimeoutError naming ``what`` when
    ``within_s`` has passed."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        with contextlib.suppress(*retrying):
            if result := await check():
                return result
        await asyncio.sleep(every_s)
    raise TimeoutError(f"{what} not reached within {within_s:.0f} s")


def own_cancellation() -> bool:
    """Whether the ``CancelledError`` being handled is this task's own cancellation (someone
    called ``cancel()`` on it: it must end) rather than one raised from below. grpc.aio ends a
    call with ``CancelledError`` when its channel is closed under it, as a shared etcd client
    is when another task's call on it fails and reconnects: that is a failed call, to be
    handled like any other failure, and a loop that took it for its own end would stop for
    good without a word."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0
