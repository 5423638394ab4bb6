"""How a command reaches the registry: its address and credential flags checked once, one call
run with clear exits for bad addresses (2), refusals (1) and an unreachable registry (3)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import grpc

from kvbroker.cli.options import bearer_token
from kvbroker.cli.output import fail, fail_rpc
from kvbroker.common.grpc_client import RegistryEndpoint, open_channel, registry_stub

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
    try:
        return RegistryEndpoint.parse(
            registry, bearer_token(token, token_file), tls_ca, tls_client_cert, tls_client_key
        )
    except ValueError as error:
        fail(str(error), 2)


def call_registry(endpoint: RegistryEndpoint, rpc: Callable[[Any], Awaitable[T]]) -> T:
    """Runs one registry call with clear errors for unreachable servers and refusals."""

    async def run() -> T:
        async with open_channel(endpoint) as channel:
            return await rpc(registry_stub(channel))

    try:
        return asyncio.run(run())
    except grpc.aio.AioRpcError as error:
        fail_rpc(error, str(endpoint))
