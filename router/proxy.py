"""The KV-aware, OpenAI-compatible proxy.

Stateless toward conversations: everything it knows about one comes from the registry, so any
number of replicas can serve alternate turns of the same conversation. Per request it asks
for a routing hint, sends the prefill leg (``max_tokens=1`` with the reuse handle) to the
chosen prefill node, then the decode leg (with P's params and the session id) to the chosen
decode node, and streams the answer back. The retention report comes from the decode engine
through its sidecar, never from the response, so streaming works.

If the registry is unreachable the request is still served as plain P/D from the last known
node list, labelled DEGRADED in metrics and logs.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import httpx
import structlog
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kvbroker.common import routing
from kvbroker.common.grpc_client import (
    RegistryCallError,
    RegistryEndpoint,
    open_channel,
    registry_stub,
)
from kvbroker.common.handles import prefill_params
from kvbroker.common.hint_batcher import HintBatcher
from kvbroker.common.labels import label
from kvbroker.v1 import lease_pb2, node_pb2, registry_pb2
from router.config import RouterConfig
from router.metrics import RouterMetrics

log = structlog.get_logger("kvbroker.router")

SESSION_HEADER = "x-session-id"
# The registry is away (or cannot route for now) on these, unless it said no node is ready.
_REGISTRY_AWAY = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
# How often a request waiting for a ready node asks the registry again.
_READY_NODE_POLL_S = 0.1


class UpstreamError(Exception):
    def __init__(self, status: int, body: bytes, content_type: str) -> None:
        super().__init__(f"upstream answered {status}")
        self.status, self.body, self.content_type = status, body, content_type


@dataclass
class Plan:
    """One request's plan: where each leg goes and what the registry said."""

    prefill: node_pb2.NodeSpec
    decode: node_pb2.NodeSpec
    lease: lease_pb2.Lease | None
    decision: str
    consistency: str
    reason: str


@dataclass
class Router:
    registry: RegistryEndpoint
    config: RouterConfig = field(default_factory=RouterConfig)
    metrics: RouterMetrics = field(default_factory=RouterMetrics)

    def __post_init__(self) -> None:
        self.known_nodes: list[node_pb2.Node] = []
        self._turn = 0
        self._refresher: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Opens the clients on the serving event loop (grpc.aio binds to the loop)."""
        self._channel = open_channel(self.registry)
        self.stub = registry_stub(self._channel)
        # Concurrent turns share BatchGetRoutingHints calls; an idle router sends each alone.
        self.hints = HintBatcher(self.stub, self.config.hint_timeout_s)
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(self.config.upstream_timeout_s))
        self._refresher = asyncio.create_task(self._refresh_nodes())

    async def close(self) -> None:
        if self._refresher is not None:
            self._refresher.cancel()
        await self.http.aclose()
        await self._channel.close()

    async def _refresh_nodes(self) -> None:
        while True:
            try:
                response = await self.stub.ListNodes(registry_pb2.ListNodesRequest(), timeout=2)
                self.known_nodes = list(response.nodes)
            except grpc.aio.AioRpcError:
                pass  # keep the last list
            await asyncio.sleep(self.config.node_refresh_s)

    # ------------------------------------------------------------ routing

    async def plan(self, conversation: str, model: str) -> Plan:
        """The request's plan. While the registry has no ready node for the model, the request
        waits up to ``ready_node_wait_s`` for one: a node re-establishing its session after a
        registry failover, or an engine restarting, is a gap of a second or two that should
        delay requests, not fail them."""
        deadline = time.monotonic() + self.config.ready_node_wait_s
        while True:
            try:
                return await self._plan_once(conversation, model)
            except RegistryCallError as error:
                if error.reason != registry_pb2.ERROR_REASON_NO_READY_NODE:
                    raise
                if time.monotonic() + _READY_NODE_POLL_S > deadline:
                    raise
                self.metrics.ready_node_waits.inc()
            await asyncio.sleep(_READY_NODE_POLL_S)

    async def _plan_once(self, conversation: str, model: str) -> Plan:
        request = registry_pb2.GetRoutingHintRequest(conversation_id=conversation, model=model)
        try:
            # Queued behind a batch in flight, a hint may wait up to one more call.
            hint = await asyncio.wait_for(self.hints.hint(request), 2 * self.config.hint_timeout_s)
        except TimeoutError:
            return self._degraded_plan(model, "the registry did not answer in time")
        except RegistryCallError as error:
            if error.code() not in _REGISTRY_AWAY:
                raise
            if error.reason == registry_pb2.ERROR_REASON_NO_READY_NODE:
                raise  # the registry answered: there is nowhere to send the request
            return self._degraded_plan(model, error.message or error.code().name)
        return Plan(
            prefill=hint.prefill,
            decode=hint.decode,
            lease=hint.lease if hint.HasField("lease") else None,
            decision=label(registry_pb2.HintDecision, hint.decision),
            consistency=label(registry_pb2.HintConsistency, hint.consistency),
            reason=hint.reason,
        )

    def _degraded_plan(self, model: str, why: str) -> Plan:
        """Plain P/D by the registry's own routing rule, over the last node list it gave."""
        nodes = [routing.RoutedNode.of_node(n) for n in self.known_nodes]
        try:
            routes = routing.candidates(nodes, model)
        except routing.NoReadyNode as error:
            raise RegistryDown(why) from error
        self._turn += 1
        prefill, decode = routing.choose(routes, self._turn)
        return Plan(
            prefill=prefill.spec,
            decode=decode.spec,
            lease=None,
            decision="MISS",
            consistency="DEGRADED",
            reason=f"registry unreachable ({why}): plain P/D without reuse",
        )

    def other_prefill(self, failed: str, model: str) -> node_pb2.NodeSpec | None:
        """A ready prefill node other than ``failed``, by the registry's routing rule."""
        others = [
            routed
            for routed in map(routing.RoutedNode.of_node, self.known_nodes)
            if routed.prefills and routed.node_id != failed and routing.routable(routed, model)
        ]
        if not others:
            return None
        self._turn += 1
        return routing.pick(others, self._turn).spec

    # ------------------------------------------------------------ legs

    async def prefill(self, url: str, body: dict[str, Any], lease: lease_pb2.Lease | None) -> Any:
        leg = dict(body)
        leg.pop("stream", None)
        leg.pop("stream_options", None)
        leg["max_tokens"] = 1
        if "max_completion_tokens" in leg:
            leg["max_completion_tokens"] = 1
        leg["kv_transfer_params"] = prefill_params(lease)
        response = await self.http.post(url, json=leg)
        if response.status_code != 200:
            raise UpstreamError(
                response.status_code,
                response.content,
                response.headers.get("content-type", "application/json"),
            )
        return response.json().get("kv_transfer_params")


