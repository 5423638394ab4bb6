"""The router against a real registry and real upstream HTTP servers."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast
from urllib.parse import quote

import grpc
import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from typer.testing import CliRunner

from kvbroker.cli.main import app as cli
from kvbroker.common.client.grpc_client import RegistryEndpoint
from kvbroker.common.process.credentials import load_api_keys, token_digest
from kvbroker.common.process.ports import free_port
from kvbroker.common.rules.handles import CONTENT_READ_KEY, DECIDED_KEY, decode_local_params
from kvbroker.common.rules.ids import MAX_ID_LENGTH
from kvbroker.common.rules.sessionless import is_sessionless
from kvbroker.controlplane.config import RegistryConfig
from kvbroker.controlplane.server import RunningRegistry
from kvbroker.router.auth import ApiKeys, Tenant
from kvbroker.router.config import RouterConfig
from kvbroker.router.handlers import build_app
from kvbroker.router.proxy import Router
from kvbroker.v1 import lease_pb2, node_pb2, registry_pb2, registry_pb2_grpc
from kvbroker.v1.registry_pb2_grpc import RegistryServiceStub
from kvbroker_tools.harness.engine import FakeEngine, serving
from kvbroker_tools.harness.factories import Heartbeats, grant, node_spec
from tests.conftest import eventually

MODEL = "tiny-qwen3"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}


@dataclass
class Fleet:
    prefills: list[FakeEngine]
    decode: FakeEngine
    decode_spec: node_pb2.NodeSpec
    router_url: str
    router: Router
    heartbeats: Heartbeats


def lists_ready(router: Router, *node_ids: str) -> bool:
    """Whether the router's last node list has these nodes, READY: it refreshed since they
    became ready."""
    ready = {n.spec.node_id for n in router.known_nodes if n.state == node_pb2.NODE_STATE_READY}
    return ready >= set(node_ids)


async def steered(stub: RegistryServiceStub, fleet: Fleet, *idle: str) -> bool:
    """Whether the registry has ``idle`` READY and the fleet's nodes at the load their
    heartbeats now report: its next hints pick ``idle`` over the loaded nodes."""
    nodes = (await stub.ListNodes(registry_pb2.ListNodesRequest(), timeout=5)).nodes
    by_id = {node.spec.node_id: node for node in nodes}
    load = fleet.heartbeats.load.running_requests
    fleet_ids = [engine.name for engine in (*fleet.prefills, fleet.decode)]
    return all(by_id[i].load.running_requests == load for i in fleet_ids) and all(
        i in by_id and by_id[i].state == node_pb2.NODE_STATE_READY for i in idle
    )


@pytest.fixture
def router_config() -> RouterConfig:
    """The fleet's router settings; a test parametrizes this name to change them."""
    return RouterConfig(node_refresh_s=0.1)


@pytest.fixture
def api_keys() -> ApiKeys | None:
    """The fleet's router's API keys (None: open); a test parametrizes this name to set them."""
    return None


@pytest.fixture
async def fleet(
    stub: RegistryServiceStub,
    registry_server: RunningRegistry,
    router_config: RouterConfig,
    api_keys: ApiKeys | None,
) -> AsyncIterator[Fleet]:
    prefills = [FakeEngine("prefill-0"), FakeEngine("prefill-1")]
    decode = FakeEngine("decode-0")
    specs = []
    for engine, role in ((prefills[0], node_pb2.NODE_ROLE_PREFILL),
                         (prefills[1], node_pb2.NODE_ROLE_PREFILL),
                         (decode, node_pb2.NODE_ROLE_DECODE)):  # fmt: skip
        spec = node_spec(engine.name, role, port=engine.port)
        spec.http_base_url = engine.url
        specs.append(spec)
    router = Router(
        RegistryEndpoint.parse(registry_server.address), router_config, api_keys=api_keys
    )
    port = free_port()
    heartbeats = Heartbeats(stub, *specs)
    async with (
        heartbeats,
        serving(prefills[0].app(), prefills[0].port),
        serving(prefills[1].app(), prefills[1].port),
        serving(decode.app(), decode.port),
        serving(build_app(router), port),
    ):
        await eventually(lambda: lists_ready(router, *(spec.node_id for spec in specs)))
        yield Fleet(prefills, decode, specs[2], f"http://127.0.0.1:{port}", router, heartbeats)


async def test_two_legs_with_session_and_handle(fleet: Fleet, stub: RegistryServiceStub) -> None:
    async with httpx.AsyncClient() as client:
        first = await client.post(
            f"{fleet.router_url}/v1/chat/completions",
            json=CHAT,
            headers={"X-Session-ID": "conv-1"},
        )
        assert first.status_code == 200
        assert first.headers["x-kvbroker-decision"] == "MISS"
        assert first.json()["choices"][0]["message"]["content"] == "from decode-0"
        prefill_leg = next(p for p in fleet.prefills if p.received).received[-1]
        assert prefill_leg["max_tokens"] == 1
        assert prefill_leg["kv_transfer_params"] == {"do_remote_decode": True,
                                                     "do_remote_prefill": False,
                                                     DECIDED_KEY: True}  # fmt: skip
        decode_leg = fleet.decode.received[-1]
        assert decode_leg["session_id"] == "conv-1"
        assert decode_leg["max_tokens"] == 5
        assert decode_leg["kv_transfer_params"]["do_remote_prefill"] is True

        # D retained the turn (its sidecar reported it): the next turn carries the handle. It
        # adds a bulk tool result (~5k tokens, over the decode node's local limit), so P
        # computes it after reading the retained prefix.
        lease = await grant(stub, fleet.decode_spec, "conv-1", "d-req-1")
        body = {
            **CHAT,
            "messages": [
                *CHAT["messages"],  # type: ignore[misc]
                {"role": "assistant", "content": "from decode-0"},
                {"role": "tool", "content": "result " * 3000},
            ],
            "conversation_id": "conv-1",  # vLLM example proxy's field
        }
        second = await client.post(f"{fleet.router_url}/v1/chat/completions", json=body)
        assert second.headers["x-kvbroker-decision"] == "REUSE"
        assert second.headers["x-kvbroker-path"] == "READ"
        assert second.headers["x-kvbroker-decode"] == fleet.decode_spec.node_id
        read_into = second.headers["x-kvbroker-prefill"]
        params = next(
            p.received[-1] for p in fleet.prefills if p.received and
            "kvbroker_lease_id" in p.received[-1]["kv_transfer_params"]
        )["kv_transfer_params"]  # fmt: skip
        assert params["kvbroker_lease_id"] == lease.lease_id
        assert read_into in {p.name for p in fleet.prefills if p.received}
        assert params["kvbroker_epoch"] == lease.epoch
        assert params["remote_request_id"] == "d-req-1"
        assert len(params["kvbroker_block_hashes"]) == len(lease.block_hashes)
        assert "conversation_id" not in fleet.decode.received[-1]
        assert fleet.decode.received[-1]["session_id"] == "conv-1"


