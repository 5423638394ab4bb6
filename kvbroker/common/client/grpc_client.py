"""How every client (CLI, sidecar, router) opens a channel to the registry: one address or a
list to fail over between, optional TLS, optional bearer token, deadlines on every call; and
how a failed call is read back (``from_grpc_error``).

Each address goes to gRPC as it is: gRPC resolves a name itself, and again after a failure.
A list (``--registry a,b,c``: registry replicas) becomes a ``FailoverChannel``, one gRPC
channel per replica: a unary call goes to the replicas in the list's order, skipping those
that failed lately (``ReplicaHealth``), until one serves it (``replica_away`` says which
failures another replica may not share).

A failed call says why in a machine-readable reason (``registry_pb2.ErrorReason``) carried
as a serialised ``HintError`` in its trailing metadata, the record a batch of hints already
uses for each refused hint: one message and one decoder for both, a reason typed by the schema
(buf lints it, clients compare enum values), and no dependency beyond grpcio and protobuf
(``google.rpc.ErrorInfo`` in the status details would need googleapis-common-protos and
grpcio-status, and its reason is a free string).
"""

from __future__ import annotations

import asyncio
import ipaddress
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import structlog

from kvbroker.v1 import registry_pb2, registry_pb2_grpc

# Where a registry listens and its clients look for it, unless told otherwise.
DEFAULT_REGISTRY_ADDRESS = "127.0.0.1:7070"
AUTH_METADATA_KEY = "authorization"
# Trailing metadata of a failed call: its HintError (code, message, reason), serialised.
ERROR_METADATA_KEY = "kvbroker-error-bin"
# Trailing metadata of a routing hint: the address of the registry replica whose answer it is.
SERVED_BY_METADATA_KEY = "kvbroker-served-by"
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
    # name says who the caller is (see controlplane/api/identity.py).
    tls_cert: Path | None = None
    tls_key: Path | None = None
    # Which replicas failed lately, for every channel opened from this endpoint.
    health: ReplicaHealth = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "health", ReplicaHealth(self.addresses))

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
    """A channel to the registry: to its one address, or over its replicas (``FailoverChannel``)."""
    if len(endpoint.addresses) == 1:
        return _channel(endpoint, endpoint.addresses[0])
    channels = {address: _channel(endpoint, address) for address in endpoint.addresses}
    return FailoverChannel(channels, endpoint.health)


def _channel(endpoint: RegistryEndpoint, address: str) -> grpc.aio.Channel:
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
        return grpc.aio.secure_channel(address, creds, options=options, interceptors=interceptors)
    return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)


# Backoff of a replica that did not serve a call: tried again first after this long, doubled
# after each further failure, up to the cap (one probe per cap, never one per call).
REPLICA_BACKOFF_S = 1.0
REPLICA_BACKOFF_MAX_S = 8.0
AWAY_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
# Reasons a replica gives when it answers but cannot serve anything now.
NOT_SERVING = (registry_pb2.ERROR_REASON_NO_LEADER, registry_pb2.ERROR_REASON_STORE_UNAVAILABLE)


def replica_away(error: grpc.aio.AioRpcError) -> bool:
    """The replica asked did not serve the call, and another may: no answer reached the client
    (``UNAVAILABLE`` or ``DEADLINE_EXCEEDED`` without a reason: refused, reset, hung), or the
    replica answered that it cannot serve now (``NO_LEADER``, ``STORE_UNAVAILABLE``). Not
    ``NO_READY_NODE``: that is the registry's word on the nodes, the same from every replica."""
    failure = from_grpc_error(error)
    if failure.reason == registry_pb2.ERROR_REASON_UNSPECIFIED:
        return failure.code() in AWAY_CODES
    return failure.reason in NOT_SERVING


