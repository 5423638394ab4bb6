"""Reading a client's request: the one place a body becomes what the router forwards, or an
``ApiError`` (400, 413) that says what is wrong with it.

The router serves four APIs the same way (``Api``): chat completions, completions, Anthropic's
Messages and OpenAI's Responses. vLLM serves each of them on every engine and each takes
``kv_transfer_params``, so a turn of any of them is two legs to the engines' own endpoint of
the same API; what differs between them is data here (what the max-tokens field is called,
where a leg carries the conversation, how usage counts the prompt, the error shape), never a
second code path.

A conversation's id is read in one place (``conversation_id``), from whichever of the
fields and headers that agents send it in is given first.

Whatever passes here can be encoded again for the two legs (``encode``): JSON without NaN or
Infinity, nested no deeper than ``MAX_JSON_DEPTH``, text without lone surrogates. Anything
else would fail later, in the middle of serving the request, as a 500.
"""

from __future__ import annotations

import json
import math
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from kvbroker.common.rules import ids
from kvbroker.common.rules.handles import SESSION_KEY
from kvbroker.common.rules.prompt_size import PromptText
from kvbroker.router.errors import ApiError, ErrorCode, ErrorShape, ErrorType, invalid_request
from kvbroker.v1 import registry_pb2

SESSION_HEADER = "x-session-id"
# What Claude Code sends its session id in (it also sends it in ``metadata.user_id``).
CLAUDE_CODE_SESSION_HEADER = "x-claude-code-session-id"
# What Codex CLI sends its session id in, with the Responses API (an underscore, no ``x-``).
CODEX_SESSION_HEADER = "session_id"
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
class Required:
    """A field an API requires, of one of ``types`` (``what`` says them to people)."""

    name: str
    types: tuple[type, ...]
    what: str


@dataclass(frozen=True)
class Api:
    """One API the router serves, as what its turns' legs differ by."""

    # Its name in logs.
    name: str
    # Its endpoint, the router's and every engine's.
    path: str
    # The field that bounds the answer's tokens: the prefill leg sets it to 1.
    max_tokens: str
    # Older names of the same bound, set to 1 too where the client gave them.
    max_tokens_aliases: tuple[str, ...] = ()
    # The body field an engine reads the conversation from; None where the API has none
    # (Messages): a leg carries it in ``kv_transfer_params`` (``SESSION_KEY``) instead, which
    # kvbroker's connector reads the same way.
    session_field: str | None = "session_id"
    # What the answer's ``usage`` calls the prompt's tokens.
    usage_prompt_tokens: str = "prompt_tokens"
    errors: ErrorShape = ErrorShape.OPENAI
    required: tuple[Required, ...] = ()
    # Fields the router refuses (400) with the reason it cannot serve them.
    refused: Mapping[str, str] | None = None


CHAT = Api("chat", "/v1/chat/completions", "max_tokens", ("max_completion_tokens",))
COMPLETIONS = Api("completions", "/v1/completions", "max_tokens")
MESSAGES = Api(
    "messages",
    "/v1/messages",
    "max_tokens",
    session_field=None,
    usage_prompt_tokens="input_tokens",
    errors=ErrorShape.ANTHROPIC,
    required=(
        Required("model", (str,), "a string"),
        Required("messages", (list,), "a list of messages"),
        Required("max_tokens", (int,), "a whole number"),
    ),
)
RESPONSES = Api(
    "responses",
    "/v1/responses",
    "max_output_tokens",
    usage_prompt_tokens="input_tokens",
    errors=ErrorShape.OPENAI_RESPONSES,
    required=(Required("input", (str, list), "a string or a list of input items"),),
    refused={
        # The stored response is on whichever decode engine served it (vLLM keeps it in that
        # process's memory, and only with VLLM_ENABLE_RESPONSES_API_STORE), and the prefill
        # leg goes to another engine: no leg could see the history it names.
        "previous_response_id": "previous_response_id is not supported through kvbroker's "
        "router, which keeps no responses: send the whole conversation in input each turn "
        "(with store false); kvbroker reuses its KV all the same",
    },
)
# Every API, by its path; a path under Messages' (``/v1/messages/...``) answers in its shape.
APIS = {api.path: api for api in (CHAT, COMPLETIONS, MESSAGES, RESPONSES)}


def error_shape(path: str) -> ErrorShape:
    """The error shape of whatever is asked at ``path`` (OpenAI's but for Messages')."""
    if path == MESSAGES.path or path.startswith(MESSAGES.path + "/"):
        return ErrorShape.ANTHROPIC
    api = APIS.get(path)
    return api.errors if api is not None else ErrorShape.OPENAI


