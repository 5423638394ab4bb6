"""How a command reaches the registry: its address flags checked once, one call run with clear
exits for bad addresses (2), refusals (1) and an unreachable registry (3)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import grpc

from kvbroker.cli.output import fail, fail_rpc
from kvbroker.common.grpc_client import RegistryEndpoint, open_channel, registry_stub

T = TypeVar("T")


def registry_endpoint(registry: str, token: str | None, tls_ca: Path | None) -> RegistryEndpoint:
    """The endpoint the --registry, --token and --tls-ca flags name; exit 2 when malformed."""
    try:
        return RegistryEndpoint.parse(registry, token, tls_ca)
    except ValueError as error:
        fail(str(error), 2)


def call_registry(
    registry: str,
    token: str | None,
    tls_ca: Path | None,
    rpc: Callable[[Any], Awaitable[T]],
) -> T:
    """Runs one registry call with clear errors for bad addresses and unreachable servers."""
    endpoint = registry_endpoint(registry, token, tls_ca)

    async def run() -> T:
        async with open_channel(endpoint) as channel:
            return await rpc(registry_stub(channel))

    try:
        return asyncio.run(run())
    except grpc.aio.AioRpcError as error:
        fail_rpc(error, registry)