@pytest.mark.parametrize(("said", "header"), [(480, "480"), ("lots", None), (True, None)])
async def test_a_read_by_content_is_said_and_kept_from_the_decode_leg(
    fleet: Fleet, said: object, header: str | None
) -> None:
    """A new conversation whose prefill engine read retained KV by content (a fork): the
    registry planned it as new (MISS), the answer says how many tokens P read, and the decode
    leg gets none of it; a value that is not a count is said nowhere."""
    for engine in fleet.prefills:
        engine.read_by_content = said
    async with httpx.AsyncClient() as client:
        answer = await client.post(
            f"{fleet.router_url}/v1/chat/completions",
            json=CHAT,
            headers={"X-Session-ID": f"conv-fork-{said}"},
        )
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-kvbroker-decision"] == "MISS"
    assert answer.headers.get("x-kvbroker-read-by-content") == header
    assert CONTENT_READ_KEY not in fleet.decode.received[-1]["kv_transfer_params"]


async def test_a_short_follow_up_goes_straight_to_the_holder(
    fleet: Fleet, stub: RegistryServiceStub
) -> None:
    """A one-line follow-up of a retained conversation: the registry's planner says
    DECODE_LOCAL, so no prefill leg is sent; the decode node gets the whole request with the
    session id and the decode-local marker (it computes the suffix and retains the turn)."""
    await grant(stub, fleet.decode_spec, "conv-2", "d-req-2", tokens=3000)
    body = {
        **CHAT,
        "messages": [
            *CHAT["messages"],  # type: ignore[misc]
            {"role": "assistant", "content": "an answer"},
            {"role": "user", "content": "and then?"},
        ],
        "session_id": "conv-2",
    }
    async with httpx.AsyncClient() as client:
        response = await client.post(f"{fleet.router_url}/v1/chat/completions", json=body)
        metrics = (await client.get(f"{fleet.router_url}/metrics")).text
    assert response.status_code == 200
    assert response.headers["x-kvbroker-decision"] == "REUSE"
    assert response.headers["x-kvbroker-path"] == "DECODE_LOCAL"
    assert response.headers["x-kvbroker-decode"] == fleet.decode_spec.node_id
    assert "x-kvbroker-prefill" not in response.headers  # no prefill leg
    assert not any(p.received for p in fleet.prefills)
    leg = fleet.decode.received[-1]
    assert leg["session_id"] == "conv-2"
    assert leg["kv_transfer_params"] == decode_local_params()
    assert leg["messages"] == body["messages"] and leg["max_tokens"] == 5
    assert 'kvbroker_router_ttft_seconds_count{path="DECODE_LOCAL"} 1.0' in metrics


async def test_streaming_passes_through(fleet: Fleet) -> None:
    async with (
        httpx.AsyncClient() as client,
        client.stream(
            "POST",
            f"{fleet.router_url}/v1/chat/completions",
            json={**CHAT, "stream": True, "session_id": "s"},
        ) as response,
    ):
        lines = [line async for line in response.aiter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    assert "stream" not in next(p for p in fleet.prefills if p.received).received[-1]
    assert fleet.decode.received[-1]["stream"] is True


async def test_upstream_client_errors_pass_through(fleet: Fleet) -> None:
    error = {"error": {"message": "max_tokens too large", "type": "BadRequestError"}}
    for engine in fleet.prefills:
        engine.fail_with = (400, error)
    async with httpx.AsyncClient() as client:
        response = await client.post(f"{fleet.router_url}/v1/chat/completions", json=CHAT)
    assert response.status_code == 400
    assert response.json() == error


async def test_a_dead_prefill_node_is_routed_around(
    fleet: Fleet, stub: RegistryServiceStub
) -> None:
    # A prefill node whose server is gone while its sidecar still heartbeats (not yet noticed);
    # the live nodes report a queue, so every hint picks the dead one first.
    fleet.heartbeats.load = node_pb2.NodeLoad(running_requests=50)
    dead = node_spec("prefill-dead", node_pb2.NODE_ROLE_PREFILL, port=free_port())
    dead.http_base_url = f"http://127.0.0.1:{dead.side_channel_port}"
    async with Heartbeats(stub, dead), httpx.AsyncClient() as client:
        await eventually(lambda: steered(stub, fleet, dead.node_id))
        for _ in range(4):
            response = await client.post(f"{fleet.router_url}/v1/chat/completions", json=CHAT)
            assert response.status_code == 200
        metrics = (await client.get(f"{fleet.router_url}/metrics")).text
    assert sum(len(p.received) for p in fleet.prefills) == 4
    assert "kvbroker_router_prefill_failovers_total 4.0" in metrics


async def test_no_prefill_node_is_a_clear_503_after_the_wait(
    stub: RegistryServiceStub, registry_server: RunningRegistry
) -> None:
    router = Router(
        RegistryEndpoint.parse(registry_server.address), RouterConfig(ready_node_wait_s=0.4)
    )
    port = free_port()
    async with serving(build_app(router), port), httpx.AsyncClient() as client:
        response = await client.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=CHAT)
        metrics = (await client.get(f"http://127.0.0.1:{port}/metrics")).text
    assert response.status_code == 503
    assert "no ready prefill node" in response.json()["error"]["message"]
    waits = next(
        line for line in metrics.splitlines()
        if line.startswith("kvbroker_router_ready_node_waits_total")
    )  # fmt: skip
    assert float(waits.split()[-1]) >= 2


