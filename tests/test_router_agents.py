"""The router serving the APIs agents speak, Anthropic's Messages and OpenAI's Responses, against
a real registry and fake engines (``kvbroker_tools.harness.engine``): the same planner, paths and
headers as chat completions, each leg to the engines' endpoint of the same API, answers
without the decode engine's handle, and every refusal in the API's own error shape. The same
against real vLLM engines and the real SDKs is tests/test_e2e_agents.py."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from kvbroker.common.rules.handles import DECIDED_KEY, SESSION_KEY, decode_local_params
from kvbroker.v1.registry_pb2_grpc import RegistryServiceStub
from kvbroker_tools.harness.factories import grant
from tests import test_router
from tests.test_router import KEYED, KEYS, MODEL, Fleet, assert_openai_error

# test_router's fleet: fake engines, a real registry, the router.
fleet, router_config, api_keys = test_router.fleet, test_router.router_config, test_router.api_keys

HI: list[dict[str, Any]] = [{"role": "user", "content": "hi"}]
MESSAGE = {"model": MODEL, "max_tokens": 5, "messages": HI}
RESPONSE = {"model": MODEL, "max_output_tokens": 5, "input": "hi", "store": False}
CLAUDE_CODE = {"x-claude-code-session-id": "cc-1"}


def assert_anthropic_error(response: httpx.Response, status: int, error_type: str) -> str:
    """The response is Anthropic's error object with this status and type; its message."""
    assert response.status_code == status, response.text
    body = response.json()
    assert body["type"] == "error" and set(body) == {"type", "error"}, body
    assert set(body["error"]) == {"type", "message"}
    assert body["error"]["type"] == error_type
    message: str = body["error"]["message"]
    return message


def prefill_leg(fleet: Fleet) -> dict[str, Any]:
    """The one prefill leg sent since the last ``forget``."""
    (leg,) = (body for engine in fleet.prefills for body in engine.received)
    return leg


def forget(fleet: Fleet) -> None:
    for engine in (*fleet.prefills, fleet.decode):
        engine.received.clear()


async def test_a_messages_turn_is_two_messages_legs(
    fleet: Fleet, stub: RegistryServiceStub
) -> None:
    """The legs go to the engines' /v1/messages: one token unstreamed with the prefill
    parameters, then the client's request with P's; the conversation rides in
    ``kv_transfer_params`` (Messages has no session field); the answer has no handle."""
    async with httpx.AsyncClient() as client:
        first = await client.post(
            f"{fleet.router_url}/v1/messages?beta=true", json=MESSAGE, headers=CLAUDE_CODE
        )
        assert first.status_code == 200, first.text
        assert first.headers["x-kvbroker-decision"] == "MISS"
        answer = first.json()
        assert answer["type"] == "message" and "kv_transfer_params" not in answer
        assert answer["content"] == [{"type": "text", "text": "from decode-0"}]
        leg = prefill_leg(fleet)
        assert leg["max_tokens"] == 1 and "session_id" not in leg
        assert leg["kv_transfer_params"] == {"do_remote_decode": True, "do_remote_prefill": False,
                                             DECIDED_KEY: True, SESSION_KEY: "cc-1"}  # fmt: skip
        decode = fleet.decode.received[-1]
        assert decode["max_tokens"] == 5 and "session_id" not in decode
        assert decode["kv_transfer_params"]["do_remote_prefill"] is True
        assert decode["kv_transfer_params"][SESSION_KEY] == "cc-1"

        # Retained: the next turn, a long tool result, reads the history into P.
        forget(fleet)
        lease = await grant(stub, fleet.decode_spec, "cc-1", "d-req-1")
        body = {**MESSAGE, "messages": [
            *HI,
            {"role": "assistant", "content": [{"type": "text", "text": "from decode-0"}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                          "content": "result " * 3000}]},
        ]}  # fmt: skip
        second = await client.post(f"{fleet.router_url}/v1/messages", json=body,
                                   headers=CLAUDE_CODE)  # fmt: skip
        assert second.status_code == 200, second.text
        assert second.headers["x-kvbroker-decision"] == "REUSE"
        assert second.headers["x-kvbroker-path"] == "READ"
        params = prefill_leg(fleet)["kv_transfer_params"]
        assert params["kvbroker_lease_id"] == lease.lease_id
        assert params[SESSION_KEY] == "cc-1"


