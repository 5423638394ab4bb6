"""How a kvbroker server process serves: its gRPC server, with the limits every one of them
needs, and its lifetime after it has started (its one JSON ready line, what ``ChildProcess``'s
``Announces`` and deployment scripts read, then serving until SIGINT or SIGTERM). Shared so
that every server queues, announces and stops alike."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from typing import Any

import grpc

from kvbroker.common.process.heap import freeze_startup_heap

# gRPC's core queues the calls that arrive before the server's Python side asks for them (an
# asyncio server asks for one at a time, between the tasks its event loop runs). Past 1,000
# queued it refuses new calls at random, and past 3,000 every one: its client reads CANCELLED.
# A fleet's heartbeats and hints reach the registry faster than that while a replay holds its
# loop, and a refused heartbeat can end a node's session, so the calls wait instead, each
# bounded by its own deadline; past 20,000 (a few KB each) the server is overloaded.
MAX_QUEUED_CALLS = 20_000
SERVER_OPTIONS = [
    ("grpc.server.max_pending_requests", MAX_QUEUED_CALLS),
    ("grpc.server.max_pending_requests_hard_limit", MAX_QUEUED_CALLS),
]


def grpc_server() -> grpc.aio.Server:
    """An asyncio gRPC server that lets up to ``MAX_QUEUED_CALLS`` wait for its loop."""
    return grpc.aio.server(options=SERVER_OPTIONS)


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
