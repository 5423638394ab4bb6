"""``GET /v1/placement`` on kvbroker's router, against a real registry: the affinity headers
llm-d and Dynamo honour, for the nodes that hold a conversation's KV; none for a turn that
reuses nothing; the registry's dry run (no lease claimed); bad input refused alone."""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator

import httpx
import pytest

from kvbroker.common.client.grpc_client import RegistryEndpoint
from kvbroker.common.process.ports import free_port
from kvbroker.controlplane.server import RunningRegistry
from kvbroker.router.config import RouterConfig
from kvbroker.router.handlers import build_app
from kvbroker.router.proxy import Router
from kvbroker.v1 import lease_pb2, node_pb2, registry_pb2
from kvbroker.v1.registry_pb2_grpc import RegistryServiceStub
from kvbroker_tools.harness.engine import serving
from kvbroker_tools.harness.factories import Heartbeats, grant, node_spec


@pytest.fixture
async def router_url(registry_server: RunningRegistry) -> AsyncIterator[str]:
    router = Router(RegistryEndpoint.parse(registry_server.address), RouterConfig())
    port = free_port()
    async with serving(build_app(router), port):
        yield f"http://127.0.0.1:{port}"


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


async def test_placement_pins_the_nodes_holding_the_kv(
    stub: RegistryServiceStub, router_url: str
) -> None:
    decode = node_spec("decode-0")
    decode.kubernetes_pod, decode.dynamo_worker_id = "llm/decode-0", "7587890"
    decode.gateway_endpoint = "10.0.0.7:8000"
    prefill = node_spec("prefill-0", node_pb2.NODE_ROLE_PREFILL, port=5700)
    prefill.kubernetes_pod, prefill.dynamo_worker_id = "llm/prefill-0", "7587891"
    async with Heartbeats(stub, decode, prefill), httpx.AsyncClient() as http:
        new = await http.get(f"{router_url}/v1/placement", params={"session_id": "conv-1"})
        assert new.status_code == 200, new.text
        assert new.json()["headers"] == {}  # nothing retained: the fleet's router decides
        assert new.json()["decision"] == "MISS"
        assert "x-session-token" not in new.headers

        lease = await grant(stub, decode, "conv-1", "req-1", tokens=512)
        short = await http.get(
            f"{router_url}/v1/placement", params={"session_id": "conv-1", "prompt_tokens": 540}
        )
        body = short.json()
        assert (body["path"], body["decode"], body["retained_tokens"]) == (
            "DECODE_LOCAL",
            "decode-0",
            512,
        )
        assert short.headers["x-session-token"] == b64("llm/decode-0")
        assert short.headers["x-worker-instance-id"] == "7587890"
        assert short.headers["x-gateway-destination-endpoint-subset"] == "10.0.0.7:8000"
        assert "x-session-token-prefill" not in short.headers  # no prefill leg for llm-d
        # Dynamo's disaggregated frontend needs its prefill pin beside the decode pin.
        assert short.headers["x-prefill-instance-id"] == "7587891"

        bulk = await http.get(
            f"{router_url}/v1/placement",
            params={"session_id": "conv-1", "prompt_tokens": 512 + 5000},
        )
        assert bulk.json()["path"] == "READ"
        assert bulk.headers["x-session-token-prefill"] == b64("llm/prefill-0")
        assert bulk.headers["x-prefill-instance-id"] == "7587891"
        assert bulk.headers["x-gateway-destination-endpoint-subset"] == (
            "10.0.0.7:8000,127.0.0.1:6700"
        )
        # A dry run: the engine the turn reaches claims the lease for itself.
        listed = await stub.GetLease(
            registry_pb2.GetLeaseRequest(lease_id=lease.lease_id), timeout=5
        )
        assert listed.lease.state == lease_pb2.LEASE_STATE_ACTIVE


async def test_placement_refuses_bad_input_alone(
    stub: RegistryServiceStub, router_url: str
) -> None:
    decode, prefill = node_spec("decode-0"), node_spec("prefill-0", node_pb2.NODE_ROLE_PREFILL)
    async with Heartbeats(stub, decode, prefill), httpx.AsyncClient() as http:
        for params, field in (
            ({}, "session_id"),
            ({"session_id": "x" * 5000}, "session_id"),
            ({"session_id": "c", "prompt_tokens": "-3"}, "prompt_tokens"),
            # A digit to str.isdigit, not to int(); and more digits than int() reads (both
            # answered 500 before, issue 36).
            ({"session_id": "c", "prompt_tokens": "\u00b2"}, "prompt_tokens"),
            ({"session_id": "c", "prompt_tokens": "9" * 5000}, "prompt_tokens"),
            # The registry's refusal of a bad argument is the client's 400, never a 503 it
            # would retry forever.
            ({"session_id": "c", "model": "m" * 3000}, "model"),
        ):
            refused = await http.get(f"{router_url}/v1/placement", params=params)
            assert refused.status_code == 400, (params, refused.text)
            error = refused.json()["error"]
            assert error["type"] == "invalid_request_error"
            assert field in (error.get("param") or error["message"]), error
        fine = await http.get(f"{router_url}/v1/placement", params={"session_id": "c"})
        assert fine.status_code == 200
