"""How every client (CLI, sidecar, router) opens a channel to the registry: one address or a
list to fail over between, optional TLS, optional bearer token, deadlines on every call; and
how a failed call is read back (``from_grpc_error``).

One address goes to gRPC as it is: gRPC resolves a name itself, and again after a failure. A
list becomes one static target, and gRPC's static targets (``ipv4:``, ``ipv6:``) take literal
addresses only, so the names in a list are resolved when the channel is opened; a name that
does not resolve then (a replica gone, its DNS record with it) is left out of that channel.

A failed call says why in a machine-readable reason (``registry_pb2.ErrorReason``) carried
as a serialised ``HintError`` in its trailing metadata, the record a batch of hints already
uses for each refused hint: one message and one decoder for both, a reason typed by the schema
(buf lints it, clients compare enum values), and no dependency beyond grpcio and protobuf
(``google.rpc.ErrorInfo`` in the status details would need googleapis-common-protos and
grpcio-status, and its reason is a free string).
"""

from __future__ import annotations

import ipaddress
import re
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
import structlog

from kvbroker.v1 import registry_pb2, registry_pb2_grpc

# Where a registry listens and its clients look for it, unless told otherwise.
DEFAULT_REGISTRY_ADDRESS = "127.0.0.1:7070"
AUTH_METADATA_KEY = "authorization"
# Trailing metadata of a failed call: its HintError (code, message, reason), serialised.
ERROR_METADATA_KEY = "kvbroker-error-bin"
_STATUS_BY_CODE = {status.value[0]: status for status in grpc.StatusCode}
# A DNS name: dot-separated labels of letters, digits, '-' and '_', no label starting or
# ending with '-' (RFC 1123, with the underscore some internal names use).
_NAME = re.compile(r"(?!-)[A-Za-z0-9_-]{1,63}(?<!-)(\.(?!-)[A-Za-z0-9_-]{1,63}(?<!-))*\.?")

log = structlog.get_logger("kvbroker.grpc_client")


@dataclass(frozen=True)
class RegistryEndpoint:
    """Where the registry is and how to authenticate to it."""

    addresses: Sequence[str]
    token: str | None = None
    tls_ca: Path | None = None
    # A client certificate and its key, for a registry that requires one (mTLS): its common
    # name says who the caller is (see controlplane/identity.py).
    tls_cert: Path | None = None
    tls_key: Path | None = None

    @classmethod
    def parse(
        cls,
        spec: str,
        token: str | None = None,
        tls_ca: Path | None = None,
        tls_cert: Path | None = None,
        tls_key: Path | None = None,
    ) -> RegistryEndpoint:
        """``HOST:PORT[,HOST:PORT...]``, each HOST a name, an IPv4 address or an IPv6 address
        in brackets; raises ValueError with a sentence on bad input."""
        if not spec.strip():
            raise ValueError("no registry address given (expected HOST:PORT)")
        addresses = [address.strip() for address in spec.split(",")]
        if "" in addresses:
            raise ValueError(f"registry list {spec!r} has an empty entry (expected HOST:PORT,...)")
        for address in addresses:
            _split(address)
        if (tls_cert is None) != (tls_key is None):
            raise ValueError("a client certificate and its key go together")
        if tls_cert is not None and tls_ca is None:
            raise ValueError("a client certificate needs the registry's CA (--tls-ca) too")
        return cls(addresses, token or None, tls_ca, tls_cert, tls_key)

    def at(self, address: str) -> RegistryEndpoint:
        """The same credentials, for another address (a replica forwarding to its leader)."""
        return RegistryEndpoint([address], self.token, self.tls_ca, self.tls_cert, self.tls_key)

    def __str__(self) -> str:
        return ",".join(self.addresses)

    def target(self) -> str:
        """The gRPC target of a channel opened now: one address as it is; several as a static
        list (gRPC tries them in order), their names resolved now (blocking: a name that
        takes the resolver long holds the caller as long)."""
        if len(self.addresses) == 1:
            return self.addresses[0]
        found = {address: _resolve(address) for address in self.addresses}
        # A static target holds one family: IPv4 whenever any entry has it (``localhost`` has
        # both), so in a list that mixes them an entry with IPv6 only is left out.
        family = socket.AF_INET
        if not any(socket.AF_INET in literals for literals in found.values()):
            family = socket.AF_INET6
        target: list[str] = []
        for address, by_family in found.items():
            if by_family and family not in by_family:
                log.warning("registry_address_left_out", address=address, reason="IPv6 only")
            target.extend(x for x in by_family.get(family, ()) if x not in target)
        if not target:
            # Nothing resolves now: gRPC resolves the first again on each call, and says why not.
            return self.addresses[0]
        return ("ipv4:" if family == socket.AF_INET else "ipv6:") + ",".join(target)


def _resolve(address: str) -> dict[int, list[str]]:
    """The literal addresses (``IP:PORT``, ``[IPv6]:PORT``) a checked address stands for now,
    by address family; none when its name does not resolve (said in a warning)."""
    host, port = _split(address)
    try:
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as error:
        log.warning("registry_address_unresolved", address=address, error=str(error))
        return {}
    by_family: dict[int, list[str]] = {}
    for family, _, _, _, sockaddr in found:
        if family == socket.AF_INET:
            by_family.setdefault(family, []).append(f"{sockaddr[0]}:{port}")
        elif family == socket.AF_INET6:
            by_family.setdefault(family, []).append(f"[{sockaddr[0]}]:{port}")
    return by_family


