"""Running a session's loops together."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any


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
