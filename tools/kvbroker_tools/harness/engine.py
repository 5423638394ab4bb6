"""A stand-in for a vLLM OpenAI server, for tests and benchmarks whose subject is not vLLM: the
router's routing, pass-through and failures; a sidecar's view of its engine; the registry
replicas' failover soak. The behaviour that does depend on vLLM is tested against real vLLM
servers in tests/test_e2e.py.

It serves the routes kvbroker reads: ``/health`` (healthy or not, at will), ``/metrics`` (the
two gauges a sidecar reports as load, or any body at will), ``/v1/models`` and the turn routes
of every API the router serves (chat completions, completions, Anthropic's Messages with its
token count, OpenAI's Responses), each answering, whole or streamed, in its API's shape and
with ``kv_transfer_params`` where vLLM puts them. A turn is recorded, can be made to fail or
to drop its stream, and answers with the ``kv_transfer_params`` that ``kv_transfer_params()``
returns; a subclass that simulates an engine's KV (the soak's) overrides that and
``kv_cache_usage()``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from kvbroker.common.process.ports import free_port
from kvbroker.common.rules.handles import CONTENT_READ_KEY


class FakeEngine:
    def __init__(self, name: str, model: str = "tiny-qwen3", port: int | None = None) -> None:
        self.name = name
        self.model = model
        self.port = port if port is not None else free_port()
        # Every completion request body, in the order received.
        self.received: list[dict[str, Any]] = []
        # When set, answers every completion with this status and body.
        self.fail_with: tuple[int, dict[str, Any]] | None = None
        # When set, a stream stops (the connection drops) after this many chunks.
        self.die_after_chunks: int | None = None
        # What /health says (503 when not) and /metrics reports as requests running.
        self.healthy = True
        self.running = 0
        # A simulated prefill: each completion takes fixed + tokens * per_token seconds, the
        # prompt's tokens counted as its words (and said in ``usage``, as vLLM does).
        self.prefill_fixed_s = 0.0
        self.prefill_s_per_token = 0.0
        # How long /health takes to answer, and how many times it was asked.
        self.health_delay_s = 0.0
        self.health_probes = 0
        # When set, /metrics answers this body (200, as text) instead of the two gauges; how
        # many times /metrics was asked (a test waits for the sidecar's probes to read it).
        self.metrics_body: str | None = None
        self.metrics_scrapes = 0
        # When set, a prefill leg's answer says it read this (kvbroker's CONTENT_READ_KEY, as
        # a prefill engine that matched the prompt by content does).
        self.read_by_content: object = None
        self._serving: contextlib.AsyncExitStack | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def kv_transfer_params(self, body: dict[str, Any]) -> dict[str, Any]:
        """What a completion answers in ``kv_transfer_params``: a prefill leg (the request asks
        for remote decode) returns a handle to its blocks, any other request its own."""
        params = dict(body.get("kv_transfer_params") or {})
        if params.get("do_remote_decode"):
            params = {"do_remote_prefill": True, "remote_engine_id": f"engine-{self.name}",
                      "remote_request_id": "p-req", "remote_block_ids": [[0, 1]]}  # fmt: skip
            if self.read_by_content is not None:
                params[CONTENT_READ_KEY] = self.read_by_content
        return params

    def kv_cache_usage(self) -> float:
        """What /metrics reports as the KV cache's usage, 0 to 1."""
        return 0.25

    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/v1/chat/completions", self._completions, methods=["POST"]),
                Route("/v1/completions", self._completions, methods=["POST"]),
                Route("/v1/messages", self._completions, methods=["POST"]),
                Route("/v1/messages/count_tokens", self._count_tokens, methods=["POST"]),
                Route("/v1/responses", self._completions, methods=["POST"]),
                Route("/health", self._health),
                Route("/metrics", self._metrics),
                Route("/v1/models", self._models),
            ]
        )

    async def start(self) -> None:
        """Serves on its port until ``stop``."""
        self._serving = contextlib.AsyncExitStack()
        await self._serving.enter_async_context(serving(self.app(), self.port))

    async def stop(self) -> None:
        if self._serving is not None:
            await self._serving.aclose()

    async def __aenter__(self) -> FakeEngine:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def _completions(self, request: Request) -> Response:
        body = await request.json()
        self.received.append(body)
        if self.fail_with is not None:
            return JSONResponse(self.fail_with[1], self.fail_with[0])
        params = await self.kv_transfer_params(body)
        tokens = _prompt_words(body)
        if self.prefill_fixed_s or self.prefill_s_per_token:
            await asyncio.sleep(self.prefill_fixed_s + tokens * self.prefill_s_per_token)
        api = request.url.path
        if body.get("stream"):
            return StreamingResponse(self._stream(api, params), media_type="text/event-stream")
        return JSONResponse(_answer(api, f"from {self.name}", tokens, params))

    async def _stream(self, api: str, params: dict[str, Any]) -> AsyncIterator[bytes]:
        """Five tokens in the API's events; a Responses stream ends with its whole answer,
        ``kv_transfer_params`` in it, as vLLM's ``response.completed`` does."""
        events = _STREAMS.get(api, _chat_events)
        for i in range(5):
            if self.die_after_chunks is not None and i >= self.die_after_chunks:
                raise ConnectionResetError("engine died")
            yield events(f"t{i} ")
            await asyncio.sleep(0)
        if api == "/v1/responses":
            completed = {"type": "response.completed",
                         "response": _answer(api, "t0 t1 t2 t3 t4 ", 1, params)}  # fmt: skip
            yield _sse(completed, "response.completed")
        elif api == "/v1/messages":
            yield _sse({"type": "message_stop"}, "message_stop")
        else:
            yield b"data: [DONE]\n\n"

    async def _count_tokens(self, request: Request) -> Response:
        body = await request.json()
        self.received.append(body)
        if self.fail_with is not None:
            return JSONResponse(self.fail_with[1], self.fail_with[0])
        return JSONResponse({"input_tokens": _prompt_words(body)})

    async def _health(self, request: Request) -> Response:
        self.health_probes += 1
        if self.health_delay_s:
            await asyncio.sleep(self.health_delay_s)
        return JSONResponse({}, 200 if self.healthy else 503)

    async def _metrics(self, request: Request) -> Response:
        self.metrics_scrapes += 1
        if self.metrics_body is not None:
            return PlainTextResponse(self.metrics_body)
        labels = f'{{model_name="{self.model}"}}'
        return PlainTextResponse(
            "# TYPE vllm:num_requests_running gauge\n"
            f"vllm:num_requests_running{labels} {self.running}\n"
            "# TYPE vllm:kv_cache_usage_perc gauge\n"
            f"vllm:kv_cache_usage_perc{labels} {self.kv_cache_usage()}\n"
        )

    async def _models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": self.model}]})


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


