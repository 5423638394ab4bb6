"""Starting and stopping a registry server: gRPC (with health, reflection, auth, TLS) plus a
Prometheus endpoint; standalone on the memory store, or one replica of several over etcd."""

from __future__ import annotations

import asyncio
import hmac
import json
import signal
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import start_http_server

from controlplane.config import RegistryConfig
from controlplane.etcd_store import MAX_BLOCK_HASHES, EtcdEndpoints, EtcdStore
from controlplane.metrics import RegistryMetrics
from controlplane.registry import Registry
from controlplane.replica import Replica, ReplicaOptions
from controlplane.service import Leadership, RegistryServicer, Standalone, add_registry_service
from controlplane.store import MemoryStore
from kvbroker.common.grpc_client import AUTH_METADATA_KEY
from kvbroker.v1 import registry_pb2

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
    # "memory", or etcd://HOST:PORT[,HOST:PORT...] for replicas that share state.
    store: str = "memory"
    # Where the other replicas reach this one; default: the address it listens on.
    advertise: str | None = None
    election_ttl_s: int = 2
    etcd_prefix: str = "/kvbroker"


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
    leadership: Leadership
    address: str
    metrics_address: str | None
    health: health.aio.HealthServicer
    # The election loop of a replica over etcd.
    replica_task: asyncio.Task[None] | None = None

    @property
    def registry(self) -> Registry | None:
        """The serving registry: always with the memory store, while leading over etcd."""
        return self.leadership.registry

    async def stop(self, grace: float = 1.0) -> None:
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace)
        if self.replica_task is not None:
            self.replica_task.cancel()
            await asyncio.gather(self.replica_task, return_exceptions=True)
        if isinstance(self.leadership, Standalone):
            await self.leadership.registry.stop()


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
    metrics = RegistryMetrics()
    etcd = EtcdEndpoints.parse(options.store) if options.store != "memory" else None
    if etcd is not None and options.tls is not None:
        # Followers forward to the leader over plaintext gRPC; no peer TLS yet.
        raise ValueError("TLS is not supported together with etcd replicas yet")
    interceptors = [_BearerTokenAuth(options.token)] if options.token else []
    server = grpc.aio.server(interceptors=interceptors)
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
    host = options.listen.rpartition(":")[0]
    address = f"{host}:{port}"
    leadership: Leadership
    replica_task = None
    if etcd is None:
        registry = Registry(MemoryStore(), options.config, metrics)
        registry.start()
        metrics.leader.set(1)
        leadership = Standalone(registry)
    else:
        config = replace(
            options.config,
            max_block_hashes=min(options.config.max_block_hashes, MAX_BLOCK_HASHES),
        )
        replica = Replica(
            EtcdStore(etcd, options.etcd_prefix),
            ReplicaOptions(options.advertise or address, options.election_ttl_s, options.token),
            config,
            metrics,
        )
        replica_task = asyncio.create_task(replica.run(), name="kvbroker-replica")
        leadership = replica
    add_registry_service(RegistryServicer(leadership), server)
    metrics_address = None
    if options.metrics_listen is not None:
        metrics_host, _, metrics_port = options.metrics_listen.rpartition(":")
        http_server, _thread = start_http_server(
            int(metrics_port), addr=metrics_host, registry=metrics.registry
        )
        metrics_address = f"{metrics_host}:{http_server.server_port}"
    await server.start()
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info(
        "registry_serving",
        address=address,
        metrics=metrics_address,
        tls=bool(options.tls),
        store=options.store,
    )
    return RunningRegistry(
        server, leadership, address, metrics_address, health_servicer, replica_task
    )


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