async def test_a_request_waits_out_a_gap_with_no_ready_node(
    stub: RegistryServiceStub, registry_server: RunningRegistry
) -> None:
    """No prefill node when the request arrives (say, its session being re-established after
    a registry failover); one registers 0.5 s later and the request is served by it."""
    prefill, decode = FakeEngine("prefill-0"), FakeEngine("decode-0")
    specs = []
    for engine, role in ((prefill, node_pb2.NODE_ROLE_PREFILL),
                         (decode, node_pb2.NODE_ROLE_DECODE)):  # fmt: skip
        spec = node_spec(engine.name, role, port=engine.port)
        spec.http_base_url = engine.url
        specs.append(spec)
    router = Router(
        RegistryEndpoint.parse(registry_server.address), RouterConfig(ready_node_wait_s=10.0)
    )
    port = free_port()
    async with (
        Heartbeats(stub, specs[1]),
        serving(prefill.app(), prefill.port),
        serving(decode.app(), decode.port),
        serving(build_app(router), port),
        httpx.AsyncClient() as client,
    ):
        request = asyncio.create_task(
            client.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=CHAT)
        )
        # The registry said no prefill node is ready, and the request waits for one.
        waits = "kvbroker_router_ready_node_waits_total"
        await eventually(lambda: router.metrics.registry.get_sample_value(waits))
        assert not request.done()
        async with Heartbeats(stub, specs[0]):
            response = await request
    assert response.status_code == 200
    assert len(prefill.received) == 1


async def test_decode_dying_mid_stream_ends_with_an_error_event(fleet: Fleet) -> None:
    fleet.decode.die_after_chunks = 2
    async with (
        httpx.AsyncClient() as client,
        client.stream(
            "POST", f"{fleet.router_url}/v1/chat/completions", json={**CHAT, "stream": True}
        ) as response,
    ):
        events = [line async for line in response.aiter_lines() if line.startswith("data: ")]
    # The status line went out with the first chunk: the failure is an event, then [DONE].
    assert response.status_code == 200
    assert len(events) == 4
    error = json.loads(events[2].removeprefix("data: "))["error"]
    assert (error["type"], error["code"]) == ("upstream_error", "upstream_failed")
    assert set(error) == {"message", "type", "param", "code"}
    assert events[3] == "data: [DONE]"


async def test_registry_down_serves_plain_pd_labelled_degraded(
    fleet: Fleet, registry_server: RunningRegistry
) -> None:
    await registry_server.server.stop(0)
    async with httpx.AsyncClient() as client:
        response = await client.post(
            f"{fleet.router_url}/v1/chat/completions", json={**CHAT, "session_id": "c"}
        )
        assert response.status_code == 200
        assert response.headers["x-kvbroker-consistency"] == "DEGRADED"
        assert response.headers["x-kvbroker-decision"] == "MISS"
        prefill_leg = next(p for p in fleet.prefills if p.received).received[-1]
        assert "remote_block_ids" not in prefill_leg["kv_transfer_params"]
        metrics = (await client.get(f"{fleet.router_url}/metrics")).text
    assert 'kvbroker_router_requests_total{consistency="DEGRADED",decision="MISS"} 1.0' in metrics


async def test_keepalive_and_close(fleet: Fleet, stub: RegistryServiceStub) -> None:
    await grant(stub, fleet.decode_spec, "agent-7", "d-req")
    async with httpx.AsyncClient() as client:
        kept = await client.post(
            f"{fleet.router_url}/v1/sessions/agent-7/keepalive", json={"ttl_seconds": 900}
        )
        assert kept.status_code == 200
        assert kept.json()["state"] == "ACTIVE" and kept.json()["ttl_seconds"] > 890
        bad = await client.post(
            f"{fleet.router_url}/v1/sessions/agent-7/keepalive", json={"ttl_seconds": -1}
        )
        assert bad.status_code == 400
        closed = await client.delete(f"{fleet.router_url}/v1/sessions/agent-7")
        assert closed.json()["state"] == "REVOKED"
        again = await client.post(f"{fleet.router_url}/v1/sessions/agent-7/keepalive")
        assert again.status_code == 404  # no live lease left to keep
        unknown = await client.delete(f"{fleet.router_url}/v1/sessions/never")
        assert unknown.status_code == 404
        assert "unknown" in unknown.json()["error"]["message"]


@pytest.mark.parametrize("session", ["team/agent-1", "a/keepalive", "/lead", "trail/"])
async def test_session_routes_take_every_session_id_the_completions_take(
    fleet: Fleet, stub: RegistryServiceStub, session: str
) -> None:
    """A session id holding ``/`` (one that even ends in ``/keepalive``) is the client's to
    choose: the completion routes take it, and the session routes name it, percent-encoded or
    as it is, and reach its lease."""
    async with httpx.AsyncClient() as client:
        turn = await client.post(
            f"{fleet.router_url}/v1/chat/completions", json=CHAT, headers={"X-Session-ID": session}
        )
        assert turn.status_code == 200, turn.text
        assert fleet.decode.received[-1]["session_id"] == session
        lease = await grant(stub, fleet.decode_spec, session, "d-req")
        for named in (quote(session, safe=""), session):
            kept = await client.post(
                f"{fleet.router_url}/v1/sessions/{named}/keepalive", json={"ttl_seconds": 900}
            )
            assert kept.status_code == 200, kept.text
            assert kept.json()["session_id"] == session
            assert kept.json()["lease_id"] == lease.lease_id
        closed = await client.delete(f"{fleet.router_url}/v1/sessions/{quote(session, safe='')}")
        assert closed.status_code == 200, closed.text
        assert closed.json()["state"] == "REVOKED" and closed.json()["session_id"] == session


async def test_models_and_health(fleet: Fleet) -> None:
    async with httpx.AsyncClient() as client:
        models = (await client.get(f"{fleet.router_url}/v1/models")).json()
        assert [m["id"] for m in models["data"]] == [MODEL]
        assert (await client.get(f"{fleet.router_url}/health")).status_code == 200


# ------------------------------------------------------------ errors, OpenAI's way


