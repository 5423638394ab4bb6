"""Stand-ins for P/D routers fleets run, that do to requests exactly what the real ones do and
nothing of kvbroker's: the end-to-end tests and ``kvbroker bench multiturn --router`` put them
in front of kvbroker's engines in place of kvbroker's router.

- ``toy``: vLLM's example P/D proxy (``tests/v1/kv_connector/nixl_integration/
  toy_proxy_server.py`` in vLLM's repository; the installed package does not ship it): the
  client's body to P with ``max_tokens=1`` and an empty NIXL handle, P's
  ``kv_transfer_params`` into D's body, D's answer streamed back. It forwards the
  ``X-Session-ID`` header to both legs (the example sends only its own headers).
- ``llmd``: llm-d's decode-side routing sidecar (``pkg/sidecar/proxy/connector_nixlv2.go``):
  the same two legs, each a clone of the client's request, headers included.
- ``coordinator``: llm-d's coordinator ``conditional-decode`` step
  (``docs/communication.md``): the client's request to D first with ``Prefer: if-available``;
  on 412, the prefill leg and then D, as ``llmd`` does.

Each counts what it did (``ProxyStats``) so tests can tell a decode-first turn from a P/D one.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from kvbroker.common.process.ports import free_port
from kvbroker_tools.harness.engine import serving

ProxyKind = Literal["toy", "llmd", "coordinator"]
PROXY_KINDS: tuple[ProxyKind, ...] = ("toy", "llmd", "coordinator")

# Hop-by-hop and framing headers a proxy never copies from one request to another.
_NOT_CLONED = frozenset({"host", "content-length", "transfer-encoding", "connection"})


@dataclass
class ProxyStats:
    prefill_legs: int = 0
    decode_legs: int = 0
    # Conditional decode-first requests D served at once, and those it refused with 412.
    served_decode_first: int = 0
    refused_decode_first: int = 0
    # The x-kvbroker-* headers of each 412, in order.
    refusals: list[dict[str, str]] = field(default_factory=list)


class PdProxy:
    """One proxy of ``kind`` over prefill and decode engines (round-robin over each)."""

    def __init__(self, kind: ProxyKind, prefills: list[str], decodes: list[str]) -> None:
        self.kind = kind
        self.stats = ProxyStats()
        self._prefills = itertools.cycle(prefills)
        self._decodes = itertools.cycle(decodes)
        self._client = httpx.AsyncClient(timeout=120)
        self.app = Starlette(
            routes=[
                Route("/v1/chat/completions", self._completion, methods=["POST"]),
                Route("/v1/completions", self._completion, methods=["POST"]),
            ]
        )

    def _headers(self, request: Request) -> dict[str, str]:
        if self.kind == "toy":
            session = request.headers.get("x-session-id")
            return {"X-Session-ID": session} if session else {}
        return {k: v for k, v in request.headers.items() if k.lower() not in _NOT_CLONED}

    async def _completion(self, request: Request) -> Response:
        body: dict[str, Any] = await request.json()
        headers = self._headers(request)
        decode = next(self._decodes)
        if self.kind == "coordinator":
            first = await self._decode_first(decode, request.url.path, body, headers)
            if first is not None:
                return first
        prefill_body = {
            **body,
            "stream": False,
            "max_tokens": 1,
            "kv_transfer_params": {
                "do_remote_decode": True,
                "do_remote_prefill": False,
                "remote_engine_id": None,
                "remote_block_ids": None,
                "remote_host": None,
                "remote_port": None,
            },
        }
        prefill_body.pop("stream_options", None)
        if "max_completion_tokens" in prefill_body:
            prefill_body["max_completion_tokens"] = 1
        self.stats.prefill_legs += 1
        leg = await self._client.post(
            next(self._prefills) + request.url.path, json=prefill_body, headers=headers
        )
        if leg.status_code != 200:
            return Response(leg.content, leg.status_code, media_type="application/json")
        decode_body = dict(body)
        params = leg.json().get("kv_transfer_params")
        if params:
            decode_body["kv_transfer_params"] = params
        return await self._decode(decode, request.url.path, decode_body, headers)

    async def _decode_first(
        self, decode: str, path: str, body: dict[str, Any], headers: Mapping[str, str]
    ) -> Response | None:
        """The conditional decode leg: D's answer when it serves it, None on 412."""
        conditional = {**headers, "Prefer": "if-available"}
        self.stats.decode_legs += 1
        answer = await self._client.post(decode + path, json=body, headers=conditional)
        if answer.status_code == 412:
            self.stats.refused_decode_first += 1
            self.stats.refusals.append(
                {k: v for k, v in answer.headers.items() if k.startswith("x-kvbroker-")}
            )
            return None
        self.stats.served_decode_first += 1
        return Response(answer.content, answer.status_code, media_type="application/json")

    async def _decode(
        self, decode: str, path: str, body: dict[str, Any], headers: Mapping[str, str]
    ) -> Response:
        self.stats.decode_legs += 1
        if not body.get("stream"):
            answer = await self._client.post(decode + path, json=body, headers=headers)
            return Response(answer.content, answer.status_code, media_type="application/json")
        upstream = await self._client.send(
            self._client.build_request("POST", decode + path, json=body, headers=headers),
            stream=True,
        )

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in upstream.aiter_bytes():
                    yield chunk
            finally:
                await upstream.aclose()

        return StreamingResponse(relay(), upstream.status_code, media_type="text/event-stream")

    async def close(self) -> None:
        await self._client.aclose()


@contextlib.asynccontextmanager
async def running_proxy(
    kind: ProxyKind, prefills: list[str], decodes: list[str]
) -> AsyncIterator[tuple[str, PdProxy]]:
    """A proxy of ``kind`` served on loopback: its URL and the proxy (for its stats)."""
    proxy = PdProxy(kind, prefills, decodes)
    port = free_port()
    try:
        async with serving(proxy.app, port):
            yield f"http://127.0.0.1:{port}", proxy
    finally:
        await proxy.close()
