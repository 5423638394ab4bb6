"""The APIs agents speak, end to end: the real ``anthropic`` and ``openai`` SDKs against the
router in front of real vLLM CPU engines with kvbroker's connector (one stack for the module).

A 4-turn conversation in each API, stateless (the whole history resent each turn) and
streamed, is REUSE from its second turn and gives the same tokens as the same requests with
reuse off (no session id: plain P/D), at temperature 0. A turn with tools and a tool call and
its result in the history is served and parses. Bad input to the new routes is a 4xx in the
API's own shape, and the next turn is served as before.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

import anthropic
import httpx
import openai
import pytest
import pytest_asyncio
from anthropic.types import MessageParam, ToolParam
from openai.types.responses import FunctionToolParam, ResponseInputParam

from kvbroker_tools.harness.turns import retained_after
from kvbroker_tools.stack import Stack
from kvbroker_tools.testmodel import corpus
from tests.e2e_stack import e2e_marks, stack_fixture

pytestmark = e2e_marks()

MODEL = "kvbroker-tiny-qwen3"
LINES = corpus(lines=200, seed=11)
TURNS = 4
MAX_TOKENS = 10
SYSTEM = " ".join(LINES[100:106])
# Temperature 0 (greedy), which this SDK has no argument for, in the body vLLM reads.
GREEDY = {"temperature": 0}
WEATHER: ToolParam = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
}


def user_message(turn: int) -> str:
    return " ".join(LINES[turn * 5 : turn * 5 + 5])


stack = stack_fixture()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def claude(stack: Stack) -> AsyncIterator[anthropic.AsyncAnthropic]:
    async with anthropic.AsyncAnthropic(
        base_url=stack.router_url, api_key="unused", max_retries=0
    ) as client:
        yield client


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def gpt(stack: Stack) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(
        base_url=f"{stack.router_url}/v1", api_key="unused", max_retries=0
    ) as client:
        yield client


async def message_turn(
    claude: anthropic.AsyncAnthropic, messages: list[MessageParam], session: str | None
) -> tuple[str, str]:
    """One streamed Messages turn: its text and the router's decision. A session rides in
    Claude Code's header and its ``metadata.user_id``, as Claude Code sends it."""
    extra: dict[str, Any] = {}
    if session is not None:
        extra["extra_headers"] = {"X-Claude-Code-Session-Id": session}
        extra["metadata"] = {"user_id": json.dumps({"device_id": "d", "session_id": session})}
    async with claude.messages.stream(
        model=MODEL,
        system=SYSTEM,
        messages=messages,
        max_tokens=MAX_TOKENS,
        extra_body=GREEDY,
        **extra,
    ) as stream:
        decision = stream.response.headers.get("x-kvbroker-decision", "")
        text = "".join([part async for part in stream.text_stream])
        final = await stream.get_final_message()
    assert final.role == "assistant" and final.usage.output_tokens > 0
    return text, decision


async def response_turn(
    gpt: openai.AsyncOpenAI, items: ResponseInputParam, session: str | None
) -> tuple[str, str]:
    """One streamed Responses turn, stateless (``store`` off, the whole input sent): its text
    and the router's decision. A session rides in the ``conversation`` field."""
    extra: dict[str, Any] = {"extra_body": {"conversation": session}} if session else {}
    raw = await gpt.responses.with_raw_response.create(
        model=MODEL,
        instructions=SYSTEM,
        input=items,
        max_output_tokens=MAX_TOKENS,
        temperature=0,
        store=False,
        stream=True,
        **extra,
    )
    parts, completed = [], False
    async for event in raw.parse():
        if event.type == "response.output_text.delta":
            parts.append(event.delta)
        completed = completed or event.type == "response.completed"
    assert completed
    return "".join(parts), raw.headers.get("x-kvbroker-decision", "")


async def test_a_messages_conversation_is_reused_and_answers_as_without(
    stack: Stack, claude: anthropic.AsyncAnthropic
) -> None:
    session = f"claude-{uuid.uuid4().hex[:8]}"
    messages: list[MessageParam] = []
    decisions, epoch = [], 0
    for turn in range(TURNS):
        messages.append({"role": "user", "content": user_message(turn)})
        off, off_decision = await message_turn(claude, messages, None)
        on, decision = await message_turn(claude, messages, session)
        assert on == off, (turn, on, off)
        assert off_decision == "MISS"
        decisions.append(decision)
        messages.append({"role": "assistant", "content": on or "."})
        epoch = await retained_after(stack.registry_address, session, epoch)
    assert decisions == ["MISS"] + ["REUSE"] * (TURNS - 1)


async def test_a_responses_conversation_is_reused_and_answers_as_without(
    stack: Stack, gpt: openai.AsyncOpenAI
) -> None:
    session = f"codex-{uuid.uuid4().hex[:8]}"
    items: ResponseInputParam = []
    decisions, epoch = [], 0
    for turn in range(TURNS):
        items.append({"role": "user", "content": user_message(10 + turn)})
        off, off_decision = await response_turn(gpt, items, None)
        on, decision = await response_turn(gpt, items, session)
        assert on == off, (turn, on, off)
        assert off_decision == "MISS"
        decisions.append(decision)
        items.append({"role": "assistant", "content": on or "."})
        epoch = await retained_after(stack.registry_address, session, epoch)
    assert decisions == ["MISS"] + ["REUSE"] * (TURNS - 1)