def assert_openai_error(response: httpx.Response, status: int, code: str) -> dict[str, Any]:
    """The response is OpenAI's error object with this status and code; returns the error."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == code
    return cast(dict[str, Any], error)


NOT_REQUESTS = {
    "NaN": b'{"model": "tiny-qwen3", "temperature": NaN}',
    "Infinity": b'{"model": "tiny-qwen3", "temperature": -Infinity}',
    "a number beyond a float": b'{"model": "tiny-qwen3", "temperature": 1e999}',
    "an integer of 5,000 digits": b'{"model": "tiny-qwen3", "seed": ' + b"7" * 5000 + b"}",
    "nesting past the parser's stack": b"[" * 100_000,
    "nesting past the router's limit": b'{"a":' * 200 + b"1" + b"}" * 200,
    "invalid UTF-8": b'{"model": "tiny-qwen3\xff", "messages": []}',
    "a lone surrogate": b'{"model": "tiny-qwen3", "messages": [{"content": "\\ud800"}]}',
    "not JSON": b"{no",
    "not an object": b"[1, 2]",
}


async def test_bodies_that_are_not_requests_get_400_on_a_kept_connection(fleet: Fleet) -> None:
    async with httpx.AsyncClient() as client:
        for name, body in NOT_REQUESTS.items():
            response = await client.post(f"{fleet.router_url}/v1/chat/completions", content=body)
            error = assert_openai_error(response, 400, "invalid_json")
            assert error["type"] == "invalid_request_error", name
            # A refusal is an answer: the connection stays open for the next request.
            assert response.headers.get("connection") != "close", name
        for field, value in (("model", 5), ("stream", "yes")):
            response = await client.post(
                f"{fleet.router_url}/v1/chat/completions", json={**CHAT, field: value}
            )
            assert assert_openai_error(response, 400, "invalid_value")["param"] == field
        served = await client.post(f"{fleet.router_url}/v1/chat/completions", json=CHAT)
        assert served.status_code == 200
    assert len(fleet.decode.received) == 1


async def test_session_ids_follow_the_registrys_rule(fleet: Fleet) -> None:
    url = f"{fleet.router_url}/v1/chat/completions"
    async with httpx.AsyncClient() as client:
        for body, headers in (
            ({**CHAT, "session_id": "s" * (MAX_ID_LENGTH + 1)}, {}),
            ({**CHAT, "conversation_id": "c" * (MAX_ID_LENGTH + 1)}, {}),
            (CHAT, {"x-session-id": "h" * (MAX_ID_LENGTH + 1)}),
            ({**CHAT, "session_id": 7}, {}),
        ):
            response = await client.post(url, json=body, headers=headers)
            assert_openai_error(response, 400, "invalid_session_id")
        longest = await client.post(url, json={**CHAT, "session_id": "s" * MAX_ID_LENGTH})
        assert longest.status_code == 200
        overlong = "k" * (MAX_ID_LENGTH + 1)
        kept = await client.post(f"{fleet.router_url}/v1/sessions/{overlong}/keepalive")
        assert_openai_error(kept, 400, "invalid_session_id")
        closed = await client.delete(f"{fleet.router_url}/v1/sessions/{overlong}")
        assert_openai_error(closed, 400, "invalid_session_id")
        for ttl in (float("nan"), True, 1e300):
            bad = await client.post(
                f"{fleet.router_url}/v1/sessions/agent/keepalive",
                content=json.dumps({"ttl_seconds": ttl}),
            )
            assert bad.status_code == 400
    assert len(fleet.decode.received) == 1


@pytest.mark.parametrize("router_config", [RouterConfig(node_refresh_s=0.1, max_body_bytes=4096)])
async def test_a_body_over_the_limit_is_413(fleet: Fleet) -> None:
    big = json.dumps({**CHAT, "messages": [{"role": "user", "content": "x" * 5000}]}).encode()

    async def chunked() -> AsyncIterator[bytes]:  # no Content-Length: counted as it arrives
        for start in range(0, len(big), 1000):
            yield big[start : start + 1000]

    url = f"{fleet.router_url}/v1/chat/completions"
    async with httpx.AsyncClient() as client:
        assert_openai_error(await client.post(url, content=big), 413, "request_too_large")
        assert_openai_error(await client.post(url, content=chunked()), 413, "request_too_large")
        assert (await client.post(url, json=CHAT)).status_code == 200
    assert len(fleet.decode.received) == 1


async def test_a_model_no_node_serves_is_404_model_not_found_at_once(fleet: Fleet) -> None:
    async with httpx.AsyncClient() as client:
        started = time.monotonic()
        response = await client.post(
            f"{fleet.router_url}/v1/chat/completions", json={**CHAT, "model": "gpt-17"}
        )
    # Not the wait for a ready node: no node of that model is listed at all.
    assert time.monotonic() - started < RouterConfig.ready_node_wait_s
    error = assert_openai_error(response, 404, "model_not_found")
    assert (error["type"], error["param"]) == ("invalid_request_error", "model")
    assert not fleet.decode.received


async def exchange(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: bytes
) -> int:
    """Sends one HTTP/1.1 request on an open connection and reads its answer; its status."""
    writer.write(request)
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        int(line.split(b":")[1]) for line in head.lower().split(b"\r\n")
        if line.startswith(b"content-length:")
    )  # fmt: skip
    await reader.readexactly(length)
    return int(head.split()[1])


async def test_a_bug_is_a_typed_500_that_keeps_the_connection(
    fleet: Fleet, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def broken(conversation: str, model: str) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr(fleet.router, "plan", broken)
    url = f"{fleet.router_url}/v1/chat/completions"
    async with httpx.AsyncClient() as client:
        failed = await client.post(url, json=CHAT)
        assert assert_openai_error(failed, 500, "internal_error")["type"] == "server_error"
        missing = await client.get(f"{fleet.router_url}/v1/nothing-here")
        assert_openai_error(missing, 404, "not_found")
        wrong = await client.get(url)
        assert_openai_error(wrong, 405, "method_not_allowed")
    # Starlette's own 500 closed the connection; the router's keeps it for the next request.
    body = json.dumps(CHAT).encode()
    post = b"POST /v1/chat/completions HTTP/1.1\r\nhost: router\r\ncontent-type: "
    post += b"application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
    reader, writer = await asyncio.open_connection(*fleet.router_url[7:].split(":"))
    try:
        assert await exchange(reader, writer, post) == 500
        models = b"GET /v1/models HTTP/1.1\r\nhost: router\r\n\r\n"
        assert await exchange(reader, writer, models) == 200
    finally:
        writer.close()


async def test_a_decode_error_before_the_stream_starts_keeps_its_status(fleet: Fleet) -> None:
    error = {"error": {"message": "max_tokens too large", "type": "BadRequestError"}}
    fleet.decode.fail_with = (400, error)
    async with httpx.AsyncClient() as client:
        response = await client.post(
            f"{fleet.router_url}/v1/chat/completions", json={**CHAT, "stream": True}
        )
    assert response.status_code == 400
    assert response.json() == error


class Misbehaving:
    """An engine that hangs (until released at the end of the test) or answers garbage."""

    def __init__(self, name: str, role: node_pb2.NodeRole, *, hang: bool) -> None:
        self.port = free_port()
        self.spec = node_spec(name, role, port=self.port)
        self.spec.http_base_url = f"http://127.0.0.1:{self.port}"
        self.hang = hang
        self.received = 0
        self._release = asyncio.Event()

    async def _completions(self, request: Request) -> Response:
        self.received += 1
        if self.hang:
            await asyncio.wait_for(self._release.wait(), 30)
        return Response(b"<html>502 Bad Gateway</html>", 200, media_type="text/html")

    @contextlib.asynccontextmanager
    async def serving(self, fleet: Fleet, stub: RegistryServiceStub) -> AsyncIterator[None]:
        """Serves and heartbeats until the registry's hints pick it over the fleet's nodes."""
        routes = [
            Route(path, self._completions, methods=["POST"])
            for path in ("/v1/chat/completions", "/v1/completions")
        ]
        async with serving(Starlette(routes=routes), self.port), Heartbeats(stub, self.spec):
            await eventually(lambda: steered(stub, fleet, self.spec.node_id))
            try:
                yield
            finally:
                self._release.set()


async def test_an_engine_answering_garbage_is_502(fleet: Fleet, stub: RegistryServiceStub) -> None:
    # The fleet's nodes report a queue, so every hint picks the idle misbehaving node.
    fleet.heartbeats.load = node_pb2.NodeLoad(running_requests=50)
    url = f"{fleet.router_url}/v1/chat/completions"
    async with httpx.AsyncClient() as client:
        for role in (node_pb2.NODE_ROLE_PREFILL, node_pb2.NODE_ROLE_DECODE):
            garbage = Misbehaving(f"garbage-{role}", role, hang=False)
            async with garbage.serving(fleet, stub):
                for body in (CHAT, {**CHAT, "stream": True}):
                    response = await client.post(url, json=body)
                    assert_openai_error(response, 502, "upstream_invalid_response")
            assert garbage.received >= 2


@pytest.mark.parametrize("router_config", [RouterConfig(node_refresh_s=0.1, prefill_timeout_s=0.5)])
async def test_a_hung_prefill_node_fails_over_after_the_prefill_timeout(
    fleet: Fleet, stub: RegistryServiceStub
) -> None:
    fleet.heartbeats.load = node_pb2.NodeLoad(running_requests=50)
    hung = Misbehaving("prefill-hung", node_pb2.NODE_ROLE_PREFILL, hang=True)
    async with hung.serving(fleet, stub), httpx.AsyncClient() as client:
        started = time.monotonic()
        response = await client.post(f"{fleet.router_url}/v1/chat/completions", json=CHAT)
        took = time.monotonic() - started
        metrics = (await client.get(f"{fleet.router_url}/metrics")).text
    assert response.status_code == 200
    assert 0.5 <= took < 3
    assert hung.received == 1
    assert "kvbroker_router_prefill_failovers_total 1.0" in metrics


@pytest.mark.parametrize("router_config", [RouterConfig(node_refresh_s=0.1, decode_timeout_s=0.5)])
async def test_a_hung_decode_node_is_504(fleet: Fleet, stub: RegistryServiceStub) -> None:
    fleet.heartbeats.load = node_pb2.NodeLoad(running_requests=50)
    hung = Misbehaving("decode-hung", node_pb2.NODE_ROLE_DECODE, hang=True)
    url = f"{fleet.router_url}/v1/chat/completions"
    async with hung.serving(fleet, stub), httpx.AsyncClient() as client:
        for body in (CHAT, {**CHAT, "stream": True}):
            started = time.monotonic()
            response = await client.post(url, json=body)
            assert time.monotonic() - started < 3
            assert_openai_error(response, 504, "upstream_timeout")
    assert hung.received == 2


async def test_health_says_degraded_while_the_registry_is_away(
    fleet: Fleet, registry_server: RunningRegistry
) -> None:
    async with httpx.AsyncClient() as client:
        healthy = await client.get(f"{fleet.router_url}/health")
        assert (healthy.status_code, healthy.json()["status"]) == (200, "ok")
        await registry_server.server.stop(0)

        async def not_ok() -> httpx.Response | None:
            health = await client.get(f"{fleet.router_url}/health")
            return health if health.json()["status"] != "ok" else None

        degraded = await eventually(not_ok)  # the next node refresh failed
        assert degraded is not None
        # Still serving plain P/D from its node list: a load balancer should keep it.
        assert (degraded.status_code, degraded.json()["status"]) == (200, "degraded")
        served = await client.post(f"{fleet.router_url}/v1/chat/completions", json=CHAT)
        assert served.headers["x-kvbroker-consistency"] == "DEGRADED"


class FailingHints(registry_pb2_grpc.RegistryServiceServicer):
    """A registry that lists its nodes but fails every hint with ``code``: for the whole
    batch call, or (``per_hint``) as each hint's own refusal in an answered batch."""

    def __init__(self, nodes: list[node_pb2.NodeSpec], code: grpc.StatusCode, per_hint: bool):
        self.nodes = [node_pb2.Node(spec=s, state=node_pb2.NODE_STATE_READY) for s in nodes]
        self.code, self.per_hint = code, per_hint
        self.hints = 0

    async def ListNodes(self, request: Any, context: Any) -> registry_pb2.ListNodesResponse:
        return registry_pb2.ListNodesResponse(nodes=self.nodes)

    async def BatchGetRoutingHints(
        self, request: Any, context: grpc.aio.ServicerContext
    ) -> registry_pb2.BatchGetRoutingHintsResponse:
        self.hints += len(request.requests)
        if not self.per_hint:
            await context.abort(self.code, "hint refused by the test")
        error = registry_pb2.HintError(code=self.code.value[0], message="hint refused")
        results = [registry_pb2.RoutingHintResult(error=error) for _ in request.requests]
        return registry_pb2.BatchGetRoutingHintsResponse(results=results)


