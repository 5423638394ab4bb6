"""The KV-aware, OpenAI-compatible proxy.

Stateless toward conversations: everything it knows about one comes from the registry, so any
number of replicas can serve alternate turns of the same conversation. Per request it asks
for a routing hint, sends the prefill leg (``max_tokens=1`` with the reuse handle) to the
chosen prefill node, then the decode leg (with P's params and the session id) to the chosen
decode node, and streams the answer back. The retention report comes from the decode engine
through its sidecar, never from the response, so streaming works.

If the registry gives no hint (unreachable, overloaded, failing: anything but its own word on
the request) the request is still served as plain P/D from the last known node list,
labelled DEGRADED in metrics and logs, and ``/health`` says ``degraded``.

Errors follow OpenAI's conventions (``router.errors``): 400 for a request that is not valid,
404 ``model_not_found`` for a model no node serves, 413 for a body over the limit, 502 for an
engine that failed or answered garbage, 503 when nothing can route the request, 504 for an
engine that timed out; an engine's own error answer passes through with its status. A 500 is
a bug in the router, logged with its traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import httpx
import structlog
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kvbroker.common import routing
from kvbroker.common.grpc_client import (
    RegistryCallError,
    RegistryEndpoint,
    open_channel,
    registry_stub,
)
from kvbroker.common.handles import decode_local_params, prefill_params
from kvbroker.common.hint_batcher import HintBatcher
from kvbroker.common.labels import label
from kvbroker.v1 import lease_pb2, node_pb2, registry_pb2
from router.auth import SCOPE_KEY, ApiKeys, Authenticate, Tenant
from router.config import RouterConfig
from router.errors import (
    ApiError,
    ErrorCode,
    ErrorType,
    invalid_request,
    upstream_failed,
)
from router.metrics import RouterMetrics
from router.prompt_size import PromptSize, PromptText
from router.requests import (
    PATH_HEADER,
    Completion,
    encode,
    parse_completion,
    parse_object,
    read_body,
    session_id,
)

log = structlog.get_logger("kvbroker.router")

# The registry's own word on a request, which the router passes on rather than route around:
# no ready node (waited for, or 404 for a model no node serves) and a request it refused (400).
# Any other failure to get a hint (the registry away, overloaded, failing) is served plain P/D.
_REGISTRY_ANSWERS = (
    registry_pb2.ERROR_REASON_NO_READY_NODE,
    registry_pb2.ERROR_REASON_INVALID_ARGUMENT,
)
# How often a request waiting for a ready node asks the registry again.
_READY_NODE_POLL_S = 0.1
_JSON = {"content-type": "application/json"}


class UpstreamError(Exception):
    """An engine's own error answer (a JSON object with a status other than 200): passed
    through as it is, since it speaks OpenAI's shape already (vLLM's validation errors)."""

    def __init__(self, status: int, body: bytes, content_type: str) -> None:
        super().__init__(f"upstream answered {status}")
        self.status, self.body, self.content_type = status, body, content_type

    def response(self) -> Response:
        return Response(self.body, self.status, media_type=self.content_type)


class RegistryDown(Exception):
    pass


class ModelNotFound(Exception):
    """No node the registry lists serves the model asked for."""

    def __init__(self, model: str) -> None:
        super().__init__(f"The model `{model}` does not exist.")
        self.model = model


@dataclass
class Plan:
    """One request's plan: where each leg goes and what the registry said."""

    prefill: node_pb2.NodeSpec
    decode: node_pb2.NodeSpec
    lease: lease_pb2.Lease | None
    decision: str
    consistency: str
    reason: str
    # How the turn gets its KV (``TurnPath`` label): with DECODE_LOCAL there is no prefill leg.
    path: str = "RECOMPUTE"