class RegistryDown(Exception):
    pass


def _conversation_id(request: Request, body: dict[str, Any]) -> str:
    for value in (
        body.get("session_id"),
        request.headers.get(SESSION_HEADER),
        body.get("conversation_id"),
    ):
        if isinstance(value, str) and value:
            return value
    return ""


def _error(status: int, message: str, kind: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status)


class Handlers:
    """The HTTP endpoints, over one Router."""

    def __init__(self, router: Router) -> None:
        self.router = router
        self.metrics = router.metrics

    async def completions(self, request: Request) -> Response:
        started = time.perf_counter()
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return _error(400, "the request body is not valid JSON", "invalid_request_error")
        if not isinstance(body, dict):
            return _error(400, "the request body must be a JSON object", "invalid_request_error")
        conversation = _conversation_id(request, body)
        body.pop("conversation_id", None)
        model = str(body.get("model") or "")
        try:
            plan = await self.router.plan(conversation, model)
        except RegistryDown as error:
            return _error(503, f"registry unreachable and no known nodes: {error}", "unavailable")
        except RegistryCallError as error:
            return _error(503, error.message or "no route", "unavailable")
        self.metrics.hints.labels(plan.decision, plan.consistency).inc()
        hint_done = time.perf_counter()
        self.metrics.overhead_seconds.observe(hint_done - started)

        path = request.url.path
        try:
            prefill_node, kv_params = await self._prefill_with_fallback(plan, path, body, model)
        except UpstreamError as error:
            return Response(error.body, error.status, media_type=error.content_type)
        except httpx.TransportError as error:
            message = f"prefill node {plan.prefill.node_id} unreachable: {error}"
            return _error(503, message, "unavailable")
        prefill_done = time.perf_counter()
        self.metrics.prefill_seconds.observe(prefill_done - hint_done)

        decode_body = dict(body)
        decode_body["kv_transfer_params"] = kv_params
        if conversation:
            decode_body["session_id"] = conversation
        log.info(
            "routed",
            conversation=conversation or None,
            decision=plan.decision,
            consistency=plan.consistency,
            reason=plan.reason,
            prefill=prefill_node.node_id,
            decode=plan.decode.node_id,
            prefill_ms=round(1000 * (prefill_done - hint_done), 1),
        )
        headers = {
            "x-kvbroker-decision": plan.decision,
            "x-kvbroker-consistency": plan.consistency,
            "x-kvbroker-prefill-ms": f"{1000 * (prefill_done - hint_done):.1f}",
        }
        decode_url = plan.decode.http_base_url + path
        if body.get("stream"):
            stream = _stream_decode(self.router, decode_url, decode_body, started, prefill_done)
            return StreamingResponse(stream, media_type="text/event-stream", headers=headers)
        try:
            response = await self.router.http.post(decode_url, json=decode_body)
        except httpx.TransportError as error:
            message = f"decode node {plan.decode.node_id} failed: {error}"
            return _error(502, message, "upstream_error")
        done = time.perf_counter()
        self.metrics.decode_seconds.observe(done - prefill_done)
        self.metrics.ttft_seconds.observe(done - started)
        return Response(
            response.content,
            response.status_code,
            media_type=response.headers.get("content-type", "application/json"),
            headers=headers,
        )

    async def _prefill_with_fallback(
        self, plan: Plan, path: str, body: dict[str, Any], model: str
    ) -> tuple[node_pb2.NodeSpec, Any]:
        """P's params; when P is unreachable, another ready P recomputes (no reuse)."""
        try:
            return plan.prefill, await self.router.prefill(
                plan.prefill.http_base_url + path, body, plan.lease
            )
        except httpx.TransportError:
            fallback = self.router.other_prefill(plan.prefill.node_id, model)
            if fallback is None:
                raise
            log.warning("prefill_node_failed", node=plan.prefill.node_id, retry=fallback.node_id)
            self.metrics.prefill_failovers.inc()
            return fallback, await self.router.prefill(fallback.http_base_url + path, body, None)

    async def models(self, request: Request) -> Response:
        names = sorted({n.spec.model for n in self.router.known_nodes if n.spec.model})
        data = [{"id": name, "object": "model", "owned_by": "kvbroker"} for name in names]
        return JSONResponse({"object": "list", "data": data})

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def prometheus(self, request: Request) -> Response:
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def keepalive(self, request: Request) -> Response:
        """An agent busy in a long tool call keeps its conversation's KV retained."""
        session = request.path_params["session_id"]
        payload: Any = {}
        if await request.body():
            try:
                payload = await request.json()
            except json.JSONDecodeError:
                return _error(400, "the request body is not valid JSON", "invalid_request_error")
        renew = registry_pb2.RenewLeaseRequest(conversation_id=session)
        ttl = payload.get("ttl_seconds") if isinstance(payload, dict) else None
        if ttl is not None:
            if not isinstance(ttl, int | float) or ttl <= 0:
                return _error(400, "ttl_seconds must be a positive number", "invalid_request_error")
            renew.time_to_live.FromNanoseconds(int(ttl * 1e9))
        return await self._lease_call(self.router.stub.RenewLease(renew, timeout=2), session)

    async def close_session(self, request: Request) -> Response:
        """Explicit close: D frees the conversation's blocks at once."""
        session = request.path_params["session_id"]
        revoke = registry_pb2.RevokeLeaseRequest(
            conversation_id=session, reason="session closed by client"
        )
        return await self._lease_call(self.router.stub.RevokeLease(revoke, timeout=2), session)

    @staticmethod
    async def _lease_call(call: Any, session: str) -> Response:
        try:
            lease = (await call).lease
        except grpc.aio.AioRpcError as error:
            status = {grpc.StatusCode.NOT_FOUND: 404, grpc.StatusCode.FAILED_PRECONDITION: 409}
            return _error(
                status.get(error.code(), 503), error.details() or error.code().name, "session_error"
            )
        return JSONResponse(
            {
                "session_id": session,
                "lease_id": lease.lease_id,
                "epoch": lease.epoch,
                "state": label(lease_pb2.LeaseState, lease.state),
                "ttl_seconds": lease.time_to_live.ToNanoseconds() / 1e9,
            }
        )