@pytest.mark.parametrize(
    ("code", "per_hint"),
    [
        (grpc.StatusCode.RESOURCE_EXHAUSTED, False),
        (grpc.StatusCode.INTERNAL, False),
        (grpc.StatusCode.UNKNOWN, False),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, True),
        (grpc.StatusCode.FAILED_PRECONDITION, True),
    ],
)
async def test_a_registry_that_fails_hints_gets_the_turn_served_plain_pd(
    code: grpc.StatusCode, per_hint: bool
) -> None:
    """Not the registry's word on the request (no ready node, a bad request): it could not
    give a hint, so the turn is served plain P/D from its node list, labelled DEGRADED,
    instead of failing with a 503."""
    prefill, decode = FakeEngine("prefill-0"), FakeEngine("decode-0")
    specs = []
    for engine, role in ((prefill, node_pb2.NODE_ROLE_PREFILL),
                         (decode, node_pb2.NODE_ROLE_DECODE)):  # fmt: skip
        spec = node_spec(engine.name, role, port=engine.port)
        spec.http_base_url = engine.url
        specs.append(spec)
    failing = FailingHints(specs, code, per_hint)
    server = grpc.aio.server()
    registry_pb2_grpc.add_RegistryServiceServicer_to_server(failing, server)
    registry_port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    router = Router(
        RegistryEndpoint.parse(f"127.0.0.1:{registry_port}"), RouterConfig(node_refresh_s=0.1)
    )
    port = free_port()
    try:
        async with (
            serving(prefill.app(), prefill.port),
            serving(decode.app(), decode.port),
            serving(build_app(router), port),
            httpx.AsyncClient() as client,
        ):
            await eventually(lambda: lists_ready(router, "prefill-0", "decode-0"))
            response = await client.post(
                f"http://127.0.0.1:{port}/v1/chat/completions", json={**CHAT, "session_id": "c"}
            )
    finally:
        await server.stop(0)
    assert response.status_code == 200, response.text
    assert response.headers["x-kvbroker-consistency"] == "DEGRADED"
    assert response.headers["x-kvbroker-decision"] == "MISS"
    assert failing.hints == 1
    assert (len(prefill.received), len(decode.received)) == (1, 1)
    assert decode.received[0]["session_id"] == "c"