async def test_a_short_messages_follow_up_goes_straight_to_the_holder(
    fleet: Fleet, stub: RegistryServiceStub
) -> None:
    user_id = json.dumps({"device_id": "d", "session_id": "cc-2"})
    await grant(stub, fleet.decode_spec, "cc-2", "d-req-2", tokens=3000)
    body = {**MESSAGE, "metadata": {"user_id": user_id}, "messages": [
        *HI,
        {"role": "assistant", "content": "an answer"},
        {"role": "user", "content": "and then?"},
    ]}  # fmt: skip
    async with httpx.AsyncClient() as client:
        response = await client.post(f"{fleet.router_url}/v1/messages", json=body)
    assert response.status_code == 200, response.text
    assert response.headers["x-kvbroker-decision"] == "REUSE"
    assert response.headers["x-kvbroker-path"] == "DECODE_LOCAL"
    assert not any(p.received for p in fleet.prefills)
    params = fleet.decode.received[-1]["kv_transfer_params"]
    assert params == {**decode_local_params(), SESSION_KEY: "cc-2"}


async def test_a_messages_stream_is_relayed_event_by_event(fleet: Fleet) -> None:
    async with (
        httpx.AsyncClient() as client,
        client.stream("POST", f"{fleet.router_url}/v1/messages",
                      json={**MESSAGE, "stream": True}, headers=CLAUDE_CODE) as response,
    ):  # fmt: skip
        lines = [line async for line in response.aiter_lines() if line]
    assert response.status_code == 200
    assert response.headers["x-kvbroker-decision"] == "MISS"
    assert lines[:2] == ["event: content_block_delta", lines[1]]
    assert lines[-2:] == ["event: message_stop", 'data: {"type": "message_stop"}']
    assert "stream" not in prefill_leg(fleet)


async def test_a_messages_stream_that_fails_ends_with_anthropics_error_event(
    fleet: Fleet,
) -> None:
    fleet.decode.die_after_chunks = 2
    async with (
        httpx.AsyncClient() as client,
        client.stream(
            "POST", f"{fleet.router_url}/v1/messages", json={**MESSAGE, "stream": True}
        ) as response,
    ):
        lines = [line async for line in response.aiter_lines() if line]
    assert response.status_code == 200
    assert lines[-2] == "event: error"
    error = json.loads(lines[-1].removeprefix("data: "))
    assert error == {"type": "error", "error": {"type": "api_error",
                                                "message": error["error"]["message"]}}  # fmt: skip
    assert "[DONE]" not in "".join(lines)


async def test_a_responses_turn_is_two_responses_legs(fleet: Fleet) -> None:
    """The Responses API's bound is ``max_output_tokens``; its conversation rides in its own
    ``session_id`` field; neither its answer nor its stream's completed event has a handle."""
    body = {**RESPONSE, "conversation": {"id": "conv_1"}}
    async with httpx.AsyncClient() as client:
        whole = await client.post(f"{fleet.router_url}/v1/responses", json=body)
        assert whole.status_code == 200, whole.text
        assert whole.json()["object"] == "response"
        assert "kv_transfer_params" not in whole.json()
        leg = prefill_leg(fleet)
        assert leg["max_output_tokens"] == 1 and "max_tokens" not in leg
        assert leg["session_id"] == "conv_1" and "conversation" not in leg
        decode = fleet.decode.received[-1]
        assert decode["max_output_tokens"] == 5 and decode["session_id"] == "conv_1"
        assert decode["kv_transfer_params"]["remote_engine_id"].startswith("engine-prefill")
        forget(fleet)
        async with client.stream(
            "POST", f"{fleet.router_url}/v1/responses", json={**body, "stream": True}
        ) as response:
            lines = [line async for line in response.aiter_lines() if line]
    assert response.status_code == 200
    assert lines[-2] == "event: response.completed"
    completed = json.loads(lines[-1].removeprefix("data: "))
    assert completed["response"]["status"] == "completed"
    assert "kv_transfer_params" not in completed["response"]


