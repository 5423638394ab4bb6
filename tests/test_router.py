"""The router against a real registry and real upstream HTTP servers."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx
import pytest

from controlplane.server import RunningRegistry
from kvbroker.common.grpc_client import RegistryEndpoint
from kvbroker.common.ports import free_port
from kvbroker.testing.engine import FakeEngine, serving
from kvbroker.testing.factories import Heartbeats, grant, node_spec
from kvbroker.v1 import node_pb2
from kvbroker.v1.registry_pb2_grpc import RegistryServiceStub
from router.config import RouterConfig
from router.proxy import Router, build_app

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


@pytest.fixture
async def fleet(
    stub: RegistryServiceStub, registry_server: RunningRegistry
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
        RegistryEndpoint.parse(registry_server.address), RouterConfig(node_refresh_s=0.1)
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
        await asyncio.sleep(0.3)  # the router's first node refresh
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
                                                     "do_remote_prefill": False}  # fmt: skip
        decode_leg = fleet.decode.received[-1]
        assert decode_leg["session_id"] == "conv-1"
        assert decode_leg["max_tokens"] == 5
        assert decode_leg["kv_transfer_params"]["do_remote_prefill"] is True

        # D retained the turn (its sidecar reported it): the next turn carries the handle.
        lease = await grant(stub, fleet.decode_spec, "conv-1", "d-req-1")
        body = {**CHAT, "conversation_id": "conv-1"}  # vLLM example proxy's field
        second = await client.post(f"{fleet.router_url}/v1/chat/completions", json=body)
        assert second.headers["x-kvbroker-decision"] == "REUSE"
        params = next(
            p.received[-1] for p in fleet.prefills if p.received and
            "kvbroker_lease_id" in p.received[-1]["kv_transfer_params"]
        )["kv_transfer_params"]  # fmt: skip
        assert params["kvbroker_lease_id"] == lease.lease_id
        assert params["kvbroker_epoch"] == 1
        assert params["remote_request_id"] == "d-req-1"
        assert len(params["kvbroker_block_hashes"]) == len(lease.block_hashes)
        assert "conversation_id" not in fleet.decode.received[-1]
        assert fleet.decode.received[-1]["session_id"] == "conv-1"


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
        await asyncio.sleep(0.3)
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
        await asyncio.sleep(0.5)
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
    assert len(events) == 3
    last = json.loads(events[-1][6:])
    assert last["error"]["type"] == "upstream_error"
    assert "mid-stream" in last["error"]["message"]


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


async def test_malformed_requests_get_400(fleet: Fleet) -> None:
    async with httpx.AsyncClient() as client:
        garbage = await client.post(f"{fleet.router_url}/v1/chat/completions", content=b"{no")
        assert garbage.status_code == 400
        assert "not valid JSON" in garbage.json()["error"]["message"]
        listed = await client.post(f"{fleet.router_url}/v1/completions", json=[1, 2])
        assert listed.status_code == 400
    assert not fleet.decode.received


async def test_models_and_health(fleet: Fleet) -> None:
    async with httpx.AsyncClient() as client:
        models = (await client.get(f"{fleet.router_url}/v1/models")).json()
        assert [m["id"] for m in models["data"]] == [MODEL]
        assert (await client.get(f"{fleet.router_url}/health")).status_code == 200