async def test_health_is_503_when_the_router_can_serve_nothing() -> None:
    router = Router(RegistryEndpoint.parse(f"127.0.0.1:{free_port()}"))  # nothing listens
    port = free_port()
    async with serving(build_app(router), port), httpx.AsyncClient() as client:
        await router.refresh_nodes()  # fails, as the router's own refreshes do
        response = await client.get(f"http://127.0.0.1:{port}/health")
        served = await client.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=CHAT)
    assert (response.status_code, response.json()["status"]) == (503, "unavailable")
    assert_openai_error(served, 503, "registry_unavailable")


def test_the_cli_flags_reach_the_router_config(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[RouterConfig] = []
    monkeypatch.setattr(
        "kvbroker.router.server.serve", lambda endpoint, config, keys: seen.append(config)
    )
    # Logging set up for the CLI's output would outlive CliRunner's captured stdout.
    monkeypatch.setattr("kvbroker.cli.router.apply_logging_flags", lambda *flags: None)
    flags = ["--connect-timeout", "1.5", "--prefill-timeout", "30", "--decode-timeout", "90"]
    result = CliRunner().invoke(cli, ["router", "run", *flags, "--max-body-bytes", "1000"])
    assert result.exit_code == 0, result.output
    assert (seen[0].connect_timeout_s, seen[0].prefill_timeout_s) == (1.5, 30.0)
    assert (seen[0].decode_timeout_s, seen[0].max_body_bytes) == (90.0, 1000)
    assert CliRunner().invoke(cli, ["router", "run"]).exit_code == 0
    assert seen[1] == RouterConfig()


def test_router_run_takes_its_registry_credentials_like_the_other_commands(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    seen: list[RegistryEndpoint] = []
    monkeypatch.setattr(
        "kvbroker.router.server.serve", lambda endpoint, *rest: seen.append(endpoint)
    )
    monkeypatch.setattr("kvbroker.cli.router.apply_logging_flags", lambda *flags: None)
    (tmp_path / "token").write_text("router-secret\n")
    run = CliRunner().invoke(cli, ["router", "run", "--token-file", str(tmp_path / "token")])
    assert run.exit_code == 0, run.output
    assert seen[0].token == "router-secret"
    both = ["router", "run", "--token", "x", "--token-file", str(tmp_path / "token")]
    assert CliRunner().invoke(cli, both).exit_code == 2
    assert len(seen) == 1


# The event loop, and so the fleet's heartbeats, stops between examples while hypothesis
# draws the next one: a session TTL longer than any such pause keeps the nodes ready.
@pytest.mark.parametrize("registry_config", [RegistryConfig(session_ttl_s=60.0)])
@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    st.binary(max_size=100)
    | st.recursive(
        st.none() | st.booleans() | st.floats() | st.text(st.characters(exclude_categories=())),
        lambda children: (
            st.lists(children, max_size=3)
            | st.dictionaries(st.sampled_from(["model", "stream", "session_id", "x"]), children)
        ),
        max_leaves=10,
    ).map(lambda value: json.dumps(value, allow_nan=True).encode())
)
async def test_no_body_gets_a_500_through_the_router(fleet: Fleet, raw: bytes) -> None:
    """The fuzzing of tests/test_router_requests.py, through the served router: whatever the
    body, the client gets a completion or OpenAI's error object, never a 500."""
    async with httpx.AsyncClient() as client:
        response = await client.post(f"{fleet.router_url}/v1/chat/completions", content=raw)
    assert response.status_code in (200, 400, 404), response.text
    if response.status_code != 200:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}


# ------------------------------------------------------------ API keys and tenants

KEYS = {"acme": "sk-acme-0123", "globex": "sk-globex-4567"}
KEYED = ApiKeys({token_digest(key): Tenant(tenant) for tenant, key in KEYS.items()})


def as_tenant(tenant: str) -> dict[str, str]:
    return {"authorization": f"Bearer {KEYS[tenant]}"}


async def leases_of(stub: RegistryServiceStub, conversation: str) -> list[lease_pb2.Lease]:
    request = registry_pb2.ListLeasesRequest(conversation_id=conversation)
    return list((await stub.ListLeases(request, timeout=5)).leases)


