"""Failover lists of registry names with real processes: a registry, two `kvbroker sidecar run`
and a `kvbroker router run`, all given `--registry` as a list of `localhost:PORT` entries, one
of which nothing serves."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx

from kvbroker.common.client.engine_link import EngineLink
from kvbroker.common.process.ports import free_port
from kvbroker.common.process.supervisor import ChildProcess, stop_all
from kvbroker.common.process.tasks import poll_until
from kvbroker.v1 import sidecar_pb2
from kvbroker_tools.harness.engine import FakeEngine
from kvbroker_tools.harness.processes import sidecar_process
from kvbroker_tools.stack import router_command, router_routing
from tests.conftest import spawn_registry


def engine_info(engine: FakeEngine) -> sidecar_pb2.EngineInfo:
    return sidecar_pb2.EngineInfo(
        engine_id=f"engine-{engine.name}",
        side_channel_host="127.0.0.1",
        side_channel_port=engine.port,
        block_size=16,
        capacity_blocks=4096,
        bytes_per_block=65536,
    )


async def test_sidecars_register_and_the_router_routes_through_a_list_of_names(
    tmp_path: Path,
) -> None:
    registry = await spawn_registry("--heartbeat-interval", "0.2")
    live = f"localhost:{registry.address.rpartition(':')[2]}"
    dead = f"localhost:{free_port()}"
    children: list[ChildProcess] = [registry]
    links: list[EngineLink] = []
    async with FakeEngine("prefill-0") as prefill, FakeEngine("decode-0") as decode:
        try:
            for engine, role in ((prefill, "prefill"), (decode, "decode")):
                socket_path = tmp_path / f"{role}.sock"
                sidecar = sidecar_process(
                    f"{live},{dead}", engine.url, engine.name, socket_path, role,
                    log=tmp_path / f"sidecar-{role}.log",
                )  # fmt: skip
                await sidecar.start()
                children.append(sidecar)
                link = EngineLink(f"unix:{socket_path}", engine_info(engine))
                link.start()
                links.append(link)
            # The dead entry first: the router's calls must pass it by.
            router_url = f"http://127.0.0.1:{free_port()}"
            router = ChildProcess(
                "router",
                router_command(f"{dead},{live}", router_url.removeprefix("http://")),
                tmp_path / "router.log",
                ready=[router_routing(router_url, decode.model, within_s=30)],
            )
            await router.start()
            children.append(router)
            async with httpx.AsyncClient(timeout=10) as client:
                response = await client.post(
                    f"{router_url}/v1/chat/completions",
                    json={
                        "model": decode.model,
                        "messages": [{"role": "user", "content": "hi"}],
                        "max_tokens": 5,
                    },
                )
            assert response.status_code == 200, response.text
            assert response.json()["choices"][0]["message"]["content"] == "from decode-0"
            assert prefill.received and decode.received
        finally:
            for link in links:
                await asyncio.to_thread(link.close)
            await stop_all(children)


async def test_a_sidecar_says_each_time_it_cannot_reach_any_registry_in_its_list(
    tmp_path: Path,
) -> None:
    dead = [f"localhost:{free_port()}" for _ in range(2)]
    socket_path = tmp_path / "decode.sock"
    log = tmp_path / "sidecar.log"
    async with FakeEngine("decode-0") as engine:
        sidecar = sidecar_process(",".join(dead), engine.url, engine.name, socket_path, log=log)
        await sidecar.start()
        link = EngineLink(f"unix:{socket_path}", engine_info(engine))
        link.start()
        try:
            await poll_until(lambda: _lost(log, 3), 15, "three failed attempts logged")
        finally:
            await asyncio.to_thread(link.close)
            await sidecar.stop()


async def _lost(log: Path, n: int) -> bool:
    lines = (await asyncio.to_thread(log.read_text)).splitlines()
    records = [json.loads(line) for line in lines if line.startswith("{")]
    return sum(record.get("event") == "registry_session_lost" for record in records) >= n