@dataclass
class Router:
    registry: RegistryEndpoint
    config: RouterConfig = field(default_factory=RouterConfig)
    metrics: RouterMetrics = field(default_factory=RouterMetrics)
    # The API keys clients must present, and their tenants (None: an open router).
    api_keys: ApiKeys | None = None

    def __post_init__(self) -> None:
        self.known_nodes: list[node_pb2.Node] = []
        # Why the registry could not be reached at the last call to it (None: it answered).
        self.registry_away: str | None = "not reached yet"
        self._turn = 0
        self.prompt_size = PromptSize()
        self._refresher: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Opens the clients on the serving event loop (grpc.aio binds to the loop)."""
        self._channel = open_channel(self.registry)
        self.stub = registry_stub(self._channel)
        # Concurrent turns share BatchGetRoutingHints calls; an idle router sends each alone.
        self.hints = HintBatcher(self.stub, self.config.hint_timeout_s)
        # The decode leg's timeouts are the client's; the prefill leg passes its own.
        self.http = httpx.AsyncClient(
            timeout=httpx.Timeout(
                self.config.decode_timeout_s, connect=self.config.connect_timeout_s
            )
        )
        self._prefill_timeout = httpx.Timeout(
            self.config.prefill_timeout_s, connect=self.config.connect_timeout_s
        )
        self._refresher = asyncio.create_task(self._refresh_nodes())

    async def close(self) -> None:
        if self._refresher is not None:
            self._refresher.cancel()
        await self.http.aclose()
        await self._channel.close()

    async def _refresh_nodes(self) -> None:
        while True:
            await self.refresh_nodes()
            await asyncio.sleep(self.config.node_refresh_s)

    async def refresh_nodes(self) -> None:
        """The registry's node list, for routing while it is away and for telling an unknown
        model; on failure the last list stays."""
        try:
            response = await self.stub.ListNodes(registry_pb2.ListNodesRequest(), timeout=2)
        except grpc.aio.AioRpcError as error:
            self.registry_away = error.details() or error.code().name
            return
        self.known_nodes = list(response.nodes)
        self.registry_away = None

    def can_route_alone(self) -> bool:
        """Whether the last node list has a ready prefill and decode node (of any model): what
        the router needs to serve plain P/D while the registry is away."""
        try:
            routing.candidates(map(routing.RoutedNode.of_node, self.known_nodes), "")
        except routing.NoReadyNode:
            return False
        return True

    # ------------------------------------------------------------ routing

    async def plan(
        self,
        conversation: str,
        model: str,
        text: PromptText | None = None,
        wanted: registry_pb2.TurnPath = registry_pb2.TURN_PATH_UNSPECIFIED,
    ) -> Plan:
        """The request's plan. While the registry has no ready node for the model, the request
        waits up to ``ready_node_wait_s`` for one: a node re-establishing its session after a
        registry failover, or an engine restarting, is a gap of a second or two that should
        delay requests, not fail them. A model no listed node serves is not waited for
        (``ModelNotFound``)."""
        deadline = time.monotonic() + self.config.ready_node_wait_s
        while True:
            try:
                return await self._plan_once(conversation, model, text, wanted)
            except RegistryCallError as error:
                if error.reason != registry_pb2.ERROR_REASON_NO_READY_NODE:
                    raise
                if not await self._may_serve(model):
                    raise ModelNotFound(model) from error
                if time.monotonic() + _READY_NODE_POLL_S > deadline:
                    raise
                self.metrics.ready_node_waits.inc()
            await asyncio.sleep(_READY_NODE_POLL_S)

    def _known_model(self, model: str) -> bool:
        """True unless the node list names nodes and none of them serves ``model``. The
        registry says only that no node is ready; a fleet with no nodes listed yet (starting)
        or with the model's nodes all down is not "no such model"."""
        return (
            not model
            or not self.known_nodes
            or any(node.spec.model == model for node in self.known_nodes)
        )

    async def _may_serve(self, model: str) -> bool:
        """``_known_model`` on a fresh list when the last one says no (its nodes may have
        registered since)."""
        if self._known_model(model):
            return True
        await self.refresh_nodes()
        return self._known_model(model)

    async def _plan_once(
        self,
        conversation: str,
        model: str,
        text: PromptText | None,
        wanted: registry_pb2.TurnPath,
    ) -> Plan:
        request = registry_pb2.GetRoutingHintRequest(
            conversation_id=conversation, model=model, path=wanted
        )
        if text is not None:
            request.prompt_tokens, request.new_tokens = self.prompt_size.estimate(text)
        try:
            # Queued behind a batch in flight, a hint may wait up to one more call.
            hint = await asyncio.wait_for(self.hints.hint(request), 2 * self.config.hint_timeout_s)
        except TimeoutError:
            return self._degraded_plan(model, "the registry did not answer in time")
        except RegistryCallError as error:
            if error.reason in _REGISTRY_ANSWERS:
                self.registry_away = None
                raise  # the registry answered: nowhere to send it, or a request at fault
            # Away (UNAVAILABLE, DEADLINE_EXCEEDED), overloaded (RESOURCE_EXHAUSTED), failing
            # (INTERNAL, UNKNOWN) or anything else: no hint, but the turn can still be served.
            why = f"{error.code().name}: {error.message}" if error.message else error.code().name
            return self._degraded_plan(model, why)
        self.registry_away = None
        return Plan(
            prefill=hint.prefill,
            decode=hint.decode,
            lease=hint.lease if hint.HasField("lease") else None,
            decision=label(registry_pb2.HintDecision, hint.decision),
            consistency=label(registry_pb2.HintConsistency, hint.consistency),
            reason=hint.reason,
            path=label(registry_pb2.TurnPath, hint.path) if hint.path else "READ",
        )

    def _degraded_plan(self, model: str, why: str) -> Plan:
        """Plain P/D by the registry's own routing rule, over the last node list it gave."""
        self.registry_away = why
        nodes = [routing.RoutedNode.of_node(n) for n in self.known_nodes]
        try:
            routes = routing.candidates(nodes, model)
        except routing.NoReadyNode as error:
            if not self._known_model(model):
                raise ModelNotFound(model) from error
            raise RegistryDown(why) from error
        self._turn += 1
        prefill, decode = routing.choose(routes, self._turn)
        return Plan(
            prefill=prefill.spec,
            decode=decode.spec,
            lease=None,
            decision="MISS",
            consistency="DEGRADED",
            reason=f"no hint from the registry ({why}): plain P/D without reuse",
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

    async def prefill(
        self,
        node: node_pb2.NodeSpec,
        path: str,
        completion: Completion,
        lease: lease_pb2.Lease | None,
    ) -> Any:
        """P's ``kv_transfer_params``. Raises ``httpx.HTTPError`` when P cannot be reached or
        does not answer within ``prefill_timeout_s``."""
        leg = dict(completion.body)
        leg.pop("stream", None)
        leg.pop("stream_options", None)
        leg["max_tokens"] = 1
        if "max_completion_tokens" in leg:
            leg["max_completion_tokens"] = 1
        leg["kv_transfer_params"] = prefill_params(lease)
        response = await self.http.post(
            node.http_base_url + path,
            content=encode(leg),
            headers=_JSON,
            timeout=self._prefill_timeout,
        )
        answer = engine_answer(response, "prefill", node)
        usage = answer.get("usage")
        if isinstance(usage, dict) and isinstance(usage.get("prompt_tokens"), int):
            self.prompt_size.learn(completion.text, usage["prompt_tokens"])
        return answer.get("kv_transfer_params")


def engine_answer(response: httpx.Response, leg: str, node: node_pb2.NodeSpec) -> dict[str, Any]:
    """An engine's answer, read: a JSON object when it is 200; its own error answer (a JSON
    object) as ``UpstreamError``; anything else, which no client could use, as a 502."""
    try:
        answer = json.loads(response.content)
    except ValueError:  # not JSON, or not text
        answer = None
    if not isinstance(answer, dict):
        raise upstream_failed(
            f"the {leg} node {node.node_id} answered {response.status_code} with a body that "
            "is not a JSON object",
            ErrorCode.UPSTREAM_INVALID_RESPONSE,
        )
    if response.status_code != 200:
        raise UpstreamError(
            response.status_code,
            response.content,
            response.headers.get("content-type", "application/json"),
        )
    return answer


def leg_failed(leg: str, node: node_pb2.NodeSpec, error: httpx.HTTPError) -> ApiError:
    """A leg that got no answer: 504 when the engine timed out, 502 when it could not be
    reached or its connection broke."""
    if isinstance(error, httpx.TimeoutException):
        code, what = ErrorCode.UPSTREAM_TIMEOUT, f"timed out ({type(error).__name__})"
    elif isinstance(error, httpx.ConnectError):
        code, what = ErrorCode.UPSTREAM_UNREACHABLE, f"is unreachable ({error})"
    else:
        code, what = ErrorCode.UPSTREAM_FAILED, f"failed ({error!r})"
    return upstream_failed(f"the {leg} node {node.node_id} {what}", code)


Endpoint = Callable[[Request], Awaitable[Response]]


def _guarded(endpoint: Endpoint) -> Endpoint:
    """Answers an ``ApiError`` raised anywhere under the endpoint, and anything else (a bug)
    with a logged traceback and a typed 500, instead of Starlette's plain-text 500 that also
    drops the client's keep-alive connection."""

    @functools.wraps(endpoint)
    async def guarded(request: Request) -> Response:
        try:
            return await endpoint(request)
        except ApiError as error:
            return error.response()
        except ClientDisconnect:
            return Response(status_code=400)  # nobody is left to read an answer
        except Exception:
            log.exception("router_bug", path=request.url.path)
            return _internal_error().response()

    return guarded


def _internal_error() -> ApiError:
    return ApiError(
        500,
        "the router failed on this request (a bug; it is logged)",
        ErrorType.SERVER,
        ErrorCode.INTERNAL_ERROR,
    )


async def _http_exception(request: Request, error: Exception) -> Response:
    """Starlette's own refusals (no such route, wrong method) in OpenAI's shape."""
    assert isinstance(error, HTTPException)
    codes = {404: ErrorCode.NOT_FOUND, 405: ErrorCode.METHOD_NOT_ALLOWED}
    api_error = ApiError(
        error.status_code,
        error.detail,
        ErrorType.INVALID_REQUEST,
        codes.get(error.status_code, ErrorCode.INVALID_VALUE),
    )
    return JSONResponse(api_error.body(), error.status_code, headers=error.headers)


class Handlers:
    """The HTTP endpoints, over one Router."""

    def __init__(self, router: Router) -> None:
        self.router = router
        self.config = router.config
        self.metrics = router.metrics

    async def _body(self, request: Request) -> bytes:
        return await read_body(
            request.stream(), request.headers.get("content-length"), self.config.max_body_bytes
        )

    async def completions(self, request: Request) -> Response:
        started = time.perf_counter()
        tenant = _tenant(request)
        completion = _scoped(
            tenant, parse_completion(await self._body(request), request.headers, tenant.id_limit)
        )
        plan = await self._plan(completion)
        self.metrics.hints.labels(plan.decision, plan.consistency).inc()
        hint_done = time.perf_counter()
        self.metrics.overhead_seconds.observe(hint_done - started)

        path = request.url.path
        prefill_node: node_pb2.NodeSpec | None = None
        if plan.path == "DECODE_LOCAL":
            # The holder computes the new suffix against its own cache: no prefill leg.
            kv_params: Any = decode_local_params()
        else:
            try:
                prefill_node, kv_params = await self._prefill_with_fallback(plan, path, completion)
            except UpstreamError as error:
                return error.response()
        prefill_done = time.perf_counter()
        if prefill_node is not None:
            self.metrics.prefill_seconds.observe(prefill_done - hint_done)

        decode_body = dict(completion.body)
        decode_body["kv_transfer_params"] = kv_params
        if completion.conversation:
            decode_body["session_id"] = completion.conversation
        log.info(
            "routed",
            conversation=completion.conversation or None,
            decision=plan.decision,
            consistency=plan.consistency,
            reason=plan.reason,
            path=plan.path,
            prefill=prefill_node.node_id if prefill_node is not None else None,
            decode=plan.decode.node_id,
            prefill_ms=round(1000 * (prefill_done - hint_done), 1),
        )
        headers = {
            "x-kvbroker-decision": plan.decision,
            "x-kvbroker-consistency": plan.consistency,
            PATH_HEADER: plan.path,
            "x-kvbroker-prefill-ms": f"{1000 * (prefill_done - hint_done):.1f}",
        }
        leg = self.router.http.build_request(
            "POST", plan.decode.http_base_url + path, content=encode(decode_body), headers=_JSON
        )
        try:
            if completion.stream:
                return await self._stream(leg, plan.decode, headers, started, prefill_done)
            response = await self.router.http.send(leg)
            engine_answer(response, "decode", plan.decode)
        except httpx.HTTPError as error:
            raise leg_failed("decode", plan.decode, error) from error
        except UpstreamError as error:
            return error.response()
        done = time.perf_counter()
        self.metrics.decode_seconds.observe(done - prefill_done)
        self.metrics.ttft_seconds.labels(plan.path).observe(done - started)
        return Response(
            response.content,
            response.status_code,
            media_type=response.headers.get("content-type", "application/json"),
            headers=headers,
        )

    async def _plan(self, completion: Completion) -> Plan:
        """The router's plan, or the registry's refusal as the client's answer."""
        try:
            return await self.router.plan(
                completion.conversation, completion.model, completion.text, completion.wanted_path
            )
        except ModelNotFound as error:
            raise ApiError(
                404, str(error), ErrorType.INVALID_REQUEST, ErrorCode.MODEL_NOT_FOUND, "model"
            ) from error
        except RegistryDown as error:
            raise ApiError(
                503,
                f"registry unreachable and no known node can serve the request: {error}",
                ErrorType.UNAVAILABLE,
                ErrorCode.REGISTRY_UNAVAILABLE,
            ) from error
        except RegistryCallError as error:
            if error.reason == registry_pb2.ERROR_REASON_INVALID_ARGUMENT:
                raise invalid_request(error.message, ErrorCode.INVALID_VALUE) from error
            code = (
                ErrorCode.NO_READY_NODE
                if error.reason == registry_pb2.ERROR_REASON_NO_READY_NODE
                else ErrorCode.REGISTRY_UNAVAILABLE
            )
            raise ApiError(503, error.message or "no route", ErrorType.UNAVAILABLE, code) from error

    async def _prefill_with_fallback(
        self, plan: Plan, path: str, completion: Completion
    ) -> tuple[node_pb2.NodeSpec, Any]:
        """P's params; when P is unreachable or does not answer within ``prefill_timeout_s``,
        another ready P recomputes (no reuse)."""
        try:
            leg = self.router.prefill(plan.prefill, path, completion, plan.lease)
            return plan.prefill, await leg
        except httpx.TransportError as error:
            fallback = self.router.other_prefill(plan.prefill.node_id, completion.model)
            if fallback is None:
                raise leg_failed("prefill", plan.prefill, error) from error
            log.warning(
                "prefill_node_failed",
                node=plan.prefill.node_id,
                error=repr(error),
                retry=fallback.node_id,
            )
            self.metrics.prefill_failovers.inc()
        except httpx.HTTPError as error:
            raise leg_failed("prefill", plan.prefill, error) from error
        try:
            return fallback, await self.router.prefill(fallback, path, completion, None)
        except httpx.HTTPError as error:
            raise leg_failed("prefill", fallback, error) from error

    async def _stream(
        self,
        leg: httpx.Request,
        node: node_pb2.NodeSpec,
        headers: dict[str, str],
        started: float,
        prefill_done: float,
    ) -> Response:
        """The decode leg streamed. Until its first chunk has arrived nothing is sent to the
        client, so a failure up to then gets its own status (an engine's error answer, 502,
        504); after it, the status line has gone and the stream ends with an error event
        instead (``_relay``)."""
        response = await self.router.http.send(leg, stream=True)
        try:
            if response.status_code != 200:
                await response.aread()
                engine_answer(response, "decode", node)  # raises: not a 200
            content_type = response.headers.get("content-type", "")
            if not content_type.startswith("text/event-stream"):
                raise upstream_failed(
                    f"the decode node {node.node_id} answered a stream with {content_type!r}",
                    ErrorCode.UPSTREAM_INVALID_RESPONSE,
                )
            chunks = response.aiter_raw()
            first = await anext(chunks, b"")
        except BaseException:
            await response.aclose()
            raise
        self.metrics.ttft_seconds.labels(headers[PATH_HEADER]).observe(
            time.perf_counter() - started
        )
        return StreamingResponse(
            _relay(self.router, response, first, chunks, node, prefill_done),
            media_type=content_type,
            headers=headers,
        )

    async def models(self, request: Request) -> Response:
        names = sorted({n.spec.model for n in self.router.known_nodes if n.spec.model})
        data = [{"id": name, "object": "model", "owned_by": "kvbroker"} for name in names]
        return JSONResponse({"object": "list", "data": data})

    async def health(self, request: Request) -> Response:
        """200 ``ok`` while the registry answers; 200 ``degraded`` while it does not but the
        last node list can still route plain P/D (a load balancer should keep this router:
        every other one is in the same place); 503 ``unavailable`` when neither, as every
        request would get a 503."""
        away = self.router.registry_away
        if away is None:
            return JSONResponse({"status": "ok"})
        detail = {"registry": f"unreachable: {away}"}
        if self.router.can_route_alone():
            serving = "plain P/D from the last known node list, without KV reuse"
            return JSONResponse({"status": "degraded", **detail, "serving": serving})
        return JSONResponse({"status": "unavailable", **detail}, 503)

    async def prometheus(self, request: Request) -> Response:
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def keepalive(self, request: Request) -> Response:
        """An agent busy in a long tool call keeps its conversation's KV retained."""
        tenant = _tenant(request)
        session = session_id(request.path_params["session_id"], limit=tenant.id_limit)
        raw = await self._body(request)
        payload = parse_object(raw) if raw else {}
        renew = registry_pb2.RenewLeaseRequest(conversation_id=tenant.conversation(session))
        ttl = payload.get("ttl_seconds")
        if ttl is not None:
            if isinstance(ttl, bool) or not isinstance(ttl, int | float) or ttl <= 0:
                raise invalid_request(
                    "ttl_seconds must be a positive number", ErrorCode.INVALID_VALUE, "ttl_seconds"
                )
            try:
                renew.time_to_live.FromNanoseconds(int(ttl * 1e9))
            except (ValueError, OverflowError):
                raise invalid_request(
                    "ttl_seconds is out of range", ErrorCode.INVALID_VALUE, "ttl_seconds"
                ) from None
        return await self._lease_call(self.router.stub.RenewLease(renew, timeout=2), session)

    async def close_session(self, request: Request) -> Response:
        """Explicit close: D frees the conversation's blocks at once."""
        tenant = _tenant(request)
        session = session_id(request.path_params["session_id"], limit=tenant.id_limit)
        revoke = registry_pb2.RevokeLeaseRequest(
            conversation_id=tenant.conversation(session), reason="session closed by client"
        )
        return await self._lease_call(self.router.stub.RevokeLease(revoke, timeout=2), session)

    @staticmethod
    async def _lease_call(call: Any, session: str) -> Response:
        try:
            lease = (await call).lease
        except grpc.aio.AioRpcError as error:
            status, code = _LEASE_CALL_ERRORS.get(
                error.code(), (503, ErrorCode.REGISTRY_UNAVAILABLE)
            )
            message = error.details() or error.code().name
            raise ApiError(status, message, ErrorType.SESSION, code) from error
        return JSONResponse(
            {
                "session_id": session,
                "lease_id": lease.lease_id,
                "epoch": lease.epoch,
                "state": label(lease_pb2.LeaseState, lease.state),
                "ttl_seconds": lease.time_to_live.ToNanoseconds() / 1e9,
            }
        )


def _tenant(request: Request) -> Tenant:
    """The request's tenant, named by ``Authenticate`` (a KeyError, so a 500, if the request
    did not pass through it: never served as anyone's)."""
    tenant = request.scope[SCOPE_KEY]
    assert isinstance(tenant, Tenant)
    return tenant


def _scoped(tenant: Tenant, completion: Completion) -> Completion:
    """The completion with its session id scoped to ``tenant``, as the registry and both legs
    see it (the decode engine reports its retention under the ``session_id`` it is given)."""
    conversation = tenant.conversation(completion.conversation)
    if conversation == completion.conversation:
        return completion
    body = dict(completion.body)
    if "session_id" in body:
        body["session_id"] = conversation
    return dataclasses.replace(completion, body=body, conversation=conversation)


_LEASE_CALL_ERRORS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, ErrorCode.INVALID_VALUE),
    grpc.StatusCode.NOT_FOUND: (404, ErrorCode.SESSION_NOT_FOUND),
    grpc.StatusCode.FAILED_PRECONDITION: (409, ErrorCode.SESSION_CONFLICT),
}