def _prompt_words(body: dict[str, Any]) -> int:
    """A turn's prompt length, counted in words (the fake engine's tokens): its prompt, or its
    messages' (Responses: input items') text."""
    prompt = body.get("prompt", body.get("input"))
    if isinstance(prompt, str):
        return len(prompt.split())
    messages = body.get("messages", prompt)
    if not isinstance(messages, list):
        return 0
    return sum(len(_text(m.get("content")).split()) for m in messages if isinstance(m, dict))


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(p["text"] for p in content if isinstance(p, dict) and "text" in p)
    return ""


def _answer(api: str, text: str, tokens: int, params: dict[str, Any]) -> dict[str, Any]:
    """A whole answer in the API's shape, with ``kv_transfer_params`` at its top as vLLM puts
    them."""
    if api == "/v1/messages":
        return {"id": "msg-1", "type": "message", "role": "assistant", "model": "m",
                "content": [{"type": "text", "text": text}], "stop_reason": "end_turn",
                "usage": {"input_tokens": tokens, "output_tokens": 1},
                "kv_transfer_params": params}  # fmt: skip
    if api == "/v1/responses":
        return {"id": "resp-1", "object": "response", "status": "completed",
                "output": [{"type": "message", "role": "assistant",
                            "content": [{"type": "output_text", "text": text}]}],
                "usage": {"input_tokens": tokens, "output_tokens": 1},
                "kv_transfer_params": params}  # fmt: skip
    return {"id": "cmpl-1", "object": "chat.completion",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "finish_reason": "stop"}],
            "usage": {"prompt_tokens": tokens, "completion_tokens": 1},
            "kv_transfer_params": params}  # fmt: skip


def _sse(data: dict[str, Any], event: str | None = None) -> bytes:
    named = f"event: {event}\n" if event else ""
    return f"{named}data: {json.dumps(data)}\n\n".encode()


def _chat_events(token: str) -> bytes:
    return _sse({"choices": [{"index": 0, "delta": {"content": token}}]})


def _messages_events(token: str) -> bytes:
    delta = {"type": "content_block_delta", "index": 0,
             "delta": {"type": "text_delta", "text": token}}  # fmt: skip
    return _sse(delta, "content_block_delta")


def _responses_events(token: str) -> bytes:
    return _sse(
        {"type": "response.output_text.delta", "delta": token}, "response.output_text.delta"
    )


_STREAMS = {"/v1/messages": _messages_events, "/v1/responses": _responses_events}
