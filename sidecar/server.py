"""Running a sidecar: the agent, its local endpoint and its metrics, until a signal.

The agent's loops never end on their own: they retry what the registry and the engine do to
them. One that ends anyway has met a bug, and a sidecar without its loops is worse than none
(alive, so nobody restarts it, while its node goes DOWN). So it is logged with its traceback
and the process exits non-zero, for its supervisor to start a fresh one.
"""

from __future__ import annotations

import asyncio
import json
import signal
from dataclasses import dataclass

import grpc
import structlog

from kvbroker.common.client.grpc_client import RegistryEndpoint
from kvbroker.common.process.metrics_http import MetricsTls, serve_metrics
from kvbroker.common.process.serving import grpc_server
from kvbroker.sidecar.agent import Agent
from kvbroker.sidecar.config import SidecarConfig, check_local_listen
from kvbroker.sidecar.local import SidecarServicer
from kvbroker.v1 import sidecar_pb2_grpc

log = structlog.get_logger("kvbroker.sidecar")


@dataclass
class RunningSidecar:
    agent: Agent
    server: grpc.aio.Server
    listen: str
    metrics_address: str | None
    task: asyncio.Task[None]

    async def stop(self) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
        await self.agent.close()
        await self.server.stop(0.5)


async def start_sidecar(
    config: SidecarConfig,
    registry: RegistryEndpoint,
    listen: str,
    metrics_listen: str | None = None,
    metrics_tls: MetricsTls | None = None,
) -> RunningSidecar:
    check_local_listen(listen)
    agent = Agent(config, registry)
    server = grpc_server()
    sidecar_pb2_grpc.add_SidecarServiceServicer_to_server(SidecarServicer(agent), server)
    if server.add_insecure_port(listen) == 0:
        raise OSError(f"cannot listen on {listen}")
    metrics_address = None
    if metrics_listen is not None:
        metrics_address = serve_metrics(metrics_listen, agent.metrics.registry, metrics_tls)
    await server.start()
    task = asyncio.create_task(agent.run(), name="kvbroker-sidecar-session")
    log.info("sidecar_serving", listen=listen, node=config.node_id, registry=str(registry))
    return RunningSidecar(agent, server, listen, metrics_address, task)


async def serve_forever(
    config: SidecarConfig,
    registry: RegistryEndpoint,
    listen: str,
    metrics_listen: str | None,
    metrics_tls: MetricsTls | None = None,
) -> None:
    running = await start_sidecar(config, registry, listen, metrics_listen, metrics_tls)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    print(
        json.dumps(
            {
                "sidecar": listen,
                "node": config.node_id,
                "incarnation": running.agent.incarnation,
                "metrics": running.metrics_address,
            }
        ),
        flush=True,
    )
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait({stopping, running.task}, return_when=asyncio.FIRST_COMPLETED)
    stopping.cancel()
    if running.task.done():
        error = running.task.exception()
        log.error("sidecar_failed", exc_info=error or RuntimeError("the agent's loops ended"))
        await running.stop()
        raise SystemExit(1)
    log.info("sidecar_stopping")
    await running.stop()