async def test_a_tool_use_turn_round_trips(
    claude: anthropic.AsyncAnthropic, gpt: openai.AsyncOpenAI
) -> None:
    """Whatever the random weights answer, a turn with tools, and one with a tool call and its
    result in the history, are served and parse, in both APIs."""
    session = f"tools-{uuid.uuid4().hex[:8]}"
    ask: list[MessageParam] = [{"role": "user", "content": "What is the weather in Paris?"}]
    headers = {"X-Claude-Code-Session-Id": session}
    first = await claude.messages.create(
        model=MODEL, messages=ask, tools=[WEATHER], max_tokens=MAX_TOKENS, extra_body=GREEDY,
        extra_headers=headers,
    )  # fmt: skip
    assert first.role == "assistant" and first.content
    history: list[MessageParam] = [
        *ask,
        {"role": "assistant", "content": [
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
             "input": {"city": "Paris"}},
        ]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny, 21 C"},
        ]},
    ]  # fmt: skip
    second = await claude.messages.create(
        model=MODEL, messages=history, tools=[WEATHER], max_tokens=MAX_TOKENS,
        extra_body=GREEDY, extra_headers=headers,
    )  # fmt: skip
    assert second.role == "assistant" and second.content

    function: FunctionToolParam = {
        "type": "function", "name": "get_weather", "description": "The weather.",
        "parameters": dict(WEATHER["input_schema"]), "strict": False,
    }  # fmt: skip
    items: ResponseInputParam = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny, 21 C"},
    ]  # fmt: skip
    answer = await gpt.responses.create(
        model=MODEL, input=items, tools=[function], max_output_tokens=MAX_TOKENS,
        temperature=0, store=False, extra_body={"conversation": session + "-r"},
    )  # fmt: skip
    assert answer.status in ("completed", "incomplete") and answer.output


async def test_bad_input_is_refused_in_each_apis_shape_and_the_next_turn_served(
    stack: Stack, claude: anthropic.AsyncAnthropic, gpt: openai.AsyncOpenAI
) -> None:
    hi: list[MessageParam] = [{"role": "user", "content": "hi"}]
    with pytest.raises(anthropic.NotFoundError) as unknown:
        await claude.messages.create(model="claude-nowhere", messages=hi, max_tokens=4)
    assert unknown.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    async with httpx.AsyncClient(timeout=60) as http:
        url = f"{stack.router_url}/v1/messages"
        for body in (b"{not json", json.dumps({"model": MODEL, "messages": []}).encode()):
            refused = await http.post(url, content=body)
            assert refused.status_code == 400, refused.text
            assert refused.json()["type"] == "error"
            assert refused.json()["error"]["type"] == "invalid_request_error"
        # Refused by the engine's own validation (max_tokens must be positive), said in
        # Anthropic's shape all the same.
        engine_refused = await http.post(
            url, json={"model": MODEL, "messages": hi, "max_tokens": 0}
        )
        assert engine_refused.status_code == 400, engine_refused.text
        assert engine_refused.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as chained:
        await gpt.responses.create(
            model=MODEL, input="hi", previous_response_id="resp_1", max_output_tokens=4
        )
    assert chained.value.code == "unsupported_parameter"
    assert chained.value.param == "previous_response_id"
    with pytest.raises(openai.NotFoundError):
        await gpt.responses.create(model="gpt-nowhere", input="hi", max_output_tokens=4)
    # The next good turns are served, and the token count too.
    served = await claude.messages.create(model=MODEL, messages=hi, max_tokens=4)
    assert served.content
    answered = await gpt.responses.create(model=MODEL, input="hi", max_output_tokens=4)
    assert answered.output
    counted = await claude.messages.count_tokens(model=MODEL, messages=hi)
    assert counted.input_tokens > 0


async def test_answers_carry_no_engine_handle(stack: Stack) -> None:
    """vLLM puts the decode engine's ``kv_transfer_params`` in a Messages or Responses answer
    (and a Responses stream's events hold the answer): the client gets none, whole or
    streamed."""
    session = {"X-Session-ID": f"handle-{uuid.uuid4().hex[:8]}"}
    turns = {
        "/v1/messages": {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user",
                                                                        "content": "hi"}]},
        "/v1/responses": {"model": MODEL, "max_output_tokens": 4, "input": "hi", "store": False},
    }  # fmt: skip
    async with httpx.AsyncClient(timeout=60) as http:
        for path, body in turns.items():
            for stream in (False, True):
                answer = await http.post(
                    stack.router_url + path, json={**body, "stream": stream}, headers=session
                )
                assert answer.status_code == 200, answer.text
                assert "kv_transfer_params" not in answer.text, (path, stream)
                assert ("event: " in answer.text) == stream