class ReplicaHealth:
    """Which replicas of a list failed lately, so that calls go to those that did not first.

    A replica that did not serve a call is tried first again only after a backoff (doubling,
    capped), so a replica that stays down costs one try per backoff, not one per call, and
    one that is back is used again, in the list's order, at its next try. Kept by the
    endpoint, so every channel opened from it (a sidecar opens one per session) knows it."""

    def __init__(self, addresses: Sequence[str]) -> None:
        self._addresses = list(addresses)
        self._failures = dict.fromkeys(self._addresses, 0)
        self._down_until = dict.fromkeys(self._addresses, 0.0)

    def order(self) -> list[str]:
        """The replicas to try, in turn: those not backed off in the list's order, then the
        others, soonest back first (a call still tries every replica before it fails)."""
        now = time.monotonic()
        up = [a for a in self._addresses if self._down_until[a] <= now]
        down = [a for a in self._addresses if self._down_until[a] > now]
        return up + sorted(down, key=self._down_until.__getitem__)

    def failed(self, address: str) -> None:
        now = time.monotonic()
        if self._down_until[address] > now:
            return  # a call that was already on its way: one failure per try
        self._failures[address] += 1
        backoff = min(REPLICA_BACKOFF_S * 2 ** (self._failures[address] - 1), REPLICA_BACKOFF_MAX_S)
        self._down_until[address] = now + backoff
        log.warning("registry_replica_skipped", address=address, for_s=backoff)

    def answered(self, address: str) -> None:
        if self._failures[address]:
            log.info("registry_replica_back", address=address)
        self._failures[address] = 0
        self._down_until[address] = 0.0


class _FailoverUnaryUnary:
    """A unary method over several replicas: the call goes to each in ``ReplicaHealth.order``
    until one serves it or its deadline has passed, then fails as the last one failed. Every
    retry is safe: a replica that answers "cannot serve" applied nothing; one that did not
    answer may have (a reset mid-call), and the registry takes a repeat as the same call (a
    grant is found by its engine request id, I14: duplicate reports are harmless). A call that
    ran out its deadline on a hung replica is not repeated: no time is left."""

    def __init__(self, methods: dict[str, Any], health: ReplicaHealth) -> None:
        self._methods = methods
        self._health = health

    def __call__(self, request: Any, *, timeout: float | None = None, **options: Any) -> Any:
        deadline = None if timeout is None else time.monotonic() + timeout
        return self._call(request, deadline, options)

    async def _call(self, request: Any, deadline: float | None, options: dict[str, Any]) -> Any:
        failure: grpc.aio.AioRpcError | None = None
        for address in self._health.order():
            left = None if deadline is None else deadline - time.monotonic()
            if failure is not None and left is not None and left <= 0:
                break
            try:
                response = await self._methods[address](request, timeout=left, **options)
            except grpc.aio.AioRpcError as error:
                if not replica_away(error):
                    raise
                self._health.failed(address)
                failure = error
                continue
            self._health.answered(address)
            return response
        assert failure is not None
        raise failure


class _FirstReplica:
    """A streaming method over several replicas: the stream goes to the first replica of
    ``ReplicaHealth.order`` (a stream cannot be replayed elsewhere; its caller's next session
    picks again, and the unary calls of that session mark a replica that fails)."""

    def __init__(self, methods: dict[str, Any], health: ReplicaHealth) -> None:
        self._methods = methods
        self._health = health

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._methods[self._health.order()[0]](*args, **kwargs)


class FailoverChannel(grpc.aio.Channel):  # type: ignore[misc]
    """A channel over a list of replicas, one gRPC channel to each, that a generated stub
    takes as it takes any channel: unary calls fail over (``_FailoverUnaryUnary``), streams go
    to the replica to try first. gRPC's own address list (pick_first) is not enough: it moves
    on only when a connection fails, never past a replica that is up and answers UNAVAILABLE
    (no leader), nor past one that is hung."""

    def __init__(self, channels: dict[str, grpc.aio.Channel], health: ReplicaHealth) -> None:
        self._channels = channels
        self._health = health

    async def __aenter__(self) -> FailoverChannel:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self, grace: float | None = None) -> None:
        await asyncio.gather(*(channel.close(grace) for channel in self._channels.values()))

    def _first(self) -> grpc.aio.Channel:
        return self._channels[self._health.order()[0]]

    def get_state(self, try_to_connect: bool = False) -> grpc.ChannelConnectivity:
        return self._first().get_state(try_to_connect)

    async def wait_for_state_change(self, last_observed_state: grpc.ChannelConnectivity) -> None:
        await self._first().wait_for_state_change(last_observed_state)

    async def channel_ready(self) -> None:
        await self._first().channel_ready()

    def _methods(self, kind: str, method: str, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return {
            address: getattr(channel, kind)(method, *args, **kwargs)
            for address, channel in self._channels.items()
        }

    def unary_unary(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return _FailoverUnaryUnary(
            self._methods("unary_unary", method, *args, **kwargs), self._health
        )

    def unary_stream(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return _FirstReplica(self._methods("unary_stream", method, *args, **kwargs), self._health)

    def stream_unary(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return _FirstReplica(self._methods("stream_unary", method, *args, **kwargs), self._health)

    def stream_stream(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return _FirstReplica(self._methods("stream_stream", method, *args, **kwargs), self._health)


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