def _split(address: str) -> tuple[str, int]:
    """``HOST:PORT`` as the host to resolve (an IPv6 address without its brackets) and the
    port; ValueError when it is not one."""
    host, sep, port = address.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        literal = host[1:-1]
        valid_host = _is_ip(literal, ipaddress.IPv6Address)
        host = literal
    else:
        valid_host = _is_ip(host, ipaddress.IPv4Address) or _NAME.fullmatch(host) is not None
    if not (sep and valid_host and port.isdigit() and 0 < int(port) < 65536):
        raise ValueError(
            f"registry address {address!r} is not HOST:PORT (HOST a name, an IPv4 address or "
            "an IPv6 address in brackets; PORT 1-65535)"
        )
    return host, int(port)


def _is_ip(host: str, kind: type[ipaddress.IPv4Address | ipaddress.IPv6Address]) -> bool:
    try:
        kind(host)
    except ValueError:
        return False
    return True


class _BearerToken:
    """Adds ``authorization: Bearer TOKEN`` to a call, over TLS or plain loopback alike."""

    def __init__(self, token: str) -> None:
        self._metadata = (AUTH_METADATA_KEY, f"Bearer {token}")

    def _with_token(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*(details.metadata or ()))
        metadata.add(*self._metadata)
        return grpc.aio.ClientCallDetails(
            details.method, details.timeout, metadata, details.credentials, details.wait_for_ready
        )


# One interceptor per call type: a grpc.aio channel files each interceptor under the first
# call type it implements only, so one class implementing both left streams (the sidecar's
# WatchLeaseCommands) without the token.
class _UnaryUnaryToken(_BearerToken, grpc.aio.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    async def intercept_unary_unary(self, continuation, details, request):  # type: ignore[no-untyped-def]
        return await continuation(self._with_token(details), request)


class _UnaryStreamToken(_BearerToken, grpc.aio.UnaryStreamClientInterceptor):  # type: ignore[misc]
    async def intercept_unary_stream(self, continuation, details, request):  # type: ignore[no-untyped-def]
        return await continuation(self._with_token(details), request)


def open_channel(endpoint: RegistryEndpoint) -> grpc.aio.Channel:
    options = [
        ("grpc.enable_retries", 1),
        ("grpc.keepalive_time_ms", 10_000),
        # A registry that restarts is found again within two seconds, not gRPC's default
        # backoff of up to two minutes, during which every call fails at once.
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 2_000),
    ]
    interceptors = (
        [_UnaryUnaryToken(endpoint.token), _UnaryStreamToken(endpoint.token)]
        if endpoint.token
        else None
    )
    if endpoint.tls_ca is not None:
        creds = grpc.ssl_channel_credentials(
            root_certificates=endpoint.tls_ca.read_bytes(),
            private_key=endpoint.tls_key.read_bytes() if endpoint.tls_key else None,
            certificate_chain=endpoint.tls_cert.read_bytes() if endpoint.tls_cert else None,
        )
        return grpc.aio.secure_channel(
            endpoint.target(), creds, options=options, interceptors=interceptors
        )
    return grpc.aio.insecure_channel(endpoint.target(), options=options, interceptors=interceptors)


def registry_stub(channel: grpc.aio.Channel) -> registry_pb2_grpc.RegistryServiceStub:
    return registry_pb2_grpc.RegistryServiceStub(channel)


class RegistryCallError(grpc.aio.AioRpcError):  # type: ignore[misc]
    """A failed registry call with the reason it failed (UNSPECIFIED when none was given, as
    for a transport failure). Still an ``AioRpcError``: ``code()`` and ``details()`` work."""

    def __init__(
        self,
        code: grpc.StatusCode,
        message: str,
        reason: registry_pb2.ErrorReason = registry_pb2.ERROR_REASON_UNSPECIFIED,
        trailing_metadata: grpc.aio.Metadata | None = None,
    ) -> None:
        super().__init__(
            code, grpc.aio.Metadata(), trailing_metadata or grpc.aio.Metadata(), message
        )
        self.reason = reason

    @property
    def message(self) -> str:
        return str(self.details() or "")

    def status(self) -> registry_pb2.HintError:
        """The failure as the record the registry sends (to relay it unchanged)."""
        return registry_pb2.HintError(
            code=self.code().value[0], message=self.message, reason=self.reason
        )


def from_grpc_error(error: grpc.aio.AioRpcError | registry_pb2.HintError) -> RegistryCallError:
    """The typed error for a failed call, or for one refused hint of a batch."""
    if isinstance(error, RegistryCallError):
        return error
    if isinstance(error, registry_pb2.HintError):
        code = _STATUS_BY_CODE.get(error.code, grpc.StatusCode.UNKNOWN)
        return RegistryCallError(code, error.message, error.reason)
    trailing = error.trailing_metadata() or ()
    for key, value in trailing:
        if key == ERROR_METADATA_KEY and isinstance(value, bytes):
            status = registry_pb2.HintError.FromString(value)
            return RegistryCallError(error.code(), error.details() or "", status.reason, trailing)
    return RegistryCallError(error.code(), error.details() or "", trailing_metadata=trailing)
