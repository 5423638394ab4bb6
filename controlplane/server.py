"""Starting and stopping a registry server: gRPC (with health, reflection, auth, TLS) plus a
Prometheus endpoint; standalone on the memory store, or one replica of several over etcd."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvbroker.common.client.grpc_client import DEFAULT_REGISTRY_ADDRESS, RegistryEndpoint
from kvbroker.common.process.metrics_http import MetricsTls, serve_metrics
from kvbroker.common.process.serving import announce_and_serve, grpc_server
from kvbroker.common.process.tls_files import check_certificates, load_tls_context
from kvbroker.controlplane.api.identity import Credentials
from kvbroker.controlplane.api.interface import Leadership, Standalone
from kvbroker.controlplane.api.service import RegistryServicer, add_registry_service
from kvbroker.controlplane.config import RegistryConfig
from kvbroker.controlplane.metrics import RegistryMetrics
from kvbroker.controlplane.registry import Registry
from kvbroker.controlplane.replication.replica import Replica, ReplicaOptions
from kvbroker.controlplane.storage.cached_store import MemoryStore
from kvbroker.controlplane.storage.etcd_store import EtcdEndpoints, EtcdStore
from kvbroker.v1 import registry_pb2

log = structlog.get_logger("kvbroker.registry")

SERVICE_NAME = registry_pb2.DESCRIPTOR.services_by_name["RegistryService"].full_name


@dataclass(frozen=True)
class TlsFiles:
    cert: Path
    key: Path
    # When set, clients must present a certificate signed by this CA (mTLS), and its common
    # name says who they are (controlplane/api/identity.py).
    client_ca: Path | None = None
    # The CA that signs the replicas' server certificates, for replicas that forward to each
    # other over TLS (default: client_ca).
    peer_ca: Path | None = None

    def check(self) -> None:
        """Raises TlsFileError naming a file that is missing or wrong: gRPC itself says only
        that it failed to bind."""
        load_tls_context(self.cert, self.key, self.client_ca, server=True)
        if self.peer_ca is not None:
            check_certificates(self.peer_ca)


@dataclass(frozen=True)
class ServerOptions:
    listen: str = DEFAULT_REGISTRY_ADDRESS
    metrics_listen: str | None = None
    token: str | None = None
    # Per-role and per-node credentials (controlplane/api/identity.py).
    credentials_file: Path | None = None
    tls: TlsFiles | None = None
    config: RegistryConfig = field(default_factory=RegistryConfig)
    # "memory", or etcd://HOST:PORT[,HOST:PORT...] for replicas that share state.
    store: str = "memory"
    # Where the other replicas reach this one; default: the address it listens on.
    advertise: str | None = None
    election_ttl_s: int = 2
    etcd_prefix: str = "/kvbroker"
    # How far behind its leader a follower may be and still answer dry-run hints itself.
    hint_staleness_s: float = 1.0


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


def _peers(options: ServerOptions, credentials: Credentials) -> RegistryEndpoint:
    """How this replica reaches its leader: the shared token if there is one, and over TLS its
    own certificate as client certificate (issue replica certificates with the common name
    "replica" and the replicas' host names as subject alternative names). A leader that
    authenticates would refuse every forwarded call of a replica with neither, so such a
    replica is refused at start rather than serve failures."""
    if not (credentials.open or options.token or credentials.client_certificates):
        raise ValueError(
            "a replica forwards calls to its leader, which with --credentials accepts them "
            "only with the shared token or a client certificate: add --token (or "
            "--token-file, the same on every replica), or mTLS (--tls-client-ca, each "
            "replica's certificate with the common name 'replica')"
        )
    tls = options.tls
    if tls is None:
        return RegistryEndpoint(["peers"], options.token)
    peer_ca = tls.peer_ca or tls.client_ca
    if peer_ca is None:
        raise ValueError(
            "replicas over TLS verify each other: pass --tls-client-ca (mTLS) or --tls-peer-ca"
        )
    return RegistryEndpoint(["peers"], options.token, peer_ca, tls.cert, tls.key)


async def start_registry(options: ServerOptions) -> RunningRegistry:
    metrics = RegistryMetrics()
    etcd = EtcdEndpoints.parse(options.store) if options.store != "memory" else None
    credentials = Credentials.load(
        options.token,
        options.credentials_file,
        client_certificates=options.tls is not None and options.tls.client_ca is not None,
    )
    peers = _peers(options, credentials) if etcd is not None else None
    if options.tls is not None:
        options.tls.check()
    # Health and reflection need no credential, as load balancers and grpcurl expect; the
    # registry's own methods authenticate and authorize every call (RegistryServicer).
    server = grpc_server()
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
        # Its epochs must outrank those it granted before a restart, which it forgot: its start
        # time in milliseconds rises across restarts (unless the wall clock steps back).
        registry = Registry(
            MemoryStore(), options.config, metrics, term=time.time_ns() // 1_000_000
        )
        registry.start()
        metrics.leader.set(1)
        leadership = Standalone(registry)
    else:
        # Not serving until the replica says it can: it leads, or follows a leader it knows.
        await _set_health(health_servicer, serving=False)
        replica = Replica(
            EtcdStore(etcd, options.etcd_prefix),
            ReplicaOptions(
                options.advertise or address,
                options.election_ttl_s,
                peers,
                options.hint_staleness_s,
            ),
            options.config,
            metrics,
            on_serving=lambda serving: _set_health(health_servicer, serving),
        )
        replica_task = asyncio.create_task(replica.run(), name="kvbroker-replica")
        leadership = replica
    add_registry_service(RegistryServicer(leadership, credentials), server)
    metrics_address = None
    if options.metrics_listen is not None:
        # Over TLS the metrics are served with the registry's own certificate, and under mTLS
        # only to scrapers with a client certificate from the same CA.
        tls = options.tls
        metrics_tls = MetricsTls(tls.cert, tls.key, tls.client_ca) if tls else None
        metrics_address = serve_metrics(options.metrics_listen, metrics.registry, metrics_tls)
    await server.start()
    if etcd is None:
        await _set_health(health_servicer, serving=True)  # the memory store is always there
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


async def _set_health(servicer: health.aio.HealthServicer, serving: bool) -> None:
    """What the gRPC health service answers, for the server as a whole and for the registry."""
    status = (
        health_pb2.HealthCheckResponse.SERVING
        if serving
        else health_pb2.HealthCheckResponse.NOT_SERVING
    )
    for name in ("", SERVICE_NAME):
        await servicer.set(name, status)


async def serve_forever(options: ServerOptions) -> None:
    """Runs until SIGINT/SIGTERM; prints one JSON line with the addresses once serving."""
    running = await start_registry(options)
    await announce_and_serve({"registry": running.address, "metrics": running.metrics_address})
    log.info("registry_stopping")
    await running.stop()
