"""Starting and stopping the placement hop: Envoy's ext_proc service plus gRPC health, which
answers SERVING for the server as a whole, for the ext_proc service, and for the names GIE's
endpoint-picker protocol probes (``liveness``, ``readiness``), so the same health check
config works for it as for a picker."""

from __future__ import annotations

from dataclasses import dataclass

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kvbroker.common.client.grpc_client import RegistryEndpoint, open_channel, registry_stub
from kvbroker.common.process.serving import announce_and_serve
from kvbroker.gateway.config import EXT_PROC_SERVICE, PlacementConfig
from kvbroker.gateway.envoy_v3.envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from kvbroker.gateway.ext_proc import PlacementProcessor

log = structlog.get_logger("kvbroker.gateway")

HEALTH_NAMES = ("", EXT_PROC_SERVICE, "liveness", "readiness")


@dataclass
class RunningPlacement:
    server: grpc.aio.Server
    channel: grpc.aio.Channel
    address: str
    health: health.aio.HealthServicer

    async def stop(self, grace: float = 0.5) -> None:
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace)
        await self.channel.close()


def ext_proc_handler(processor: PlacementProcessor) -> grpc.GenericRpcHandler:
    """The ExternalProcessor service, registered by hand: only its one bidirectional method,
    with the generated messages as codecs."""
    process = grpc.stream_stream_rpc_method_handler(
        processor.process,
        request_deserializer=ep.ProcessingRequest.FromString,
        response_serializer=ep.ProcessingResponse.SerializeToString,
    )
    return grpc.method_handlers_generic_handler(EXT_PROC_SERVICE, {"Process": process})


async def start_placement(endpoint: RegistryEndpoint, config: PlacementConfig) -> RunningPlacement:
    channel = open_channel(endpoint)
    # Connect now, not on the first request: its deadline is tens of milliseconds, and a
    # connection made inside it would send the first requests on unchanged.
    channel.get_state(try_to_connect=True)
    server = grpc.aio.server()
    server.add_generic_rpc_handlers(
        (ext_proc_handler(PlacementProcessor(registry_stub(channel), config)),)
    )
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = server.add_insecure_port(config.listen)
    await server.start()
    for name in HEALTH_NAMES:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    host = config.listen.rsplit(":", 1)[0]
    address = f"{host}:{port}"
    log.info("placement_serving", address=address, mode=str(config.mode))
    return RunningPlacement(server, channel, address, health_servicer)


async def serve_forever(endpoint: RegistryEndpoint, config: PlacementConfig) -> None:
    """Runs until SIGINT/SIGTERM; prints one JSON line with the address once serving."""
    running = await start_placement(endpoint, config)
    await announce_and_serve({"placement": running.address})
    await running.stop()
