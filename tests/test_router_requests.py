"""The router's request parsing (``router.requests``), fuzzed: whatever a client sends, the
answer is a request the router can forward (its legs encode) or an ``ApiError`` in OpenAI's
shape, never an exception that would be a 500."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbroker.common.rules.ids import MAX_ID_LENGTH
from kvbroker.router.errors import ApiError
from kvbroker.router.requests import MAX_JSON_DEPTH, encode, parse_completion, read_body

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
        completion = parse_completion(raw, headers)
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
        parse_completion(raw, {})
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
    completion = parse_completion(raw, {})
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