def build_app(router: Router) -> Starlette:
    handlers = Handlers(router)
    return Starlette(
        routes=[
            Route("/v1/chat/completions", _guarded(handlers.completions), methods=["POST"]),
            Route("/v1/completions", _guarded(handlers.completions), methods=["POST"]),
            Route("/v1/models", _guarded(handlers.models), methods=["GET"]),
            Route("/health", _guarded(handlers.health), methods=["GET"]),
            Route("/metrics", _guarded(handlers.prometheus), methods=["GET"]),
            Route(
                "/v1/sessions/{session_id}/keepalive",
                _guarded(handlers.keepalive),
                methods=["POST"],
            ),
            Route(
                "/v1/sessions/{session_id}", _guarded(handlers.close_session), methods=["DELETE"]
            ),
        ],
        middleware=[Middleware(Authenticate, keys=router.api_keys, metrics=router.metrics)],
        exception_handlers={HTTPException: _http_exception},
        lifespan=lambda app: _lifespan(router),
    )


@contextlib.asynccontextmanager
async def _lifespan(router: Router) -> AsyncIterator[None]:
    await router.start()
    try:
        yield
    finally:
        await router.close()


async def _relay(
    router: Router,
    response: httpx.Response,
    first: bytes,
    chunks: AsyncIterator[bytes],
    node: node_pb2.NodeSpec,
    prefill_done: float,
) -> AsyncIterator[bytes]:
    """The rest of a streamed decode leg. A failure now cannot change the status (200, sent
    with the first chunk): the stream ends with OpenAI's error object as an event, then
    ``[DONE]``, as vLLM ends a stream that failed."""
    last = first
    try:
        if first:
            yield first
        async for chunk in chunks:
            last = chunk
            yield chunk
        router.metrics.decode_seconds.observe(time.perf_counter() - prefill_done)
        return
    except httpx.HTTPError as error:
        failure = leg_failed("decode", node, error)
    except Exception:
        log.exception("router_bug", leg="decode stream")
        failure = _internal_error()
    finally:
        await response.aclose()
    # A chunk cut short would swallow the event: end it first.
    separator = b"" if last.endswith(b"\n\n") else b"\n\n"
    yield separator + failure.sse() + b"data: [DONE]\n\n"
