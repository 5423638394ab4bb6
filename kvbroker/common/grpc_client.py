"""How every client (CLI, sidecar, router) opens a channel to the registry: one address or a
list to fail over between, optional TLS, optional bearer token, deadlines on every call."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

from kvbroker.v1 import registry_pb2_grpc

AUTH_METADATA_KEY = "authorization"


@dataclass(frozen=True)
class RegistryEndpoint:
    """Where the registry is and how to authenticate to it."""

    addresses: Sequence[str]
    token: str | None = None
    tls_ca: Path | None = None

    @classmethod
    def parse(
        cls, spec: str, token: str | None = None, tls_ca: Path | None = None
    ) -> RegistryEndpoint:
        """``HOST:PORT[,HOST:PORT...]``; raises ValueError with a sentence on bad input."""
        addresses = [a.strip() for a in spec.split(",") if a.strip()]
        if not addresses:
            raise ValueError("no registry address given (expected HOST:PORT)")
        for address in addresses:
            host, sep, port = address.rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"registry address {address!r} is not HOST:PORT")
        return cls(addresses=addresses, token=token or None, tls_ca=tls_ca)

    @property
    def target(self) -> str:
        """A gRPC target; several addresses become a round-robin over static IPs."""
        if len(self.addresses) == 1:
            return self.addresses[0]
        return "ipv4:" + ",".join(self.addresses)


class _BearerTokenInterceptor(
    grpc.aio.UnaryUnaryClientInterceptor,  # type: ignore[misc]
    grpc.aio.UnaryStreamClientInterceptor,  # type: ignore[misc]
):
    """Adds ``authorization: Bearer TOKEN`` to every call, over TLS or plain loopback alike."""

    def __init__(self, token: str) -> None:
        self._metadata = (AUTH_METADATA_KEY, f"Bearer {token}")

    def _with_token(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*(details.metadata or ()))
        metadata.add(*self._metadata)
        return grpc.aio.ClientCallDetails(
            details.method, details.timeout, metadata, details.credentials, details.wait_for_ready
        )

    async def intercept_unary_unary(self, continuation, details, request):  # type: ignore[no-untyped-def]
        return await continuation(self._with_token(details), request)

    async def intercept_unary_stream(self, continuation, details, request):  # type: ignore[no-untyped-def]
        return await continuation(self._with_token(details), request)


def open_channel(endpoint: RegistryEndpoint) -> grpc.aio.Channel:
    options = [
        ("grpc.enable_retries", 1),
        ("grpc.keepalive_time_ms", 10_000),
    ]
    interceptors = [_BearerTokenInterceptor(endpoint.token)] if endpoint.token else None
    if endpoint.tls_ca is not None:
        creds = grpc.ssl_channel_credentials(root_certificates=endpoint.tls_ca.read_bytes())
        return grpc.aio.secure_channel(
            endpoint.target, creds, options=options, interceptors=interceptors
        )
    return grpc.aio.insecure_channel(endpoint.target, options=options, interceptors=interceptors)


def registry_stub(channel: grpc.aio.Channel) -> registry_pb2_grpc.RegistryServiceStub:
    return registry_pb2_grpc.RegistryServiceStub(channel)
