"""The router's request parsing (``router.requests``), fuzzed: whatever a client sends, the
answer is a request the router can forward (its legs encode) or an ``ApiError`` in its API's
shape, never an exception that would be a 500. Then, for the APIs agents speak (Messages,
Responses): where a conversation's id is read from and in what order, how each API's legs
differ, what each refuses, and each API's error shape."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbroker.common.rules.handles import SESSION_KEY
from kvbroker.common.rules.ids import MAX_ID_LENGTH
from kvbroker.router.errors import ApiError, ErrorCode, ErrorShape, ErrorType, in_shape
from kvbroker.router.relay import without_handle
from kvbroker.router.requests import (
    CHAT,
    MAX_JSON_DEPTH,
    MESSAGES,
    RESPONSES,
    Api,
    conversation_id,
    encode,
    error_shape,
    parse_turn,
    read_body,
)

# Bounded so the module takes a few seconds in the normal suite.
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# Every character, lone surrogates included (JSON's "\ud800" produces one).
ANY_TEXT = st.text(st.characters(exclude_categories=()), max_size=20)
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | ANY_TEXT,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(ANY_TEXT, children, max_size=4)
    ),
    max_leaves=30,
)
# Values in the fields the router reads itself.
FIELDS = st.fixed_dictionaries(
    {},
    optional={
        "model": JSON_VALUES | st.sampled_from(["tiny-qwen3", ""]),
        "stream": JSON_VALUES | st.booleans(),
        "session_id": JSON_VALUES | ANY_TEXT | st.text(min_size=250, max_size=260),
        "conversation_id": JSON_VALUES | ANY_TEXT,
        "messages": JSON_VALUES,
    },
)
HEADERS = st.fixed_dictionaries({}, optional={"x-session-id": st.text(max_size=300)})


def check(raw: bytes, headers: dict[str, str]) -> None:
    """The property: a 400 in OpenAI's shape, or a request whose legs encode and say what
    the client sent."""
    try:
        completion = parse_turn(raw, headers)
    except ApiError as error:
        assert error.status == 400
        body = error.body()["error"]
        assert body["type"] == "invalid_request_error" and body["message"]
        json.dumps(body)
        return
    leg = encode({**completion.body, "kv_transfer_params": None})
    assert json.loads(leg)["kv_transfer_params"] is None
    assert "conversation_id" not in completion.body
    assert isinstance(completion.stream, bool)
    if completion.conversation:
        assert len(completion.conversation) <= MAX_ID_LENGTH
        completion.conversation.encode()


@FUZZ
@given(st.binary(max_size=200), HEADERS)
def test_arbitrary_bytes(raw: bytes, headers: dict[str, str]) -> None:
    check(raw, headers)


@FUZZ
@given(JSON_VALUES | FIELDS, HEADERS)
def test_arbitrary_json_values(value: Any, headers: dict[str, str]) -> None:
    # ensure_ascii writes a lone surrogate as "\udXXX", as a client's JSON library would;
    # allow_nan writes NaN and Infinity, which are not JSON.
    check(json.dumps(value, ensure_ascii=True, allow_nan=True).encode(), headers)


# Number literals a JSON library never writes but a client may send: beyond a float's range,
# or with more digits than Python converts.
NUMBERS = st.from_regex(
    r"-?(0|[1-9][0-9]{0,3})(\.[0-9]{1,3})?([eE][+-]?[0-9]{1,4})?", fullmatch=True
)
LONG_INTEGERS = st.integers(1, 6000).map(lambda digits: "7" * digits)


@FUZZ
@given(NUMBERS | LONG_INTEGERS, HEADERS)
def test_arbitrary_number_literals(number: str, headers: dict[str, str]) -> None:
    check(('{"model": "m", "temperature": ' + number + "}").encode(), headers)


@FUZZ
@given(st.integers(1, 3 * MAX_JSON_DEPTH), st.sampled_from(["[", '{"a":']))
def test_nesting_is_refused_past_the_limit_only(depth: int, opener: str) -> None:
    closer = "]" if opener == "[" else "}"
    # The request object is the first level, the field's value holds the rest.
    value = opener * (depth - 1) + "1" + closer * (depth - 1)
    raw = ('{"model": "m", "x": ' + value + "}").encode()
    try:
        parse_turn(raw, {})
    except ApiError as error:
        assert error.status == 400
        assert depth > MAX_JSON_DEPTH
    else:
        assert depth <= MAX_JSON_DEPTH


@FUZZ
@given(
    st.lists(st.text(st.characters(codec="utf-8"), max_size=30), min_size=1, max_size=5),
    st.text(st.characters(codec="utf-8"), min_size=1, max_size=MAX_ID_LENGTH),
    st.booleans(),
)
def test_well_formed_requests_pass_unchanged(
    contents: list[str], session: str, stream: bool
) -> None:
    body = {
        "model": "tiny-qwen3",
        "messages": [{"role": "user", "content": c} for c in contents],
        "stream": stream,
        "temperature": 0.5,
    }
    raw = json.dumps({**body, "conversation_id": session}).encode()
    completion = parse_turn(raw, {})
    assert (completion.body, completion.conversation) == (body, session)
    assert (completion.model, completion.stream) == ("tiny-qwen3", stream)


async def _chunks(sizes: list[int]) -> AsyncIterator[bytes]:
    for size in sizes:
        yield b"x" * size


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 50), max_size=10), st.integers(0, 200), st.booleans())
async def test_a_body_is_read_up_to_the_limit(sizes: list[int], limit: int, declared: bool) -> None:
    length = str(sum(sizes)) if declared else None
    try:
        body = await read_body(_chunks(sizes), length, limit)
    except ApiError as error:
        assert error.status == 413
        assert sum(sizes) > limit
    else:
        assert body == b"x" * sum(sizes) and len(body) <= limit


async def test_a_declared_length_over_the_limit_is_refused_before_reading() -> None:
    async def unread() -> AsyncIterator[bytes]:
        raise AssertionError("the body was read")
        yield b""

    with pytest.raises(ApiError) as refused:
        await read_body(unread(), "10", 5)
    assert refused.value.status == 413


# ------------------------------------------------------------ the APIs agents speak


@FUZZ
@given(JSON_VALUES | FIELDS, HEADERS, st.sampled_from([CHAT, MESSAGES, RESPONSES]))
def test_every_api_parses_or_refuses_in_its_shape(
    value: Any, headers: dict[str, str], api: Api
) -> None:
    """Whatever the body, each API's parse is a turn whose legs encode or a 400 that its
    shape can say."""
    raw = json.dumps(value, ensure_ascii=True, allow_nan=True).encode()
    try:
        turn = parse_turn(raw, headers, api)
    except ApiError as error:
        assert error.status == 400
        json.dumps(error.body(api.errors))
        return
    json.loads(encode(turn.prefill_leg({"do_remote_decode": True})))
    json.loads(encode(turn.decode_leg(None)))
    assert "conversation" not in turn.body


CLAUDE_CODE_USER_ID = json.dumps(
    {"device_id": "d" * 64, "account_uuid": "", "session_id": "cc-session-1"}
)


@pytest.mark.parametrize(
    ("body", "headers", "expected"),
    [
        # One source each.
        ({"session_id": "body"}, {}, "body"),
        ({}, {"x-session-id": "header"}, "header"),
        ({}, {"x-claude-code-session-id": "claude"}, "claude"),
        ({}, {"session_id": "codex"}, "codex"),
        ({"conversation_id": "proxy"}, {}, "proxy"),
        ({"conversation": "conv_1"}, {}, "conv_1"),
        ({"conversation": {"id": "conv_2"}}, {}, "conv_2"),
        ({"metadata": {"user_id": CLAUDE_CODE_USER_ID}}, {}, "cc-session-1"),
        # A user id that is no JSON object names a user, not a conversation.
        ({"metadata": {"user_id": "user-42"}}, {}, ""),
        ({"metadata": {"user_id": "{not json"}}, {}, ""),
        ({"metadata": {"user_id": json.dumps({"device_id": "d"})}}, {}, ""),
        ({"metadata": "not an object"}, {}, ""),
        # Precedence: the body's session_id, then X-Session-ID, then Claude Code's header,
        # then Codex's, then conversation_id, then conversation, then metadata.user_id.
        (
            {"session_id": "body", "conversation_id": "proxy", "conversation": "c"},
            {"x-session-id": "header", "x-claude-code-session-id": "claude"},
            "body",
        ),
        (
            {"conversation_id": "proxy", "metadata": {"user_id": CLAUDE_CODE_USER_ID}},
            {"x-session-id": "header", "x-claude-code-session-id": "claude"},
            "header",
        ),
        (
            {"conversation_id": "proxy", "metadata": {"user_id": CLAUDE_CODE_USER_ID}},
            {"x-claude-code-session-id": "claude", "session_id": "codex"},
            "claude",
        ),
        ({"conversation_id": "proxy", "conversation": "c"}, {"session_id": "codex"}, "codex"),
        ({"conversation_id": "proxy", "conversation": "c"}, {}, "proxy"),
        ({"conversation": "c", "metadata": {"user_id": CLAUDE_CODE_USER_ID}}, {}, "c"),
        # An empty source is no source.
        ({"session_id": "", "conversation": {"id": ""}}, {"x-session-id": ""}, ""),
    ],
)
def test_the_session_id_is_the_first_source_given(
    body: dict[str, Any], headers: dict[str, str], expected: str
) -> None:
    assert conversation_id(body, headers, MAX_ID_LENGTH) == expected


@pytest.mark.parametrize(
    ("body", "headers", "param"),
    [
        ({"conversation": {"id": 7}}, {}, "conversation"),
        ({"conversation": ["c"]}, {}, "conversation"),
        ({"metadata": {"user_id": json.dumps({"session_id": 7})}}, {}, "metadata.user_id"),
        ({"metadata": {"user_id": json.dumps({"session_id": "s" * 300})}}, {}, "metadata.user_id"),
        ({}, {"x-claude-code-session-id": "s" * (MAX_ID_LENGTH + 1)}, "x-claude-code-session-id"),
    ],
)
def test_an_invalid_session_id_is_refused_wherever_it_came(
    body: dict[str, Any], headers: dict[str, str], param: str
) -> None:
    with pytest.raises(ApiError) as refused:
        conversation_id(body, headers, MAX_ID_LENGTH)
    assert refused.value.code is ErrorCode.INVALID_SESSION_ID
    assert refused.value.param == param


def test_each_api_bounds_its_prefill_leg_in_its_own_field() -> None:
    """The prefill leg asks for one token in the API's own field, unstreamed, with the
    transfer parameters; the conversation rides where the API's engine reads it: the
    ``session_id`` field, or (Messages, which has none) ``kv_transfer_params``."""
    prefill = {"do_remote_decode": True}
    messages = parse_turn(
        json.dumps(
            {
                "model": "m",
                "max_tokens": 9,
                "stream": True,
                "messages": [{"role": "user", "content": "hi"}],
            }
        ).encode(),
        {"x-claude-code-session-id": "cc"},
        MESSAGES,
    )
    leg = messages.prefill_leg(prefill)
    assert leg["max_tokens"] == 1 and "stream" not in leg and "session_id" not in leg
    assert leg["kv_transfer_params"] == {**prefill, SESSION_KEY: "cc"}
    decode = messages.decode_leg({"remote_engine_id": "p"})
    assert decode["max_tokens"] == 9 and decode["stream"] is True
    assert decode["kv_transfer_params"] == {"remote_engine_id": "p", SESSION_KEY: "cc"}
    assert messages.decode_leg(None)["kv_transfer_params"] == {SESSION_KEY: "cc"}

    responses = parse_turn(
        json.dumps(
            {"model": "m", "input": "hi", "max_output_tokens": 9, "conversation": {"id": "conv"}}
        ).encode(),
        {},
        RESPONSES,
    )
    leg = responses.prefill_leg(prefill)
    assert leg["max_output_tokens"] == 1 and "max_tokens" not in leg
    assert leg["session_id"] == "conv" and "conversation" not in leg
    assert leg["kv_transfer_params"] == prefill
    assert responses.decode_leg(None)["max_output_tokens"] == 9
    assert "kv_transfer_params" not in responses.decode_leg(None)

    chat = parse_turn(
        json.dumps({"model": "m", "messages": [], "max_completion_tokens": 9}).encode(), {}
    )
    leg = chat.prefill_leg(prefill)
    assert (leg["max_tokens"], leg["max_completion_tokens"]) == (1, 1)
    assert "session_id" not in leg  # no conversation: plain P/D


def test_usage_is_read_by_each_apis_name_for_prompt_tokens() -> None:
    chat = parse_turn(b'{"messages": []}', {})
    responses = parse_turn(b'{"input": "hi"}', {}, RESPONSES)
    assert chat.prompt_tokens({"usage": {"prompt_tokens": 7}}) == 7
    assert responses.prompt_tokens({"usage": {"input_tokens": 7}}) == 7
    assert responses.prompt_tokens({"usage": {"prompt_tokens": 7}}) is None
    assert chat.prompt_tokens({"usage": {"prompt_tokens": True}}) is None


@pytest.mark.parametrize(
    ("api", "body", "code", "param"),
    [
        (MESSAGES, {"messages": [], "max_tokens": 5}, ErrorCode.MISSING_FIELD, "model"),
        (MESSAGES, {"model": "m", "messages": []}, ErrorCode.MISSING_FIELD, "max_tokens"),
        (MESSAGES, {"model": "m", "max_tokens": 5}, ErrorCode.MISSING_FIELD, "messages"),
        (
            MESSAGES,
            {"model": "", "messages": [], "max_tokens": 5},
            ErrorCode.INVALID_VALUE,
            "model",
        ),
        (
            MESSAGES,
            {"model": "m", "messages": [], "max_tokens": True},
            ErrorCode.INVALID_VALUE,
            "max_tokens",
        ),
        (
            MESSAGES,
            {"model": "m", "messages": "hi", "max_tokens": 5},
            ErrorCode.INVALID_VALUE,
            "messages",
        ),
        (RESPONSES, {"model": "m"}, ErrorCode.MISSING_FIELD, "input"),
        (RESPONSES, {"model": "m", "input": 7}, ErrorCode.INVALID_VALUE, "input"),
        (
            RESPONSES,
            {"input": "hi", "previous_response_id": "resp_1"},
            ErrorCode.UNSUPPORTED_PARAMETER,
            "previous_response_id",
        ),
    ],
)
def test_each_api_refuses_what_it_cannot_serve(
    api: Api, body: dict[str, Any], code: ErrorCode, param: str
) -> None:
    with pytest.raises(ApiError) as refused:
        parse_turn(json.dumps(body).encode(), {}, api)
    assert (refused.value.status, refused.value.code, refused.value.param) == (400, code, param)


def test_previous_response_id_is_refused_with_what_to_do_instead() -> None:
    """Never a silent wrong answer: the stored history is on no node the router can tell, so
    the client is told to resend the whole input."""
    with pytest.raises(ApiError) as refused:
        parse_turn(b'{"input": "hi", "previous_response_id": "resp_1"}', {}, RESPONSES)
    error = refused.value.body(RESPONSES.errors)["error"]
    assert error["code"] == "unsupported_parameter" and "input" in error["message"]
    # null is no previous response.
    assert parse_turn(b'{"input": "hi", "previous_response_id": null}', {}, RESPONSES)


@pytest.mark.parametrize(
    ("status", "anthropic_type"),
    [
        (400, "invalid_request_error"),
        (401, "authentication_error"),
        (404, "not_found_error"),
        (413, "request_too_large"),
        (500, "api_error"),
        (502, "api_error"),
        (503, "overloaded_error"),
        (504, "api_error"),
    ],
)
def test_errors_in_each_apis_shape(status: int, anthropic_type: str) -> None:
    error = ApiError(status, "why", ErrorType.INVALID_REQUEST, ErrorCode.INVALID_VALUE, "p")
    assert error.body(ErrorShape.ANTHROPIC) == {
        "type": "error",
        "error": {"type": anthropic_type, "message": "why"},
    }
    openai = {"message": "why", "type": "invalid_request_error", "param": "p",
              "code": "invalid_value"}  # fmt: skip
    assert error.body(ErrorShape.OPENAI) == error.body(ErrorShape.OPENAI_RESPONSES)
    assert error.body(ErrorShape.OPENAI) == {"error": openai}
    # At the end of a stream: chat's data event and [DONE]; Responses' and Anthropic's
    # named error events, without [DONE].
    chat = error.sse(ErrorShape.OPENAI).decode()
    assert chat == f"data: {json.dumps({'error': openai})}\n\ndata: [DONE]\n\n"
    anthropic = error.sse(ErrorShape.ANTHROPIC).decode()
    assert anthropic.startswith("event: error\ndata: ") and "[DONE]" not in anthropic
    assert json.loads(anthropic.splitlines()[1][6:]) == error.body(ErrorShape.ANTHROPIC)
    responses = error.sse(ErrorShape.OPENAI_RESPONSES).decode()
    event = json.loads(responses.splitlines()[1][6:])
    assert event == {"type": "error", "code": "invalid_value", "message": "why", "param": "p"}


def test_an_engines_openai_shaped_error_is_said_in_anthropics_shape_on_messages() -> None:
    openai = json.dumps({"error": {"message": "1 validation error", "type": "BadRequestError",
                                   "param": "max_tokens", "code": 400}}).encode()  # fmt: skip
    said = json.loads(in_shape(400, openai, ErrorShape.ANTHROPIC))
    assert said == {"type": "error", "error": {"type": "invalid_request_error",
                                               "message": "1 validation error"}}  # fmt: skip
    assert in_shape(400, openai, ErrorShape.OPENAI_RESPONSES) == openai
    anthropic = json.dumps({"type": "error", "error": {"type": "x", "message": "m"}}).encode()
    assert in_shape(400, anthropic, ErrorShape.ANTHROPIC) == anthropic  # already its shape
    assert in_shape(400, b"not json", ErrorShape.ANTHROPIC) == b"not json"


def test_the_error_shape_follows_the_path() -> None:
    assert error_shape("/v1/messages") is ErrorShape.ANTHROPIC
    assert error_shape("/v1/messages/count_tokens") is ErrorShape.ANTHROPIC
    assert error_shape("/v1/messages/batches") is ErrorShape.ANTHROPIC
    assert error_shape("/v1/responses") is ErrorShape.OPENAI_RESPONSES
    assert error_shape("/v1/chat/completions") is ErrorShape.OPENAI
    assert error_shape("/v1/messagesx") is ErrorShape.OPENAI
    assert error_shape("/nowhere") is ErrorShape.OPENAI


@pytest.mark.parametrize(
    "answer",
    [
        {"id": "a", "kv_transfer_params": {"remote_engine_id": "d"}},  # any whole answer
        {"id": "a", "kv_transfer_params": None},
        {"type": "response.created", "response": {"id": "a", "kv_transfer_params": None}},
        {"type": "response.completed", "response": {"id": "a", "kv_transfer_params": {}}},
    ],
)
def test_no_answer_or_event_keeps_the_engines_handle(answer: dict[str, Any]) -> None:
    assert without_handle(answer)
    assert "kv_transfer_params" not in json.dumps(answer)
    assert not without_handle({"id": "a", "response": "text"})
