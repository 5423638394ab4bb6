"""The router's unhappy paths against a real registry and real upstream HTTP servers: a router
that gets no hint serves the turn plain P/D whenever a node is ready (its node list refreshed
when the last one has none), refuses only when a fresh list has none, says a refused
credential is a configuration error, falls back to the decode node when no prefill node
answers, never hands the client the decode engine's handle, and logs every non-2xx answer
once with its reason code."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import typer
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route
from structlog.testing import capture_logs
from typer.core import TyperGroup

from kvbroker.cli import main
from kvbroker.common.client.grpc_client import RegistryEndpoint
from kvbroker.common.process.credentials import fresh_credential
from kvbroker.common.process.ports import free_port
from kvbroker.common.rules.handles import decided_params, decode_local_params
from kvbroker.controlplane.server import RunningRegistry, ServerOptions, start_registry
from kvbroker.router.config import RouterConfig
from kvbroker.router.handlers import build_app
from kvbroker.router.proxy import Router
from kvbroker.v1 import node_pb2
from kvbroker.v1.registry_pb2_grpc import RegistryServiceStub
from kvbroker_tools.harness.engine import FakeEngine, serving
from kvbroker_tools.harness.factories import Heartbeats, node_spec
from tests.conftest import FAST, eventually

MODEL = "tiny-qwen3"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
# The background refresh never comes within a test: what the router knows of nodes is what
# it read at start, or what it refreshes on need.
NO_BACKGROUND_REFRESH = RouterConfig(node_refresh_s=3600, ready_node_wait_s=0)


@dataclass
class Engines:
    prefill: FakeEngine
    decode: FakeEngine
    specs: list[node_pb2.NodeSpec]


@pytest.fixture
async def engines() -> AsyncIterator[Engines]:
    prefill, decode = FakeEngine("prefill-0"), FakeEngine("decode-0")
    specs = []
    for engine, role in (
        (prefill, node_pb2.NODE_ROLE_PREFILL),
        (decode, node_pb2.NODE_ROLE_DECODE),
    ):
        spec = node_spec(engine.name, role, port=engine.port)
        spec.http_base_url = engine.url
        specs.append(spec)
    async with serving(prefill.app(), prefill.port), serving(decode.app(), decode.port):
        yield Engines(prefill, decode, specs)


@pytest.fixture
async def router_at() -> AsyncIterator[Callable[[Router], Any]]:
    """Serves a router; returns its URL (stopped at the test's end)."""
    async with AsyncExitStack() as stack:

        async def serve(router: Router) -> str:
            port = free_port()
            await stack.enter_async_context(serving(build_app(router), port))
            return f"http://127.0.0.1:{port}"

        yield serve


def hints_hang(registry_server: RunningRegistry, listings_too: bool = False) -> None:
    """The registry answers everything but hints, which it never answers (a registry stuck on
    one conversation's lock, say); with ``listings_too``, it answers no node listing either
    (a registry that hangs whole, its port still open)."""
    registry = registry_server.registry
    assert registry is not None

    async def hang(*args: object, **kwargs: object) -> Any:
        await asyncio.Event().wait()

    registry.routing_hint = hang  # type: ignore[method-assign]
    registry.routing_hints = hang  # type: ignore[method-assign]
    if listings_too:
        registry.list_nodes = hang  # type: ignore[method-assign]


async def test_a_node_list_from_before_the_nodes_were_ready_is_refreshed_not_refused(
    registry_server: RunningRegistry,
    stub: RegistryServiceStub,
    engines: Engines,
    router_at: Callable[[Router], Any],
) -> None:
    """The router started before any node registered; then the nodes came up and the
    registry stopped answering hints. The turn is served plain P/D (before: a 503 for "no
    known node", with both engines ready)."""
    router = Router(RegistryEndpoint.parse(registry_server.address), NO_BACKGROUND_REFRESH)
    url = await router_at(router)
    assert router.known_nodes == []
    async with Heartbeats(stub, *engines.specs), httpx.AsyncClient() as client:
        hints_hang(registry_server)
        response = await client.post(f"{url}/v1/chat/completions", json=CHAT)
    assert response.status_code == 200, response.text
    assert response.headers["x-kvbroker-consistency"] == "DEGRADED"
    assert response.json()["choices"][0]["message"]["content"] == "from decode-0"


async def test_a_hint_naming_nodes_the_list_lacks_refreshes_it_before_the_registry_hangs(
    registry_server: RunningRegistry,
    stub: RegistryServiceStub,
    engines: Engines,
    router_at: Callable[[Router], Any],
) -> None:
    """The router's list was read before the nodes registered (as after a registry restart);
    a hint then names them, and the router reads the list again at once. When the registry
    then hangs whole (no hint, no listing), the turn is served plain P/D from that list
    (before: a 503 until the next background refresh)."""
    registry = registry_server.registry
    assert registry is not None
    list_nodes, listings = registry.list_nodes, []

    async def listed_nodes(*args: Any, **kwargs: Any) -> Any:
        answer = await list_nodes(*args, **kwargs)
        listings.append(len(answer))
        return answer

    registry.list_nodes = listed_nodes  # type: ignore[method-assign]
    router = Router(RegistryEndpoint.parse(registry_server.address), NO_BACKGROUND_REFRESH)
    url = await router_at(router)
    # The router's own listing at start, before any node registered.
    await eventually(lambda: listings == [0], what="the router's first listing")
    async with Heartbeats(stub, *engines.specs), httpx.AsyncClient() as client:
        health = (await client.get(f"{url}/health")).json()
        assert health["ready_nodes"] == {"prefill": 0, "decode": 0}
        routed = await client.post(f"{url}/v1/chat/completions", json=CHAT)
        assert routed.headers["x-kvbroker-consistency"] == "EXACT", routed.text

        async def listed() -> bool:
            health = (await client.get(f"{url}/health")).json()
            return bool(health["ready_nodes"] == {"prefill": 1, "decode": 1})

        await eventually(listed, what="the router's list to hold the hinted nodes")
        assert listings == [0, 2]  # read again for the hint, once
        hints_hang(registry_server, listings_too=True)
        response = await client.post(f"{url}/v1/chat/completions", json=CHAT)
    assert response.status_code == 200, response.text
    assert response.headers["x-kvbroker-consistency"] == "DEGRADED"
    assert response.json()["choices"][0]["message"]["content"] == "from decode-0"


async def test_only_a_fresh_node_list_without_a_ready_node_refuses(
    registry_server: RunningRegistry, router_at: Callable[[Router], Any]
) -> None:
    router = Router(RegistryEndpoint.parse(registry_server.address), NO_BACKGROUND_REFRESH)
    url = await router_at(router)
    hints_hang(registry_server)
    with capture_logs() as logs:
        async with httpx.AsyncClient() as client:
            response = await client.post(f"{url}/v1/chat/completions", json=CHAT)
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "registry_unavailable"
    answered = [entry for entry in logs if entry["event"] == "answered_error"]
    assert [(e["status"], e["code"]) for e in answered] == [(503, "registry_unavailable")]


async def test_every_refusal_is_logged_once_with_its_code(
    registry_server: RunningRegistry, router_at: Callable[[Router], Any]
) -> None:
    router = Router(RegistryEndpoint.parse(registry_server.address), NO_BACKGROUND_REFRESH)
    url = await router_at(router)
    with capture_logs() as logs:
        async with httpx.AsyncClient() as client:
            bad_json = await client.post(f"{url}/v1/chat/completions", content=b"{")
            no_route = await client.get(f"{url}/v1/nothing-here")
    assert (bad_json.status_code, no_route.status_code) == (400, 404)
    answered = [(e["path"], e["status"], e["code"]) for e in logs if e["event"] == "answered_error"]
    assert answered == [
        ("/v1/chat/completions", 400, "invalid_json"),
        ("/v1/nothing-here", 404, "not_found"),
    ]


async def test_the_decode_engine_s_handle_never_reaches_the_client(
    registry_server: RunningRegistry,
    stub: RegistryServiceStub,
    engines: Engines,
    router_at: Callable[[Router], Any],
) -> None:
    async with Heartbeats(stub, *engines.specs), httpx.AsyncClient() as client:
        router = Router(RegistryEndpoint.parse(registry_server.address), NO_BACKGROUND_REFRESH)
        url = await router_at(router)
        response = await client.post(
            f"{url}/v1/chat/completions", json=CHAT, headers={"x-session-id": "conv-h"}
        )
    assert response.status_code == 200, response.text
    assert engines.decode.received[-1]["kv_transfer_params"]  # the engine had one to answer
    assert "kv_transfer_params" not in response.json()
    assert response.json()["choices"][0]["message"]["content"] == "from decode-0"


@pytest.mark.parametrize("retains", [True, False], ids=["retaining", "not-retaining"])
async def test_with_no_prefill_node_answering_the_decode_node_computes_the_turn(
    registry_server: RunningRegistry,
    stub: RegistryServiceStub,
    engines: Engines,
    router_at: Callable[[Router], Any],
    retains: bool,
) -> None:
    """The only prefill node is registered and heartbeating but its server is gone (killed
    mid-turn, not yet noticed): the decode node serves the turn from the prompt itself, as
    its own turn when it retains, as any request when it does not."""
    gone = node_spec("prefill-gone", node_pb2.NODE_ROLE_PREFILL, port=free_port())
    gone.http_base_url = f"http://127.0.0.1:{gone.side_channel_port}"
    decode = engines.specs[1]
    if not retains:
        decode.kv_retention = node_pb2.KV_RETENTION_OFF
    async with Heartbeats(stub, gone, decode), httpx.AsyncClient() as client:
        router = Router(RegistryEndpoint.parse(registry_server.address), NO_BACKGROUND_REFRESH)
        url = await router_at(router)
        response = await client.post(f"{url}/v1/chat/completions", json=CHAT)
    assert response.status_code == 200, response.text
    assert response.headers["x-kvbroker-path"] == "DECODE_LOCAL"
    decode_leg = engines.decode.received[-1]
    if retains:
        assert decode_leg["kv_transfer_params"] == decode_local_params()
    else:
        # Marked as kvbroker's decision, so the engine does not resolve it again.
        assert decode_leg["kv_transfer_params"] == decided_params()


async def test_a_degraded_turn_never_pairs_nodes_of_different_vllm_releases(
    registry_server: RunningRegistry,
    stub: RegistryServiceStub,
    engines: Engines,
    router_at: Callable[[Router], Any],
) -> None:
    """A fleet mid-upgrade while the registry is away: the only prefill node runs vLLM 0.32 and
    the only decode node 0.34, whose NIXL handshakes refuse each other. Every turn is served
    by the decode node alone (DECODE_LOCAL, as a registry's degraded hint says), none by a
    prefill leg whose KV could never reach it."""
    prefill, decode = engines.specs
    for spec, (nixl, vllm) in ((prefill, (14, "0.32.0")), (decode, (16, "0.34.0"))):
        spec.nixl_connector_version, spec.vllm_version = nixl, vllm
    async with Heartbeats(stub, prefill, decode), httpx.AsyncClient() as client:
        router = Router(RegistryEndpoint.parse(registry_server.address), NO_BACKGROUND_REFRESH)
        url = await router_at(router)
        hints_hang(registry_server)
        responses = [
            await client.post(
                f"{url}/v1/chat/completions", json=CHAT, headers={"x-session-id": "conv-mixed"}
            )
            for _ in range(3)
        ]
    for response in responses:
        assert response.status_code == 200, response.text
        assert response.headers["x-kvbroker-consistency"] == "DEGRADED"
        assert response.headers["x-kvbroker-path"] == "DECODE_LOCAL"
        assert response.json()["choices"][0]["message"]["content"] == "from decode-0"
    assert engines.prefill.received == []
    assert [leg["kv_transfer_params"] for leg in engines.decode.received] == [
        decode_local_params()
    ] * 3


@pytest.fixture
async def guarded_registry() -> AsyncIterator[RunningRegistry]:
    running = await start_registry(
        ServerOptions(listen="127.0.0.1:0", token="the-registry-token", config=FAST)
    )
    yield running
    await running.stop(grace=0.1)


async def test_a_refused_credential_is_a_configuration_error(
    guarded_registry: RunningRegistry, router_at: Callable[[Router], Any]
) -> None:
    endpoint = RegistryEndpoint.parse(guarded_registry.address, "not-the-token")
    with capture_logs() as logs:
        router = Router(endpoint, NO_BACKGROUND_REFRESH)
        url = await router_at(router)
        async with httpx.AsyncClient() as client:

            async def misconfigured() -> httpx.Response | None:
                # Each turn asks the registry again; on a busy machine the first calls can
                # miss their deadline before the registry has said anything (merely away).
                await client.post(f"{url}/v1/chat/completions", json=CHAT)
                health = await client.get(f"{url}/health")
                return health if health.json()["status"] != "unavailable" else None

            health = await eventually(misconfigured, what="the refusal to reach the router")
            for _ in range(3):  # more refusals: still one log line
                await client.post(f"{url}/v1/chat/completions", json=CHAT)
    assert health is not None and health.status_code == 503
    assert health.json()["status"] == "misconfigured"
    assert "credential" in health.json()["registry"]
    refused = [entry for entry in logs if entry["event"] == "registry_refused_credential"]
    assert len(refused) == 1
    # The fix it suggests names flags `kvbroker router run` has.
    suggested = set(re.findall(r"--[a-z-]+", refused[0]["fix"]))
    assert suggested, refused[0]
    assert suggested <= router_run_flags()


def router_run_flags() -> set[str]:
    command = typer.main.get_command(main.app)
    assert isinstance(command, TyperGroup)
    router = command.commands["router"]
    assert isinstance(router, TyperGroup)
    return {flag for param in router.commands["run"].params for flag in param.opts}


@pytest.mark.parametrize("end", [b"\n", b"\r\n"], ids=["lf", "crlf"])
async def test_a_streamed_answer_loses_the_decode_engine_s_handle_whatever_its_chunks(
    registry_server: RunningRegistry,
    stub: RegistryServiceStub,
    engines: Engines,
    router_at: Callable[[Router], Any],
    end: bytes,
) -> None:
    """vLLM 0.33 sends ``kv_transfer_params`` on a stream's last event; the router removes
    them even when the event arrives cut in pieces, whatever its line ends, and passes every
    other byte as it came."""
    first = b'data: {"choices":[{"index":0,"delta":{"content":"hel"}}]}' + 2 * end
    last = (
        b'data:{"choices":[{"index":0,"delta":{"content":"lo"}}],'
        b'"kv_transfer_params":{"remote_host":"10.0.0.5","remote_block_ids":[1,2]}}' + 2 * end
    )
    done = b"data: [DONE]" + 2 * end
    pieces = [first, last[:40], last[40:70], last[70:-1], last[-1:], done]

    async def stream(request: Request) -> StreamingResponse:
        async def chunks() -> AsyncIterator[bytes]:
            for piece in pieces:
                yield piece

        return StreamingResponse(chunks(), media_type="text/event-stream")

    port = free_port()
    decode = node_spec("decode-streams", node_pb2.NODE_ROLE_DECODE, port=port)
    decode.http_base_url = f"http://127.0.0.1:{port}"
    app = Starlette(routes=[Route("/v1/chat/completions", stream, methods=["POST"])])
    async with serving(app, port), Heartbeats(stub, engines.specs[0], decode):
        router = Router(RegistryEndpoint.parse(registry_server.address), NO_BACKGROUND_REFRESH)
        url = await router_at(router)
        async with httpx.AsyncClient() as client:
            response = await client.post(
                f"{url}/v1/chat/completions", json={**CHAT, "stream": True}
            )
    assert response.status_code == 200
    assert b"kv_transfer_params" not in response.content
    assert b"10.0.0.5" not in response.content
    assert response.content.startswith(first)
    assert b'"content":"lo"' in response.content
    assert response.content.endswith(done)


async def test_a_credential_that_lists_nodes_but_gets_no_hints_is_never_ok(
    tmp_path: Path, registry_server: RunningRegistry, router_at: Callable[[Router], Any]
) -> None:
    """A router given a node's credential: the registry lists nodes for it but refuses its
    hints. /health says ``misconfigured`` from the start (before any client's turn), and a
    node list read afterwards does not turn it back to ``ok``."""
    token, line = fresh_credential("node:decode-0:decode")
    credentials = tmp_path / "credentials"
    credentials.write_text(line + "\n")
    running = await start_registry(
        ServerOptions(listen="127.0.0.1:0", credentials_file=credentials, config=FAST)
    )
    try:
        router = Router(RegistryEndpoint.parse(running.address, token), NO_BACKGROUND_REFRESH)
        url = await router_at(router)
        async with httpx.AsyncClient() as client:
            await eventually(lambda: router.registry_refused is not None, what="the refusal")
            await router.refresh_nodes()  # the node list is the registry's to give this one
            assert router.registry_away is None
            health = await client.get(f"{url}/health")
    finally:
        await running.stop(grace=0.1)
    assert health.status_code == 503
    assert health.json()["status"] == "misconfigured"
    assert "may not call BatchGetRoutingHints" in health.json()["registry"]
