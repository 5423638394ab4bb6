"""The lifetime of a kvbroker server process after it has started: its one JSON ready line
(what ``ChildProcess``'s ``Announces`` and deployment scripts read), then serving until
SIGINT or SIGTERM. Shared so that every server announces and stops alike."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from typing import Any

from kvbroker.common.process.heap import freeze_startup_heap


async def announce_and_serve(announcement: dict[str, Any]) -> None:
    """Freezes the startup heap, prints ``announcement`` as one JSON line, and returns once the
    process is asked to stop (SIGINT/SIGTERM); the caller then stops its servers."""
    freeze_startup_heap()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    print(json.dumps(announcement), flush=True, file=sys.stdout)
    await stop.wait()
