"""The Prometheus endpoint of a registry or a sidecar: plain HTTP, or HTTPS with a certificate
(and with a client CA, only scrapers presenting a certificate it signed may read it).

Not prometheus_client's own ``start_http_server`` over TLS: it wraps the listening socket, so
every TLS handshake runs inside ``accept`` on the one accepting thread, and a client that
connects and never sends its ClientHello stops every scrape. Here the listening socket stays
plain and each connection does its handshake on its own thread, within HANDSHAKE_TIMEOUT_S."""

from __future__ import annotations

import socket
import ssl
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

from kvbroker.common.process.tls_files import load_tls_context

# How long a connection may take to finish its TLS handshake, and then to send its request:
# a scraper on a working network needs milliseconds; a silent client is dropped after this.
HANDSHAKE_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class MetricsTls:
    cert: Path
    key: Path
    # When set, a scraper must present a client certificate signed by this CA.
    client_ca: Path | None = None


class _QuietHandler(WSGIRequestHandler):
    """No access log on stderr; a request not sent within the timeout ends its connection."""

    timeout = HANDSHAKE_TIMEOUT_S

    def log_message(self, format: str, *args: Any) -> None:
        """Scrapes are not logged."""


class _MetricsServer(ThreadingWSGIServer):
    """One thread per connection (ThreadingWSGIServer); over TLS, that thread does the
    handshake, so a slow or silent client holds only its own connection."""

    tls: ssl.SSLContext | None = None

    def finish_request(self, request: Any, client_address: Any) -> None:
        if self.tls is None:
            super().finish_request(request, client_address)
            return
        request.settimeout(HANDSHAKE_TIMEOUT_S)
        try:
            secured = self.tls.wrap_socket(request, server_side=True)
        except (OSError, ValueError):
            # A silent client, garbage instead of a ClientHello, a refused client
            # certificate: that connection ends, nothing else notices.
            return
        with secured:
            super().finish_request(secured, client_address)


def serve_metrics(listen: str, registry: CollectorRegistry, tls: MetricsTls | None) -> str:
    """Starts the endpoint on ``listen`` (HOST:PORT, port 0: any) in a thread; returns the
    address it listens on. A TLS file that is wrong raises TlsFileError naming it."""
    host, _, port = listen.rpartition(":")
    context = None
    if tls is not None:
        context = load_tls_context(tls.cert, tls.key, tls.client_ca, server=True)
        if tls.client_ca is not None:
            context.verify_mode = ssl.CERT_REQUIRED
    # The address family of the host (prometheus_client's own server does the same).
    infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, _, _, _, sockaddr = infos[0]

    class Server(_MetricsServer):
        address_family = family

    httpd = make_server(str(sockaddr[0]), int(port), make_wsgi_app(registry), Server, _QuietHandler)
    httpd.tls = context
    threading.Thread(target=httpd.serve_forever, name="metrics-http", daemon=True).start()
    return f"{host}:{httpd.server_port}"
