"""Router overhead per request: the same two legs sent through the router and sent directly.

Real registry (in process, over loopback gRPC), real router (uvicorn), and instant upstream
servers, so what remains is the router's own cost: parsing, the routing hint, proxying both
legs. Run from the repository root: ``.venv/bin/python scripts/router_overhead.py``.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvbroker.common.client.grpc_client import RegistryEndpoint, open_channel, registry_stub
from kvbroker.common.process.ports import free_port
from kvbroker.controlplane.server import ServerOptions, start_registry
from kvbroker.router.config import RouterConfig
from kvbroker.router.handlers import build_app
from kvbroker.router.proxy import Router
from kvbroker.v1 import node_pb2
from kvbroker_tools.harness.engine import FakeEngine, serving
from kvbroker_tools.harness.factories import Heartbeats, node_spec

REQUESTS = 500
BODY = {"model": "tiny-qwen3", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}


def percentile(values: list[float], q: float) -> float:
    return sorted(values)[min(int(q * len(values)), len(values) - 1)]


async def main() -> None:
    registry = await start_registry(ServerOptions(listen="127.0.0.1:0"))
    prefill, decode = FakeEngine("prefill-0"), FakeEngine("decode-0")
    specs = []
    for engine, role in (
        (prefill, node_pb2.NODE_ROLE_PREFILL),
        (decode, node_pb2.NODE_ROLE_DECODE),
    ):
        spec = node_spec(engine.name, role, port=engine.port)
        spec.http_base_url = engine.url
        specs.append(spec)
    router = Router(RegistryEndpoint.parse(registry.address), RouterConfig(node_refresh_s=0.5))
    port = free_port()
    async with (
        open_channel(RegistryEndpoint.parse(registry.address)) as channel,
        Heartbeats(registry_stub(channel), *specs),
        serving(prefill.app(), prefill.port),
        serving(decode.app(), decode.port),
        serving(build_app(router), port),
        httpx.AsyncClient() as client,
    ):
        routed, direct = [], []
        for i in range(REQUESTS + 50):
            body = {**BODY, "session_id": f"conv-{i % 20}"}
            started = time.perf_counter()
            response = await client.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body)
            elapsed = time.perf_counter() - started
            assert response.status_code == 200
            started = time.perf_counter()
            leg = await client.post(
                f"{prefill.url}/v1/chat/completions", json={**body, "max_tokens": 1}
            )
            await client.post(
                f"{decode.url}/v1/chat/completions",
                json={**body, "kv_transfer_params": leg.json()["kv_transfer_params"]},
            )
            baseline = time.perf_counter() - started
            if i >= 50:  # warm-up
                routed.append(elapsed * 1000)
                direct.append(baseline * 1000)
    await registry.stop(0)
    overhead = [r - d for r, d in zip(routed, direct, strict=True)]
    for name, values in (
        ("through router", routed),
        ("direct legs", direct),
        ("overhead", overhead),
    ):
        p50, p99 = statistics.median(values), percentile(values, 0.99)
        print(f"{name:15s} p50 {p50:6.2f} ms   p99 {p99:6.2f} ms")


if __name__ == "__main__":
    asyncio.run(main())
