"""One measured chat turn through the router, as a client sees it.

TTFT is measured on the client (first streamed content); P's prefill leg comes from the
router's ``x-kvbroker-prefill-ms`` header; the KV read from D comes from the prefill server's
NIXL telemetry (only D->P reads are initiated by P, so every delta there is reuse).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from kvbroker.bench.read_shapes import ShapeTotals, shape_totals, turn_shapes
from kvbroker.common.rules.engine_metrics import Totals, read_totals
from kvbroker.stack import Stack


@dataclass
class TurnRecord:
    conversation_id: str
    # "opening" (the conversation's first turn) or "follow-up" (the measured point).
    kind: str
    # The benchmark arm (kvbroker.bench.multiturn.ARMS), the new suffix's size and the
    # repetition of its point.
    arm: str
    suffix: str
    repetition: int
    target_tokens: int
    input_num_tokens: int
    output_num_tokens: int
    ttft_ms: float
    e2e_ms: float
    prefill_leg_ms: float
    kv_read_ms: float
    kv_read_bytes: float
    kv_reads: int
    decision: str
    # The path the turn took (READ, DECODE_LOCAL, RECOMPUTE).
    path: str = "?"
    # The hint's consistency (EXACT; DEGRADED: from a view that may be behind, or none).
    consistency: str = "?"
    # The NIXL READs issued during the turn, by direction (d_to_p: P reading retained KV;
    # p_to_d: D pulling the prefill leg): reads, blocks, runs (``bench.read_shapes``).
    read_shapes: dict[str, dict[str, float]] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


async def read_shape_totals(client: httpx.AsyncClient, stack: Stack) -> dict[str, ShapeTotals]:
    """The READ shapes P and D have issued so far (each engine counts the READs it issues)."""
    totals: dict[str, ShapeTotals] = {}
    for engine in (stack.prefill, stack.decode):
        text = (await client.get(f"{stack.url(engine)}/metrics")).text
        for direction, found in shape_totals(text).items():
            totals[direction] = found.plus(totals.get(direction, ShapeTotals()))
    return totals


async def prefill_totals(client: httpx.AsyncClient, prefill_url: str) -> Totals:
    """P's running totals, its NIXL reads among them: a turn's reads are their difference."""
    totals = read_totals((await client.get(f"{prefill_url}/metrics")).text)
    if totals is None:
        raise RuntimeError(f"{prefill_url}/metrics reports totals that are not totals")
    return totals


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


async def measured_turn(
    client: httpx.AsyncClient,
    stack: Stack,
    messages: list[dict[str, str]],
    session: str | None,
    max_tokens: int,
    path: str | None = None,
    base_url: str | None = None,
) -> tuple[str, dict[str, Any]]:
    """Streams one chat completion through the stack's router, or the router at ``base_url``
    (asking for ``path``, if given); returns the answer and its measurements."""
    prefill_url = stack.url(stack.prefill)
    before = await prefill_totals(client, prefill_url)
    shapes_before = await read_shape_totals(client, stack)
    turn = await streamed_turn(client, stack, messages, session, max_tokens, path, base_url)
    if turn.status != 200:
        raise RuntimeError(f"router answered {turn.status}: {turn.error!r}")
    after = await prefill_totals(client, prefill_url)
    shapes_after = await read_shape_totals(client, stack)
    headers = turn.headers
    return turn.text, {
        "input_num_tokens": int(turn.usage.get("prompt_tokens", 0)),
        "output_num_tokens": int(turn.usage.get("completion_tokens", 0)),
        "ttft_ms": 1000 * turn.ttft_s,
        "e2e_ms": 1000 * turn.e2e_s,
        "prefill_leg_ms": float(headers.get("x-kvbroker-prefill-ms", "nan")),
        "kv_read_ms": 1000 * (after.read_seconds - before.read_seconds),
        "kv_read_bytes": after.read_bytes - before.read_bytes,
        "kv_reads": int(after.reads - before.reads),
        "decision": headers.get("x-kvbroker-decision", "?"),
        "path": headers.get("x-kvbroker-path", "?"),
        "consistency": headers.get("x-kvbroker-consistency", "?"),
        "read_shapes": turn_shapes(shapes_before, shapes_after),
    }
