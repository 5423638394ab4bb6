"""How a command reaches the registry: its address and credential flags declared and checked
once (``registry_flags``), one call run with clear exits for bad addresses (2), refusals (1)
and an unreachable registry (3)."""

from __future__ import annotations

import asyncio
import functools
import inspect
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import grpc

from kvbroker.cli.options import (
    RegistryOpt,
    TlsCaOpt,
    TlsClientCertOpt,
    TlsClientKeyOpt,
    TokenFileOpt,
    TokenOpt,
    bearer_token,
)
from kvbroker.cli.output import fail, fail_rpc
from kvbroker.common.client.grpc_client import (
    DEFAULT_REGISTRY_ADDRESS,
    RegistryEndpoint,
    open_channel,
    registry_stub,
)
from kvbroker.common.process.tls_files import TlsFileError, load_tls_context

T = TypeVar("T")


def registry_endpoint(
    registry: str,
    token: str | None,
    token_file: Path | None,
    tls_ca: Path | None,
    tls_client_cert: Path | None,
    tls_client_key: Path | None,
) -> RegistryEndpoint:
    """The endpoint the --registry, --token/--token-file, --tls-ca and
    --tls-client-cert/--tls-client-key flags name; exit 2 when they do not fit together."""
    if (tls_client_cert is None) != (tls_client_key is None):
        fail("--tls-client-cert and --tls-client-key go together", 2)
    if tls_client_cert is not None and tls_ca is None:
        fail("--tls-client-cert needs --tls-ca (the CA that signed the registry's certificate)", 2)
    if tls_client_cert is not None and tls_client_key is not None:
        try:
            # A key that is not the certificate's would fail every handshake, which reads
            # like an unreachable registry.
            load_tls_context(tls_client_cert, tls_client_key, server=False)
        except TlsFileError as error:
            fail(str(error), 2)
    try:
        return RegistryEndpoint.parse(
            registry, bearer_token(token, token_file), tls_ca, tls_client_cert, tls_client_key
        )
    except ValueError as error:
        fail(str(error), 2)


# The flags that name the registry and the caller's credentials, as ``registry_flags`` adds
# them to a command: (name, annotation, default).
_CONNECTION_FLAGS: tuple[tuple[str, Any, Any], ...] = (
    ("registry", RegistryOpt, DEFAULT_REGISTRY_ADDRESS),
    ("token", TokenOpt, None),
    ("token_file", TokenFileOpt, None),
    ("tls_ca", TlsCaOpt, None),
    ("tls_client_cert", TlsClientCertOpt, None),
    ("tls_client_key", TlsClientKeyOpt, None),
)


def registry_flags(command: Callable[..., T]) -> Callable[..., T]:
    """Gives a command the registry's flags (--registry, --token/--token-file, --tls-ca,
    --tls-client-cert/--tls-client-key) in place of its ``endpoint`` parameter, which it then
    receives checked (``registry_endpoint``). Every command that talks to the registry takes
    them, so they are declared once: typer reads the signature this sets."""
    signature = inspect.signature(command, eval_str=True)
    own = [p for p in signature.parameters.values() if p.name != "endpoint"]
    flags = [
        inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=hint)
        for name, hint, default in _CONNECTION_FLAGS
    ]

    @functools.wraps(command)
    def with_endpoint(*args: Any, **kwargs: Any) -> T:
        given = [kwargs.pop(name) for name, _, _ in _CONNECTION_FLAGS]
        return command(*args, endpoint=registry_endpoint(*given), **kwargs)

    # Keyword-only, so they may follow the command's own flags whatever those are.
    with_endpoint.__signature__ = signature.replace(  # type: ignore[attr-defined]
        parameters=[*own, *flags]
    )
    with_endpoint.__annotations__ = {p.name: p.annotation for p in (*own, *flags)} | {
        "return": signature.return_annotation
    }
    return with_endpoint


def call_registry(endpoint: RegistryEndpoint, rpc: Callable[[Any], Awaitable[T]]) -> T:
    """Runs one registry call with clear errors for unreachable servers and refusals."""

    async def run() -> T:
        async with open_channel(endpoint) as channel:
            return await rpc(registry_stub(channel))

    try:
        return asyncio.run(run())
    except grpc.aio.AioRpcError as error:
        fail_rpc(error, str(endpoint))
