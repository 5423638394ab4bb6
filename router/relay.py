"""The decode leg's answer as the client gets it: streamed on as whole server-sent events,
and never with the decode engine's ``kv_transfer_params`` (its NIXL address, request and
block ids), whole or streamed: they are no client's business, and the next turn's handle
comes from the registry. Where an API puts them: at the top of a chat completion's,
completion's, Messages' or Responses' answer; on a chat stream's last event (vLLM 0.33); in the
``response`` object of a Responses stream's events (``response.completed`` holds the answer
whole). A Messages stream carries none.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import structlog

from kvbroker.router.errors import ErrorShape, internal_error, leg_failed
from kvbroker.router.proxy import Router
from kvbroker.v1 import node_pb2

log = structlog.get_logger("kvbroker.router")

HANDLE_KEY = "kv_transfer_params"


# An object inside an answer or event that is itself an answer (Responses' stream events).
_NESTED_ANSWER = "response"


def without_handle(answer: dict[str, Any]) -> bool:
    """Removes the decode engine's handle from an answer or event, and from the answer an
    event holds (``null`` too: Responses' first events name the field before it has a value);
    whether it had one."""
    nested = answer.get(_NESTED_ANSWER)
    objects = (answer, nested) if isinstance(nested, dict) else (answer,)
    had = [HANDLE_KEY in o for o in objects]
    for o in objects:
        o.pop(HANDLE_KEY, None)
    return any(had)


async def relay(
    router: Router,
    response: httpx.Response,
    first: bytes,
    chunks: AsyncIterator[bytes],
    node: node_pb2.NodeSpec,
    prefill_done: float,
    shape: ErrorShape,
) -> AsyncIterator[bytes]:
    """The rest of a streamed decode leg. A failure now cannot change the status (200, sent
    with the first chunk): the stream ends with the error as an event, as the API (``shape``)
    ends a stream that failed."""
    events = _Events()
    try:
        for event in events.feed(first):
            yield event
        async for chunk in chunks:
            for event in events.feed(chunk):
                yield event
        if events.rest:
            yield events.rest  # a stream that does not end its last event: as it came
        router.metrics.decode_seconds.observe(time.perf_counter() - prefill_done)
        return
    except httpx.HTTPError as error:
        failure = leg_failed("decode", node, error)
    except Exception:
        log.exception("router_bug", leg="decode stream")
        failure = internal_error()
    finally:
        await response.aclose()
    # An event cut short is dropped; the error event follows the last whole one.
    yield failure.sse(shape)


class _Events:
    """A decode stream's bytes as whole server-sent events, each without the handle."""

    def __init__(self) -> None:
        self.rest = b""

    def feed(self, chunk: bytes) -> list[bytes]:
        """The whole events ``chunk`` completes, each with its own blank-line end."""
        self.rest += chunk
        events, start = [], 0
        for end in _EVENT_END.finditer(self.rest):
            events.append(_without_handle(self.rest[start : end.start()]) + end.group())
            start = end.end()
        self.rest = self.rest[start:]
        return events


# An event ends with a blank line; SSE allows CRLF, LF or CR line ends.
_EVENT_END = re.compile(rb"\r\n\r\n|\n\n|\r\r")
_LINE_END = re.compile(rb"(\r\n|\n|\r)")


def _without_handle(event: bytes) -> bytes:
    if f'"{HANDLE_KEY}"'.encode() not in event:
        return event
    return b"".join(_line_without_handle(part) for part in _LINE_END.split(event))


def _line_without_handle(line: bytes) -> bytes:
    """A ``data:`` line (with or without its optional space) without the handle."""
    if not line.startswith(b"data:"):
        return line
    try:
        data = json.loads(line[5:])
    except ValueError:
        return line
    if not isinstance(data, dict) or not without_handle(data):
        return line
    return b"data: " + json.dumps(data, separators=(",", ":")).encode()