@dataclass(frozen=True)
class Turn:
    """A turn of one of the APIs, as the router forwards it."""

    api: Api
    # The request without the router's own fields (``conversation_id``, ``conversation``).
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

    def prefill_leg(self, kv_params: dict[str, Any]) -> dict[str, Any]:
        """The prefill leg's body: the turn unstreamed, its answer bounded to one token."""
        body = dict(self.body)
        body.pop("stream", None)
        body.pop("stream_options", None)
        body[self.api.max_tokens] = 1
        for alias in self.api.max_tokens_aliases:
            if alias in body:
                body[alias] = 1
        return self._leg(body, kv_params)

    def decode_leg(self, kv_params: Any) -> dict[str, Any]:
        """The decode leg's body: the turn with the transfer parameters it continues from."""
        return self._leg(dict(self.body), kv_params)

    def _leg(self, body: dict[str, Any], kv_params: Any) -> dict[str, Any]:
        """``body`` with ``kv_params`` and the conversation where the API's engines read it."""
        if self.conversation and self.api.session_field is None:
            kv_params = {**(kv_params or {}), SESSION_KEY: self.conversation}
        elif self.conversation and self.api.session_field is not None:
            body[self.api.session_field] = self.conversation
        if kv_params is not None:
            body["kv_transfer_params"] = kv_params
        return body

    def prompt_tokens(self, answer: Mapping[str, Any]) -> int | None:
        """How many prompt tokens an engine's answer says it computed, if it says."""
        usage = answer.get("usage")
        tokens = usage.get(self.api.usage_prompt_tokens) if isinstance(usage, dict) else None
        return tokens if isinstance(tokens, int) and not isinstance(tokens, bool) else None


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


def parse_turn(
    raw: bytes, headers: Mapping[str, str], api: Api = CHAT, id_limit: int = ids.MAX_ID_LENGTH
) -> Turn:
    """A turn's body and headers as the router forwards them; a session id may be
    ``id_limit`` characters long (less than the registry's limit when the router scopes it to
    a tenant)."""
    body = parse_object(raw)
    for required in api.required:
        check_required(body, required)
    for name, why in (api.refused or {}).items():
        if body.get(name) is not None:
            raise invalid_request(why, ErrorCode.UNSUPPORTED_PARAMETER, name)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise invalid_request("model must be a string", ErrorCode.INVALID_VALUE, "model")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise invalid_request("stream must be true or false", ErrorCode.INVALID_VALUE, "stream")
    conversation = conversation_id(body, headers, id_limit)
    body.pop("conversation_id", None)
    body.pop("conversation", None)
    return Turn(
        api,
        body,
        conversation,
        model or "",
        bool(stream),
        _wanted_path(headers),
        PromptText.of(body),
    )


def check_required(body: Mapping[str, Any], required: Required) -> None:
    """A 400 unless ``body`` has the field, of its type and not empty."""
    value = body.get(required.name)
    if value is None:
        raise invalid_request(
            f"{required.name}: field required", ErrorCode.MISSING_FIELD, required.name
        )
    if isinstance(value, bool) or not isinstance(value, required.types) or value == "":
        raise invalid_request(
            f"{required.name} must be {required.what}", ErrorCode.INVALID_VALUE, required.name
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


def conversation_id(body: Mapping[str, Any], headers: Mapping[str, str], limit: int) -> str:
    """The conversation's id: the first given of, in order,

    1. the ``session_id`` field (vLLM's own, chat completions, completions and Responses);
    2. the ``X-Session-ID`` header (vLLM's and kvbroker's);
    3. the ``X-Claude-Code-Session-Id`` header (Claude Code);
    4. the ``session_id`` header (Codex CLI);
    5. the ``conversation_id`` field (vLLM's example P/D proxy);
    6. the Responses API's ``conversation`` field, an id or ``{"id": ...}`` (kvbroker keeps no
       conversation's items: the client still sends the whole input);
    7. the ``session_id`` in Messages' ``metadata.user_id`` when that is a JSON object (what
       Claude Code sends, beside its header).

    An explicit id comes before one a client derives, so a client that sets its own beside
    Claude Code's gets its own. Each is checked by the registry's own rule; "" is none."""
    for param, value in _session_sources(body, headers):
        if value is None or value == "":
            continue
        if not isinstance(value, str):
            raise invalid_request(f"{param} must be a string", ErrorCode.INVALID_SESSION_ID, param)
        return session_id(value, param, limit)
    return ""


def _session_sources(
    body: Mapping[str, Any], headers: Mapping[str, str]
) -> Iterator[tuple[str, object]]:
    """Where a conversation's id may be given, first first (``conversation_id``)."""
    yield "session_id", body.get("session_id")
    yield SESSION_HEADER, headers.get(SESSION_HEADER)
    yield CLAUDE_CODE_SESSION_HEADER, headers.get(CLAUDE_CODE_SESSION_HEADER)
    yield CODEX_SESSION_HEADER, headers.get(CODEX_SESSION_HEADER)
    yield "conversation_id", body.get("conversation_id")
    conversation = body.get("conversation")
    yield "conversation", conversation.get("id") if isinstance(conversation, dict) else conversation
    yield "metadata.user_id", _user_id_session(body.get("metadata"))


def _user_id_session(metadata: object) -> object:
    """The ``session_id`` in ``metadata.user_id`` when that is a JSON object holding one
    (Claude Code's); None for any other user id, which names a user, not a conversation."""
    user_id = metadata.get("user_id") if isinstance(metadata, dict) else None
    if not isinstance(user_id, str) or not user_id.startswith("{"):
        return None
    try:
        fields = json.loads(user_id)
    except ValueError:
        return None
    return fields.get("session_id") if isinstance(fields, dict) else None


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
