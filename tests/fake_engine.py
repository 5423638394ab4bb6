"""A stand-in OpenAI server for router tests whose behaviour does not depend on vLLM (routing,
pass-through, failures). It records what it received and can be told to fail. The behaviour
that does depend on vLLM is tested against real vLLM servers in test_e2e.py."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kvbroker.common.ports import free_port


@dataclass
class FakeEngine:
    name: str
    port: int = field(default_factory=free_port)
    received: list[dict[str, Any]] = field(default_factory=list)
    # When set, answers every completion with this status and body.
    fail_with: tuple[int, dict[str, Any]] | None = None
    # When set, a stream stops (the connection drops) after this many chunks.
    die_after_chunks: int | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def app(self) -> Starlette:
        async def completions(request: Request) -> Response:
            body = await request.json()
            self.received.append(body)
            if self.fail_with is not None:
                return JSONResponse(self.fail_with[1], self.fail_with[0])
            params = dict(body.get("kv_transfer_params") or {})
            if params.get("do_remote_decode"):
                params = {"do_remote_prefill": True, "remote_engine_id": f"engine-{self.name}",
                          "remote_request_id": "p-req", "remote_block_ids": [[0, 1]]}  # fmt: skip
            if body.get("stream"):
                return StreamingResponse(self._stream(), media_type="text/event-stream")
            return JSONResponse(
                {
                    "id": "cmpl-1",
                    "object": "chat.completion",
                    "choices": [{"index": 0, "message": {"role": "assistant",
                                                         "content": f"from {self.name}"}}],
                    "kv_transfer_params": params,
                }
            )  # fmt: skip

        async def health(request: Request) -> Response:
            return JSONResponse({})

        return Starlette(
            routes=[
                Route("/v1/chat/completions", completions, methods=["POST"]),
                Route("/v1/completions", completions, methods=["POST"]),
                Route("/health", health),
            ]
        )

    async def _stream(self) -> AsyncIterator[bytes]:
        for i in range(5):
            if self.die_after_chunks is not None and i >= self.die_after_chunks:
                raise ConnectionResetError("engine died")
            chunk = {"choices": [{"index": 0, "delta": {"content": f"t{i} "}}]}
            yield f"data: {json.dumps(chunk)}\n\n".encode()
            await asyncio.sleep(0)
        yield b"data: [DONE]\n\n"


@contextlib.asynccontextmanager
async def serving(app: Any, port: int) -> AsyncIterator[None]:
    """Serves an ASGI app with uvicorn on loopback for the duration of the block."""
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="critical", lifespan="on")
    )
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            task.result()
        await asyncio.sleep(0.01)
    try:
        yield
    finally:
        server.should_exit = True
        await task
