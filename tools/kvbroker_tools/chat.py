"""One chat turn through a stack's router, streamed and timed as a client sees it: what the
benchmarks measure (``kvbroker_tools.bench.turns``), the demo shows and the test harness checks
(``kvbroker_tools.harness.turns``), below both so that neither imports the other.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import httpx

from kvbroker_tools.stack import Stack


@dataclass(frozen=True)
class Streamed:
    """A streamed chat completion as the client saw it."""

    status: int
    text: str
    # From the request to its first event with a choice (vLLM sends its first chunk with the
    # first generated token), and to its end.
    ttft_s: float
    e2e_s: float
    headers: httpx.Headers
    usage: dict[str, int]
    # The answer's body when it is not a 200 (an error object).
    error: str = ""


async def stream_chat(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], headers: dict[str, str]
) -> Streamed:
    """Streams one chat completion (``body`` asks for a stream) and times it. An error event
    mid-stream raises RuntimeError: the stream's 200 status was sent before it failed."""
    started = time.perf_counter()
    ttft: float | None = None
    parts: list[str] = []
    usage: dict[str, int] = {}
    async with client.stream("POST", url, json=body, headers=headers) as response:
        if response.status_code != 200:
            error = (await response.aread()).decode(errors="replace")
            elapsed = time.perf_counter() - started
            return Streamed(response.status_code, "", elapsed, elapsed, response.headers, {}, error)
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"stream failed: {event['error']}")
            if event.get("usage"):
                usage = event["usage"]
            choices = event.get("choices") or []
            if choices and ttft is None:
                ttft = time.perf_counter() - started
            for choice in choices:
                parts.append(choice.get("delta", {}).get("content") or "")
    done = time.perf_counter() - started
    text = "".join(parts)
    return Streamed(response.status_code, text, ttft if ttft is not None else done, done,
                    response.headers, usage)  # fmt: skip


async def streamed_turn(
    client: httpx.AsyncClient,
    stack: Stack,
    messages: list[dict[str, str]],
    session: str | None,
    max_tokens: int,
    path: str | None = None,
    base_url: str | None = None,
) -> Streamed:
    """One chat turn through the stack's router (or the router at ``base_url``), streamed, at
    temperature 0: the session id (if any) in the body and in ``X-Session-ID``, as agent
    frameworks send it; ``path`` asks the planner for a path (``x-kvbroker-path``)."""
    body: dict[str, Any] = {
        "model": stack.config.served_model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    headers = {"x-kvbroker-path": path} if path else {}
    if session is not None:
        body["session_id"] = session
        headers["x-session-id"] = session
    url = f"{base_url or stack.router_url}/v1/chat/completions"
    return await stream_chat(client, url, body, headers)