async def test_messages_refusals_are_in_anthropics_shape(fleet: Fleet) -> None:
    url = f"{fleet.router_url}/v1/messages"
    async with httpx.AsyncClient() as client:
        for content in (b"{not json", b"[]"):
            response = await client.post(url, content=content)
            assert_anthropic_error(response, 400, "invalid_request_error")
        response = await client.post(url, json={**MESSAGE, "max_tokens": None})
        assert "max_tokens" in assert_anthropic_error(response, 400, "invalid_request_error")
        response = await client.post(url, json=MESSAGE, headers={"x-session-id": "a" * 300})
        assert_anthropic_error(response, 400, "invalid_request_error")
        response = await client.post(url, json={**MESSAGE, "model": "claude-sonnet-9"})
        assert_anthropic_error(response, 404, "not_found_error")
        response = await client.get(url)
        assert_anthropic_error(response, 405, "invalid_request_error")
        response = await client.post(f"{url}/batches", json=MESSAGE)
        assert_anthropic_error(response, 404, "not_found_error")
        # An engine's refusal in OpenAI's shape (vLLM's request validation) is said in
        # Anthropic's; one in Anthropic's already passes as it came.
        for engine in fleet.prefills:
            engine.fail_with = (400, {"error": {"message": "bad field", "type": "BadRequest"}})
        response = await client.post(url, json=MESSAGE)
        assert assert_anthropic_error(response, 400, "invalid_request_error") == "bad field"
        anthropic = {"type": "error", "error": {"type": "invalid_request_error", "message": "m"}}
        for engine in fleet.prefills:
            engine.fail_with = (400, anthropic)
        assert (await client.post(url, json=MESSAGE)).json() == anthropic
        # Nothing else is affected: chat completions still answer in OpenAI's shape.
        chat = await client.post(f"{fleet.router_url}/v1/chat/completions", content=b"[]")
        assert_openai_error(chat, 400, "invalid_json")
    assert not fleet.decode.received


async def test_responses_refusals_are_in_openais_shape(fleet: Fleet) -> None:
    url = f"{fleet.router_url}/v1/responses"
    async with httpx.AsyncClient() as client:
        response = await client.post(url, json={**RESPONSE, "previous_response_id": "resp_1"})
        error = assert_openai_error(response, 400, "unsupported_parameter")
        assert error["param"] == "previous_response_id"
        response = await client.post(url, json={"model": MODEL})
        assert assert_openai_error(response, 400, "missing_required_parameter")["param"] == "input"
        response = await client.post(url, json={**RESPONSE, "model": "gpt-17"})
        assert_openai_error(response, 404, "model_not_found")
        # The next good turn is served.
        assert (await client.post(url, json=RESPONSE)).status_code == 200
    assert len(fleet.decode.received) == 1


async def test_count_tokens_is_answered_by_a_ready_engine(fleet: Fleet) -> None:
    url = f"{fleet.router_url}/v1/messages/count_tokens"
    body = {"model": MODEL, "messages": [{"role": "user", "content": "three words here"}]}
    async with httpx.AsyncClient() as client:
        counted = await client.post(url, json=body)
        assert counted.status_code == 200, counted.text
        assert counted.json() == {"input_tokens": 3}
        assert_anthropic_error(await client.post(url, json={"messages": []}), 400,
                               "invalid_request_error")  # fmt: skip
        unknown = await client.post(url, json={**body, "model": "claude-sonnet-9"})
        assert_anthropic_error(unknown, 404, "not_found_error")
    assert sum(len(p.received) for p in fleet.prefills) == 1
    assert not fleet.decode.received


@pytest.mark.parametrize("api_keys", [KEYED])
async def test_messages_take_anthropics_key_header_and_refuse_in_its_shape(
    fleet: Fleet,
) -> None:
    url = f"{fleet.router_url}/v1/messages"
    async with httpx.AsyncClient() as client:
        for headers in ({}, {"x-api-key": "sk-guessed"}, {"authorization": "Bearer sk-x"}):
            response = await client.post(url, json=MESSAGE, headers=headers)
            assert_anthropic_error(response, 401, "authentication_error")
        responses = await client.post(f"{fleet.router_url}/v1/responses", json=RESPONSE)
        assert_openai_error(responses, 401, "invalid_api_key")
        served = await client.post(
            url, json=MESSAGE, headers={"x-api-key": KEYS["acme"], **CLAUDE_CODE}
        )
        assert served.status_code == 200, served.text
    # The tenant scopes the conversation, wherever the leg carries it.
    assert fleet.decode.received[-1]["kv_transfer_params"][SESSION_KEY] == "acme/cc-1"
