"""Reading a client's request: the one place a body becomes what the router forwards, or an
``ApiError`` (400, 413) that says what is wrong with it.

Whatever passes here can be encoded again for the two legs (``encode``): JSON without NaN or
Infinity, nested no deeper than ``MAX_JSON_DEPTH``, text without lone surrogates. Anything
else would fail later, in the middle of serving the request, as a 500.
"""

from __future__ import annotations

import json
import math
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

from kvbroker.common.rules import ids
from kvbroker.common.rules.prompt_size import PromptText
from kvbroker.router.errors import ApiError, ErrorCode, ErrorType, invalid_request
from kvbroker.v1 import registry_pb2

SESSION_HEADER = "x-session-id"
# A request may ask for its turn's path (READ, DECODE_LOCAL, RECOMPUTE); responses say which.
PATH_HEADER = "x-kvbroker-path"
_PATHS = {
    "READ": registry_pb2.TURN_PATH_READ,
    "DECODE_LOCAL": registry_pb2.TURN_PATH_DECODE_LOCAL,
    "RECOMPUTE": registry_pb2.TURN_PATH_RECOMPUTE,
}
# Deeper than any OpenAI request (tool schemas nest a few tens of levels), and far enough
# below Python's recursion limit that encoding a leg again can never hit it.
MAX_JSON_DEPTH = 128


@dataclass(frozen=True)
class Completion:
    """A completion request as the router forwards it."""

    # The request without ``conversation_id`` (vLLM's example proxy's field, the router's own).
    body: dict[str, Any]
    # The session id ("" when the client gave none: plain P/D).
    conversation: str
    # The model asked for ("" when none: any node).
    model: str
    stream: bool
    # The path the client asked for (UNSPECIFIED: the registry's planner chooses).
    wanted_path: registry_pb2.TurnPath
    # The prompt's characters, all and new (read once: the plan estimates by them and the
    # prefill leg's answer teaches the estimate).
    text: PromptText


async def read_body(chunks: AsyncIterator[bytes], content_length: str | None, limit: int) -> bytes:
    """The body, refused with 413 once it is over ``limit`` bytes: at once when its declared
    length says so, else while it arrives (a chunked body declares none)."""
    if content_length is not None and content_length.isdigit() and int(content_length) > limit:
        raise _too_large(limit)
    body = bytearray()
    async for chunk in chunks:
        body += chunk
        if len(body) > limit:
            raise _too_large(limit)
    return bytes(body)


def _too_large(limit: int) -> ApiError:
    return ApiError(
        413,
        f"the request body is over the limit of {limit} bytes",
        ErrorType.INVALID_REQUEST,
        ErrorCode.REQUEST_TOO_LARGE,
    )


def parse_object(raw: bytes) -> dict[str, Any]:
    """``raw`` as a JSON object the router can encode again; else a 400 that says why."""
    try:
        text = raw.decode()
    except UnicodeDecodeError:
        raise invalid_request(
            "the request body is not valid UTF-8", ErrorCode.INVALID_JSON
        ) from None
    try:
        value = json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_float)
    except RecursionError:
        raise _too_deep() from None
    except ValueError as error:  # JSONDecodeError, NaN, 1e999, an integer of 5,000 digits
        raise invalid_request(
            f"the request body is not valid JSON: {error}", ErrorCode.INVALID_JSON
        ) from None
    if not isinstance(value, dict):
        raise invalid_request("the request body must be a JSON object", ErrorCode.INVALID_JSON)
    _check_tree(value)
    return value


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is out of range for a number")
    return value


def _too_deep() -> ApiError:
    return invalid_request(
        f"the request body nests deeper than {MAX_JSON_DEPTH} levels", ErrorCode.INVALID_JSON
    )


def _check_tree(value: dict[str, Any]) -> None:
    """Refuses nesting past ``MAX_JSON_DEPTH`` and text that cannot be encoded as UTF-8 (JSON
    lets ``"\\ud800"`` through; neither a leg's body nor a protobuf string can carry it).
    Iterative, so that the check itself cannot run out of stack."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            if depth > MAX_JSON_DEPTH:
                raise _too_deep()
            for key, item in node.items():
                _check_text(key)
                stack.append((item, depth + 1))
        elif isinstance(node, list):
            if depth > MAX_JSON_DEPTH:
                raise _too_deep()
            stack.extend((item, depth + 1) for item in node)
        elif isinstance(node, str):
            _check_text(node)


def _check_text(text: str) -> None:
    if text.isascii():
        return
    try:
        text.encode()
    except UnicodeEncodeError:
        raise invalid_request(
            "the request body holds a lone surrogate, which is not Unicode text",
            ErrorCode.INVALID_JSON,
        ) from None


def parse_completion(
    raw: bytes, headers: Mapping[str, str], id_limit: int = ids.MAX_ID_LENGTH
) -> Completion:
    """A completion request's body and headers as the router forwards them; a session id
    may be ``id_limit`` characters long (less than the registry's limit when the router
    scopes it to a tenant)."""
    body = parse_object(raw)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise invalid_request("model must be a string", ErrorCode.INVALID_VALUE, "model")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise invalid_request("stream must be true or false", ErrorCode.INVALID_VALUE, "stream")
    conversation = _conversation_id(body, headers, id_limit)
    body.pop("conversation_id", None)
    return Completion(
        body, conversation, model or "", bool(stream), _wanted_path(headers), PromptText.of(body)
    )


def _wanted_path(headers: Mapping[str, str]) -> registry_pb2.TurnPath:
    """The path the ``X-KVBroker-Path`` header asks for (benchmarks' fixed arms, tests);
    UNSPECIFIED (the planner's choice) without it."""
    value = headers.get(PATH_HEADER)
    if not value:
        return registry_pb2.TURN_PATH_UNSPECIFIED
    path = _PATHS.get(value.upper())
    if path is None:
        raise invalid_request(
            f"{PATH_HEADER} must be READ, DECODE_LOCAL or RECOMPUTE, not {value!r}",
            ErrorCode.INVALID_VALUE,
            PATH_HEADER,
        )
    return path


def _conversation_id(body: dict[str, Any], headers: Mapping[str, str], limit: int) -> str:
    """The first session id given: ``session_id``, the ``X-Session-ID`` header, then
    ``conversation_id``; checked by the registry's own rule."""
    for param, value in (
        ("session_id", body.get("session_id")),
        (SESSION_HEADER, headers.get(SESSION_HEADER)),
        ("conversation_id", body.get("conversation_id")),
    ):
        if value is None or value == "":
            continue
        if not isinstance(value, str):
            raise invalid_request(f"{param} must be a string", ErrorCode.INVALID_SESSION_ID, param)
        return session_id(value, param, limit)
    return ""


def session_id(value: str, param: str = "session_id", limit: int = ids.MAX_ID_LENGTH) -> str:
    """``value`` if the registry would take it as a conversation id (``limit`` characters at
    most); else a 400."""
    try:
        return ids.check_id(value, param, limit)
    except ids.InvalidId as error:
        raise invalid_request(str(error), ErrorCode.INVALID_SESSION_ID, param) from None


def encode(body: dict[str, Any]) -> bytes:
    """A leg's body, as compact UTF-8 JSON (what ``parse_object`` let through encodes)."""
    return json.dumps(body, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()