@pytest.mark.parametrize("api_keys", [KEYED])
async def test_with_api_keys_every_v1_request_needs_one(fleet: Fleet) -> None:
    url = fleet.router_url
    requests = [
        ("POST", "/v1/chat/completions", CHAT),
        ("POST", "/v1/completions", {"model": MODEL, "prompt": "hi"}),
        ("GET", "/v1/models", None),
        ("POST", "/v1/sessions/agent-7/keepalive", {"ttl_seconds": True}),
        ("DELETE", "/v1/sessions/agent-7", None),
        ("GET", "/v1/no-such-route", None),
    ]
    refusals = [
        {},
        {"authorization": "Bearer sk-guessed"},
        {"authorization": f"Basic {KEYS['acme']}"},
        {"authorization": "Bearer"},
        {"x-api-key": KEYS["acme"]},
    ]
    async with httpx.AsyncClient() as client:
        for method, path, body in requests:
            for headers in refusals:
                response = await client.request(method, url + path, json=body, headers=headers)
                error = assert_openai_error(response, 401, "invalid_api_key")
                assert error["type"] == "invalid_request_error"
                assert response.headers["www-authenticate"] == "Bearer"
                assert KEYS["acme"] not in response.text
        # Open: a load balancer's health check and Prometheus.
        assert (await client.get(f"{url}/health")).status_code == 200
        metrics = await client.get(f"{url}/metrics")
        assert metrics.status_code == 200
        refused = len(requests) * len(refusals)
        assert f"kvbroker_router_auth_failures_total {refused}.0" in metrics.text
        # The scheme is case-insensitive, as HTTP's are.
        served = await client.post(
            f"{url}/v1/chat/completions",
            json=CHAT,
            headers={"authorization": "bearer sk-acme-0123"},
        )
        assert served.status_code == 200
        models = await client.get(f"{url}/v1/models", headers=as_tenant("globex"))
        assert [m["id"] for m in models.json()["data"]] == [MODEL]
    assert len(fleet.decode.received) == 1


@pytest.mark.parametrize("api_keys", [KEYED])
async def test_a_tenant_cannot_close_or_keep_alive_another_tenants_session(
    fleet: Fleet, stub: RegistryServiceStub
) -> None:
    """globex's agent-7 is retained (its conversation globex/agent-7); acme naming its own
    agent-7 reaches nothing of globex's: not by closing, not by keeping alive with a short TTL
    (which would shorten globex's lease), and the lease stays live and unchanged."""
    theirs = await grant(stub, fleet.decode_spec, "globex/agent-7", "d-req", ttl_s=600)
    url = fleet.router_url
    async with httpx.AsyncClient() as client:
        for ttl in (1, 0.5, None):
            body = {} if ttl is None else {"ttl_seconds": ttl}
            kept = await client.post(
                f"{url}/v1/sessions/agent-7/keepalive", json=body, headers=as_tenant("acme")
            )
            assert_openai_error(kept, 404, "session_not_found")
        closed = await client.delete(f"{url}/v1/sessions/agent-7", headers=as_tenant("acme"))
        assert_openai_error(closed, 404, "session_not_found")
        # Nor by naming the scoped id itself: a session id in a path or a body is scoped
        # again (acme/globex/agent-7).
        quoted = await client.delete(
            f"{url}/v1/sessions/globex%2Fagent-7", headers=as_tenant("acme")
        )
        assert quoted.status_code == 404
        [lease] = await leases_of(stub, "globex/agent-7")
        assert lease.state == lease_pb2.LEASE_STATE_ACTIVE
        assert lease.expire_time == theirs.expire_time

        # globex itself can.
        kept = await client.post(
            f"{url}/v1/sessions/agent-7/keepalive",
            json={"ttl_seconds": 900},
            headers=as_tenant("globex"),
        )
        assert kept.status_code == 200, kept.text
        assert kept.json()["session_id"] == "agent-7"
        assert kept.json()["lease_id"] == theirs.lease_id
        closed = await client.delete(f"{url}/v1/sessions/agent-7", headers=as_tenant("globex"))
        assert closed.json()["state"] == "REVOKED"


@pytest.mark.parametrize("api_keys", [KEYED])
async def test_a_tenants_turns_use_its_own_scoped_conversation(
    fleet: Fleet, stub: RegistryServiceStub
) -> None:
    url = f"{fleet.router_url}/v1/chat/completions"
    async with httpx.AsyncClient() as client:
        first = await client.post(
            url, json={**CHAT, "session_id": "agent-7"}, headers=as_tenant("acme")
        )
        assert first.headers["x-kvbroker-decision"] == "MISS"
        # Both legs name the scoped conversation: D retains the turn under it.
        assert fleet.decode.received[-1]["session_id"] == "acme/agent-7"
        prefill_leg = next(p for p in fleet.prefills if p.received).received[-1]
        assert prefill_leg["session_id"] == "acme/agent-7"

        ours = await grant(stub, fleet.decode_spec, "acme/agent-7", "d-req-acme")
        theirs = await grant(stub, fleet.decode_spec, "globex/agent-7", "d-req-globex")
        # acme naming globex's conversation outright names acme/globex/agent-7: nothing.
        probe = await client.post(
            url, json={**CHAT, "session_id": "globex/agent-7"}, headers=as_tenant("acme")
        )
        assert probe.headers["x-kvbroker-decision"] == "MISS"
        assert fleet.decode.received[-1]["session_id"] == "acme/globex/agent-7"
        # globex's agent-7 is globex's: its turn reads globex's lease, and leaves acme's.
        # (READ asked: a short follow-up would go DECODE_LOCAL, and the handle is the point.)
        other = await client.post(
            url,
            json={**CHAT, "conversation_id": "agent-7"},
            headers={**as_tenant("globex"), "x-kvbroker-path": "READ"},
        )
        assert other.headers["x-kvbroker-decision"] == "REUSE"
        [claimed] = await leases_of(stub, "globex/agent-7")
        assert (claimed.lease_id, claimed.state) == (theirs.lease_id, lease_pb2.LEASE_STATE_CLAIMED)
        [untouched] = await leases_of(stub, "acme/agent-7")
        assert untouched.state == lease_pb2.LEASE_STATE_ACTIVE
        # acme's next turn reads acme's lease.
        second = await client.post(
            url,
            json=CHAT,
            headers={**as_tenant("acme"), "x-session-id": "agent-7", "x-kvbroker-path": "READ"},
        )
        assert second.headers["x-kvbroker-decision"] == "REUSE"
        params = next(
            p.received[-1]["kv_transfer_params"] for p in fleet.prefills
            if p.received and p.received[-1]["kv_transfer_params"].get("remote_request_id")
            == "d-req-acme"
        )  # fmt: skip
        assert params["kvbroker_lease_id"] == ours.lease_id
        assert fleet.decode.received[-1]["session_id"] == "acme/agent-7"
    # The registry knows no bare agent-7.
    states = [state for state in lease_pb2.LeaseState.values() if state]
    everything = registry_pb2.ListLeasesRequest(states=cast("list[lease_pb2.LeaseState]", states))
    listed = (await stub.ListLeases(everything, timeout=5)).leases
    assert {lease.conversation_id for lease in listed} == {"acme/agent-7", "globex/agent-7"}
    with pytest.raises(grpc.aio.AioRpcError) as unknown:
        await stub.GetConversation(registry_pb2.GetConversationRequest(conversation_id="agent-7"))
    assert unknown.value.code() == grpc.StatusCode.NOT_FOUND


