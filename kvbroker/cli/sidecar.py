"""``kvbroker sidecar``: run the agent beside a vLLM server; defaults from SidecarConfig."""

from __future__ import annotations

import socket
from enum import StrEnum
from pathlib import Path
from typing import Annotated, cast

import typer
import uvloop

from kvbroker.cli.client import registry_flags
from kvbroker.cli.options import (
    DEFAULT_LOG_FORMAT,
    DEFAULT_LOG_LEVEL,
    LogFormatOpt,
    LogLevelOpt,
    MetricsListenOpt,
    apply_logging_flags,
    host_port,
)
from kvbroker.cli.output import fail
from kvbroker.common.client.grpc_client import RegistryEndpoint
from kvbroker.common.process.metrics_http import MetricsTls
from kvbroker.common.process.ports import ensure_free
from kvbroker.common.process.tls_files import TlsFileError
from kvbroker.common.rules.labels import by_lower_label
from kvbroker.sidecar.config import SidecarConfig, check_local_listen
from kvbroker.v1 import node_pb2

sidecar_app = typer.Typer(help="Run the agent beside a vLLM server.", no_args_is_help=True)

_NODE_ROLES = by_lower_label(node_pb2.NodeRole)


def _listen_address(value: str) -> str:
    """--listen: unix:PATH, or a loopback HOST:PORT (checked as every listen address is)."""
    if not value or value.startswith("unix:"):
        return value
    try:
        return check_local_listen(str(host_port(value)))
    except ValueError as error:
        raise typer.BadParameter(str(error)) from None


class Role(StrEnum):
    """The --role choices: the lower-case labels of NodeRole."""

    prefill = "prefill"
    decode = "decode"
    both = "both"


@sidecar_app.command("run")
@registry_flags
def sidecar_run(
    engine_url: Annotated[
        str,
        typer.Option(envvar="KVBROKER_ENGINE_URL", help="The vLLM server, http://HOST:PORT."),
    ],
    role: Annotated[Role, typer.Option(envvar="KVBROKER_ROLE", help="The node's P/D role.")],
    node_id: Annotated[
        str,
        typer.Option(envvar="KVBROKER_NODE_ID", help="Unique node name [default: HOST-ROLE]."),
    ] = "",
    listen: Annotated[
        str,
        typer.Option(
            envvar="KVBROKER_SIDECAR_LISTEN",
            callback=_listen_address,
            help="Local endpoint for the engine, unix:PATH or a loopback HOST:PORT (never served "
            "beyond the node) [default: unix:/tmp/kvbroker-NODE.sock].",
        ),
    ] = "",
    model: Annotated[
        str, typer.Option(envvar="KVBROKER_MODEL", help="Served model [default: ask the engine].")
    ] = SidecarConfig.model,
    advertise_url: Annotated[
        str,
        typer.Option(envvar="KVBROKER_ADVERTISE_URL", help="URL routers use [default: engine's]."),
    ] = SidecarConfig.advertise_url,
    prefix_caching: Annotated[
        bool,
        typer.Option(
            envvar="KVBROKER_PREFIX_CACHING",
            help="The engine caches prefixes: off when vLLM runs with --no-enable-prefix-caching.",
        ),
    ] = SidecarConfig.prefix_caching,
    gateway_endpoint: Annotated[
        str,
        typer.Option(
            envvar="KVBROKER_GATEWAY_ENDPOINT",
            help="The engine's ip:port as the gateway sees it, for placement hints "
            "[default: from --advertise-url or --engine-url].",
        ),
    ] = SidecarConfig.gateway_endpoint,
    dynamo_worker_id: Annotated[
        str,
        typer.Option(
            envvar="KVBROKER_DYNAMO_WORKER_ID",
            help="The engine's Dynamo worker instance id, for Dynamo's pin headers.",
        ),
    ] = SidecarConfig.dynamo_worker_id,
    kubernetes_pod: Annotated[
        str,
        typer.Option(
            envvar="KVBROKER_KUBERNETES_POD",
            help="The engine's pod as namespace/name, for llm-d's session-affinity header.",
        ),
    ] = SidecarConfig.kubernetes_pod,
    metrics_listen: MetricsListenOpt = None,
    metrics_tls_cert: Annotated[
        Path | None,
        typer.Option(
            envvar="KVBROKER_METRICS_TLS_CERT",
            help="Serve /metrics over HTTPS with this certificate (and --metrics-tls-key).",
        ),
    ] = None,
    metrics_tls_key: Annotated[
        Path | None, typer.Option(envvar="KVBROKER_METRICS_TLS_KEY", help="Its key.")
    ] = None,
    metrics_tls_client_ca: Annotated[
        Path | None,
        typer.Option(
            envvar="KVBROKER_METRICS_TLS_CLIENT_CA",
            help="Only scrapers with a client certificate signed by this CA may read /metrics.",
        ),
    ] = None,
    log_level: LogLevelOpt = DEFAULT_LOG_LEVEL,
    log_format: LogFormatOpt = DEFAULT_LOG_FORMAT,
    *,
    endpoint: RegistryEndpoint,
) -> None:
    """Register this node, keep its session, and link its engine to the registry."""
    if not engine_url.startswith(("http://", "https://")):
        fail(f"--engine-url {engine_url!r} is not an http(s) URL", 2)
    from kvbroker.sidecar.server import serve_forever as serve_sidecar

    node_id = node_id or f"{socket.gethostname()}-{role.value}"
    listen = listen or f"unix:/tmp/kvbroker-{node_id}.sock"
    if not listen.startswith("unix:"):
        try:
            ensure_free(listen)
        except OSError as error:
            fail(f"cannot serve the sidecar on {listen}: {error}")
    apply_logging_flags(log_level, log_format)
    config = SidecarConfig(
        node_id=node_id,
        role=cast("node_pb2.NodeRole", _NODE_ROLES[role.value]),
        engine_url=engine_url,
        model=model,
        advertise_url=advertise_url,
        prefix_caching=prefix_caching,
        gateway_endpoint=gateway_endpoint,
        dynamo_worker_id=dynamo_worker_id,
        kubernetes_pod=kubernetes_pod,
    )
    if (metrics_tls_cert is None) != (metrics_tls_key is None):
        fail("--metrics-tls-cert and --metrics-tls-key go together", 2)
    if metrics_tls_client_ca is not None and metrics_tls_cert is None:
        fail("--metrics-tls-client-ca needs --metrics-tls-cert and --metrics-tls-key", 2)
    metrics_tls = (
        MetricsTls(metrics_tls_cert, metrics_tls_key, metrics_tls_client_ca)
        if metrics_tls_cert is not None and metrics_tls_key is not None
        else None
    )
    try:
        uvloop.run(serve_sidecar(config, endpoint, listen, metrics_listen, metrics_tls))
    except TlsFileError as error:
        fail(str(error), 2)
    except OSError as error:
        fail(f"cannot serve the sidecar on {listen}: {error}")
