"""Starting and stopping a registry server: gRPC (with health, reflection, auth, TLS) plus a
Prometheus endpoint."""

from __future__ import annotations

import asyncio
import hmac
import json
import signal
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import start_http_server

from controlplane.config import RegistryConfig
from controlplane.registry import Registry
from controlplane.service import RegistryServicer
from controlplane.store import MemoryStore
from kvbroker.common.grpc_client import AUTH_METADATA_KEY
from kvbroker.v1 import registry_pb2, registry_pb2_grpc

log = structlog.get_logger("kvbroker.registry")

SERVICE_NAME = registry_pb2.DESCRIPTOR.services_by_name["RegistryService"].full_name
# Probes and discovery work without a token, as load balancers and grpcurl expect.
_OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


@dataclass(frozen=True)
class TlsFiles:
    cert: Path
    key: Path
    # When set, clients must present a certificate signed by this CA (mTLS).
    client_ca: Path | None = None


@dataclass(frozen=True)
class ServerOptions:
    listen: str = "127.0.0.1:7070"
    metrics_listen: str | None = None
    token: str | None = None
    tls: TlsFiles | None = None
    config: RegistryConfig = field(default_factory=RegistryConfig)


class _BearerTokenAuth(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        if details.method.startswith(_OPEN_METHOD_PREFIXES):
            return await continuation(details)
        presented = dict(details.invocation_metadata or ()).get(AUTH_METADATA_KEY, "")
        if hmac.compare_digest(str(presented).encode(), self._expected):
            return await continuation(details)
        return _deny(details.method)


def _deny(method: str) -> grpc.RpcMethodHandler:
    async def abort(request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(
            grpc.StatusCode.UNAUTHENTICATED,
            "missing or wrong bearer token (pass --token or KVBROKER_TOKEN)",
        )

    if method.endswith("/WatchLeaseCommands"):
        return grpc.unary_stream_rpc_method_handler(abort)
    return grpc.unary_unary_rpc_method_handler(abort)


@dataclass
class RunningRegistry:
    server: grpc.aio.Server
    registry: Registry
    address: str
    metrics_address: str | None
    health: health.aio.HealthServicer

    async def stop(self, grace: float = 1.0) -> None:
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace)
        await self.registry.stop()


def _bind(server: grpc.aio.Server, listen: str, tls: TlsFiles | None) -> int:
    if tls is None:
        return int(server.add_insecure_port(listen))
    credentials = grpc.ssl_server_credentials(
        [(tls.key.read_bytes(), tls.cert.read_bytes())],
        root_certificates=tls.client_ca.read_bytes() if tls.client_ca else None,
        require_client_auth=tls.client_ca is not None,
    )
    return int(server.add_secure_port(listen, credentials))


async def start_registry(options: ServerOptions) -> RunningRegistry:
    registry = Registry(MemoryStore(), options.config)
    interceptors = [_BearerTokenAuth(options.token)] if options.token else []
    server = grpc.aio.server(interceptors=interceptors)
    registry_pb2_grpc.add_RegistryServiceServicer_to_server(RegistryServicer(registry), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (
            SERVICE_NAME,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        ),
        server,
    )
    port = _bind(server, options.listen, options.tls)
    if port == 0:
        raise OSError(f"cannot listen on {options.listen}")
    metrics_address = None
    if options.metrics_listen is not None:
        host, _, metrics_port = options.metrics_listen.rpartition(":")
        http_server, _thread = start_http_server(
            int(metrics_port), addr=host, registry=registry.metrics.registry
        )
        metrics_address = f"{host}:{http_server.server_port}"
    registry.start()
    await server.start()
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    host = options.listen.rpartition(":")[0]
    address = f"{host}:{port}"
    log.info("registry_serving", address=address, metrics=metrics_address, tls=bool(options.tls))
    return RunningRegistry(server, registry, address, metrics_address, health_servicer)


async def serve_forever(options: ServerOptions) -> None:
    """Runs until SIGINT/SIGTERM; prints one JSON line with the addresses once serving."""
    running = await start_registry(options)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    print(
        json.dumps({"registry": running.address, "metrics": running.metrics_address}),
        flush=True,
        file=sys.stdout,
    )
    await stop.wait()
    log.info("registry_stopping")
    await running.stop()