def build_app(router: Router) -> Starlette:
    handlers = Handlers(router)
    return Starlette(
        routes=[
            Route("/v1/chat/completions", handlers.completions, methods=["POST"]),
            Route("/v1/completions", handlers.completions, methods=["POST"]),
            Route("/v1/models", handlers.models, methods=["GET"]),
            Route("/health", handlers.health, methods=["GET"]),
            Route("/metrics", handlers.prometheus, methods=["GET"]),
            Route("/v1/sessions/{session_id}/keepalive", handlers.keepalive, methods=["POST"]),
            Route("/v1/sessions/{session_id}", handlers.close_session, methods=["DELETE"]),
        ],
        lifespan=lambda app: _lifespan(router),
    )


@contextlib.asynccontextmanager
async def _lifespan(router: Router) -> AsyncIterator[None]:
    await router.start()
    try:
        yield
    finally:
        await router.close()


async def _stream_decode(
    router: Router, url: str, body: dict[str, Any], started: float, prefill_done: float
) -> AsyncIterator[bytes]:
    first = True
    try:
        async with router.http.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                payload = await response.aread()
                yield b"data: " + payload + b"\n\n"
                return
            async for chunk in response.aiter_raw():
                if first:
                    router.metrics.ttft_seconds.observe(time.perf_counter() - started)
                    first = False
                yield chunk
        router.metrics.decode_seconds.observe(time.perf_counter() - prefill_done)
    except httpx.HTTPError as error:
        event = {
            "error": {
                "message": f"decode node failed mid-stream: {error}",
                "type": "upstream_error",
                "code": 502,
            }
        }
        yield b"data: " + json.dumps(event).encode() + b"\n\n"
