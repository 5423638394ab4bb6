"""The Prometheus endpoint of a registry or a sidecar: plain HTTP, or HTTPS with a certificate
(and with a client CA, only scrapers presenting a certificate it signed may read it)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from prometheus_client import CollectorRegistry, start_http_server


@dataclass(frozen=True)
class MetricsTls:
    cert: Path
    key: Path
    # When set, a scraper must present a client certificate signed by this CA.
    client_ca: Path | None = None


def serve_metrics(listen: str, registry: CollectorRegistry, tls: MetricsTls | None) -> str:
    """Starts the endpoint on ``listen`` (HOST:PORT, port 0: any) in a thread; returns the
    address it listens on."""
    host, _, port = listen.rpartition(":")
    server, _thread = start_http_server(
        int(port),
        addr=host,
        registry=registry,
        certfile=str(tls.cert) if tls else None,
        keyfile=str(tls.key) if tls else None,
        client_cafile=str(tls.client_ca) if tls and tls.client_ca else None,
        client_auth_required=bool(tls and tls.client_ca),
    )
    return f"{host}:{server.server_port}"