@pytest.mark.parametrize("api_keys", [KEYED])
async def test_a_tenants_session_ids_leave_room_for_its_prefix(fleet: Fleet) -> None:
    longest = "s" * (MAX_ID_LENGTH - len("acme/"))
    url = fleet.router_url
    async with httpx.AsyncClient() as client:
        served = await client.post(
            f"{url}/v1/chat/completions",
            json={**CHAT, "session_id": longest},
            headers=as_tenant("acme"),
        )
        assert served.status_code == 200, served.text
        assert fleet.decode.received[-1]["session_id"] == f"acme/{longest}"
        over = longest + "s"
        for method, path, body in (
            ("POST", "/v1/chat/completions", {**CHAT, "session_id": over}),
            ("POST", f"/v1/sessions/{over}/keepalive", None),
            ("DELETE", f"/v1/sessions/{over}", None),
        ):
            response = await client.request(
                method, url + path, json=body, headers=as_tenant("acme")
            )
            error = assert_openai_error(response, 400, "invalid_session_id")
            assert f"the limit is {len(longest)}" in error["message"]
    assert len(fleet.decode.received) == 1


def test_api_key_files_are_checked(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    good = tmp_path / "keys"
    good.write_text(
        f"# tenants\nacme {token_digest('k1')}\nacme {token_digest('k2')}  # rotated\n"
        f"globex {token_digest('k3')}\n"
    )
    keys = load_api_keys(good)
    assert [keys.tenant(f"Bearer {key}").name for key in ("k1", "k2", "k3")] == [
        "acme", "acme", "globex",
    ]  # fmt: skip
    seen: list[ApiKeys | None] = []
    monkeypatch.setattr(
        "kvbroker.router.server.serve", lambda endpoint, config, keys: seen.append(keys)
    )
    monkeypatch.setattr("kvbroker.cli.router.apply_logging_flags", lambda *flags: None)
    ran = CliRunner().invoke(cli, ["router", "run"], env={"KVBROKER_API_KEYS": str(good)})
    assert ran.exit_code == 0, ran.output
    assert seen == [keys]
    for name, text in (
        ("slash", f"acme/x {token_digest('k')}\n"),  # would make prefixes ambiguous
        ("digest", "acme sk-the-key-itself\n"),
        ("empty", "# nobody\n"),
        ("twice", f"acme {token_digest('k')}\nglobex {token_digest('k')}\n"),
    ):
        path = tmp_path / name
        path.write_text(text)
        with pytest.raises(ValueError, match=name):
            load_api_keys(path)
        refused = CliRunner().invoke(cli, ["router", "run", "--api-keys", str(path)])
        assert refused.exit_code == 2, refused.output
    assert len(seen) == 1


@pytest.mark.parametrize("api_keys", [KEYED])
async def test_a_sessionless_turn_is_named_in_kvbroker_s_namespace_for_its_tenant(
    fleet: Fleet,
) -> None:
    """Issue 41: a turn without a session id goes to both legs under a fresh id the router
    names, scoped to the client's tenant, and the answer says the id (unscoped, as the client
    would send it back); a turn with an id of its own is not renamed."""
    url = f"{fleet.router_url}/v1/chat/completions"
    async with httpx.AsyncClient() as client:
        named = []
        for _ in range(2):
            answered = await client.post(url, json=CHAT, headers=as_tenant("acme"))
            assert answered.status_code == 200, answered.text
            session = answered.headers["x-kvbroker-session-id"]
            assert is_sessionless(session) and "/" not in session
            assert fleet.decode.received[-1]["session_id"] == f"acme/{session}"
            prefill = next(
                p for p in fleet.prefills if p.name == answered.headers["x-kvbroker-prefill"]
            )
            assert prefill.received[-1]["session_id"] == f"acme/{session}"
            named.append(session)
        assert named[0] != named[1]  # each sessionless turn is its own conversation
        # A client that adopts the id continues the conversation by it.
        adopted = await client.post(
            url, json={**CHAT, "session_id": named[1]}, headers=as_tenant("acme")
        )
        assert "x-kvbroker-session-id" not in adopted.headers
        assert fleet.decode.received[-1]["session_id"] == f"acme/{named[1]}"


@pytest.mark.parametrize(
    "router_config", [RouterConfig(node_refresh_s=0.1, retain_sessionless=False)]
)
async def test_with_retain_sessionless_off_a_sessionless_turn_is_plain_pd(fleet: Fleet) -> None:
    async with httpx.AsyncClient() as client:
        answered = await client.post(f"{fleet.router_url}/v1/chat/completions", json=CHAT)
    assert answered.status_code == 200 and "x-kvbroker-session-id" not in answered.headers
    assert "session_id" not in fleet.decode.received[-1]
    assert "session_id" not in next(p for p in fleet.prefills if p.received).received[-1]


def test_no_retain_sessionless_reaches_the_router_config(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[RouterConfig] = []
    monkeypatch.setattr(
        "kvbroker.router.server.serve", lambda endpoint, config, keys: seen.append(config)
    )
    monkeypatch.setattr("kvbroker.cli.router.apply_logging_flags", lambda *flags: None)
    result = CliRunner().invoke(cli, ["router", "run", "--no-retain-sessionless"])
    assert result.exit_code == 0, result.output
    assert seen[0].retain_sessionless is False and RouterConfig().retain_sessionless is True
