"""The router's HTTP face: the endpoints over one ``Router`` (the turn routes of every API it
serves, with their legs and streaming: chat completions, completions, Anthropic's Messages and
OpenAI's Responses; Messages' token count; models, health, metrics), with the placement route
(``router.placement``) and the session routes (``router.sessions``), each guarded so that a
bug answers a typed 500 in the route's API's error shape and keeps the connection.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
import structlog
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kvbroker.common.client.grpc_client import RegistryCallError
from kvbroker.common.rules import routing
from kvbroker.common.rules.handles import (
    CONTENT_READ_KEY,
    content_read_tokens,
    decided_params,
    decode_local_params,
)
from kvbroker.common.rules.sessionless import new_session_id
from kvbroker.router import placement, sessions
from kvbroker.router.auth import Authenticate, Tenant, tenant_of
from kvbroker.router.errors import (
    UPSTREAM_ANSWER,
    ApiError,
    ErrorCode,
    ErrorShape,
    ErrorType,
    UpstreamError,
    engine_answer,
    internal_error,
    leg_failed,
    log_answer,
    registry_refusal,
    upstream_failed,
)
from kvbroker.router.proxy import (
    JSON_HEADERS,
    ModelNotFound,
    Plan,
    RegistryDown,
    Router,
)
from kvbroker.router.relay import relay, without_handle
from kvbroker.router.requests import (
    APIS,
    MESSAGES,
    PATH_HEADER,
    Api,
    Required,
    Turn,
    check_required,
    encode,
    error_shape,
    parse_object,
    parse_turn,
    read_body,
)
from kvbroker.v1 import node_pb2

log = structlog.get_logger("kvbroker.router")

Endpoint = Callable[[Request], Awaitable[Response]]

# The session id the router named a sessionless turn by (``RouterConfig.retain_sessionless``).
SESSION_ID_HEADER = "x-kvbroker-session-id"
# On a turn the registry planned as new (a fork, a sessionless turn; x-kvbroker-decision MISS)
# whose prefill engine still found retained KV by content and read it: how many tokens.
READ_BY_CONTENT_HEADER = "x-kvbroker-read-by-content"


def _guarded(endpoint: Endpoint, shape: ErrorShape = ErrorShape.OPENAI) -> Endpoint:
    """Answers an ``ApiError`` raised anywhere under the endpoint in ``shape``, and anything
    else (a bug) with a logged traceback and a typed 500, instead of Starlette's plain-text 500
    that also drops the client's keep-alive connection."""

    @functools.wraps(endpoint)
    async def guarded(request: Request) -> Response:
        path = request.url.path
        try:
            return await endpoint(request)
        except ApiError as error:
            return error.answer(path, shape)
        except UpstreamError as error:
            log_answer(
                path, error.status, UPSTREAM_ANSWER, error.body[:200].decode(errors="replace")
            )
            return error.response(shape)
        except ClientDisconnect:
            log_answer(path, 400, "client_disconnected", "the client went away mid-request")
            return Response(status_code=400)  # nobody is left to read an answer
        except Exception:
            log.exception("router_bug", path=path)  # the one log of this answer
            return internal_error().response(shape)

    return guarded


async def _http_exception(request: Request, error: Exception) -> Response:
    """Starlette's own refusals (no such route, wrong method) in the shape of the API the
    path is under."""
    assert isinstance(error, HTTPException)
    codes = {404: ErrorCode.NOT_FOUND, 405: ErrorCode.METHOD_NOT_ALLOWED}
    api_error = ApiError(
        error.status_code,
        error.detail,
        ErrorType.INVALID_REQUEST,
        codes.get(error.status_code, ErrorCode.INVALID_VALUE),
        headers=dict(error.headers or {}),
    )
    return api_error.answer(request.url.path, error_shape(request.url.path))


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

    async def turn(self, api: Api, request: Request) -> Response:
        """A turn of ``api``: planned, then its legs to the engines' own endpoint of the same
        API, each with ``kv_transfer_params``."""
        started = time.perf_counter()
        tenant = tenant_of(request)
        turn = _scoped(
            tenant, parse_turn(await self._body(request), request.headers, api, tenant.id_limit)
        )
        named = ""
        if not turn.conversation and self.config.retain_sessionless:
            named = new_session_id()
            turn = dataclasses.replace(turn, conversation=tenant.conversation(named))
        plan = await self._plan(turn)
        self.metrics.hints.labels(plan.decision, plan.consistency).inc()
        hint_done = time.perf_counter()
        self.metrics.overhead_seconds.observe(hint_done - started)

        prefill_node: node_pb2.NodeSpec | None = None
        if plan.path == "DECODE_LOCAL":
            # The holder computes the new suffix against its own cache: no prefill leg.
            kv_params: Any = decode_local_params()
        else:
            prefill_node, kv_params = await self._prefill_with_fallback(plan, turn)
        prefill_done = time.perf_counter()
        if prefill_node is not None:
            self.metrics.prefill_seconds.observe(prefill_done - hint_done)
        # A turn planned as new whose prefill engine found and read retained KV by content
        # (a fork, a sessionless turn): said in the answer, and of no use to the decode leg.
        read_by_content = content_read_tokens(kv_params)
        if isinstance(kv_params, dict):
            kv_params.pop(CONTENT_READ_KEY, None)

        log.info(
            "routed",
            api=api.name,
            conversation=turn.conversation or None,
            decision=plan.decision,
            consistency=plan.consistency,
            reason=plan.reason,
            path=plan.path,
            prefill=prefill_node.node_id if prefill_node is not None else None,
            decode=plan.decode.node_id,
            prefill_ms=round(1000 * (prefill_done - hint_done), 1),
            read_by_content=read_by_content or None,
        )
        headers = {
            "x-kvbroker-decision": plan.decision,
            "x-kvbroker-consistency": plan.consistency,
            PATH_HEADER: plan.path,
            "x-kvbroker-prefill-ms": f"{1000 * (prefill_done - hint_done):.1f}",
            # Where the turn ran, as the placement pins name nodes: what an operator (or a
            # test) reads to see where a conversation was placed.
            "x-kvbroker-decode": plan.decode.node_id,
        }
        if prefill_node is not None:
            headers["x-kvbroker-prefill"] = prefill_node.node_id
        if read_by_content:
            headers[READ_BY_CONTENT_HEADER] = str(read_by_content)
        if named:
            # The id the router named the turn by: a client that sends it as its session id
            # continues this conversation by id.
            headers[SESSION_ID_HEADER] = named
        leg = self.router.http.build_request(
            "POST",
            plan.decode.http_base_url + api.path,
            content=encode(turn.decode_leg(kv_params)),
            headers=JSON_HEADERS,
        )
        try:
            if turn.stream:
                return await self._stream(leg, plan.decode, headers, started, prefill_done, api)
            response = await self.router.http.send(leg)
            answer = engine_answer(response, "decode", plan.decode)
        except httpx.HTTPError as error:
            raise leg_failed("decode", plan.decode, error) from error
        done = time.perf_counter()
        self.metrics.decode_seconds.observe(done - prefill_done)
        self.metrics.ttft_seconds.labels(plan.path).observe(done - started)
        content = encode(answer) if without_handle(answer) else response.content
        return Response(
            content,
            response.status_code,
            media_type=response.headers.get("content-type", "application/json"),
            headers=headers,
        )

    async def _plan(self, turn: Turn) -> Plan:
        """The router's plan, or the registry's refusal as the client's answer."""
        try:
            return await self.router.plan(
                turn.conversation, turn.model, turn.text, turn.wanted_path
            )
        except ModelNotFound as error:
            raise _model_not_found(str(error)) from error
        except RegistryDown as error:
            raise ApiError(
                503,
                f"registry unreachable and no known node can serve the request: {error}",
                ErrorType.UNAVAILABLE,
                ErrorCode.REGISTRY_UNAVAILABLE,
            ) from error
        except RegistryCallError as error:
            raise registry_refusal(error) from error

    async def _prefill_with_fallback(
        self, plan: Plan, turn: Turn
    ) -> tuple[node_pb2.NodeSpec | None, Any]:
        """P's params; when P is unreachable, fails mid-answer or does not answer within
        ``prefill_timeout_s``, another ready P recomputes (no reuse), and with none left the
        decode node computes the prompt itself (no prefill node: None, and the plan's path
        becomes DECODE_LOCAL). Either way the turn is served while its decode node is."""
        try:
            leg = self.router.prefill(plan.prefill, turn, plan.lease)
            return plan.prefill, await leg
        except httpx.TransportError as error:
            failed, failure = plan.prefill, error
        except httpx.HTTPError as error:
            raise leg_failed("prefill", plan.prefill, error) from error
        fallback = self.router.other_prefill(failed.node_id, turn.model)
        log.warning(
            "prefill_node_failed",
            node=failed.node_id,
            error=repr(failure),
            retry=fallback.node_id if fallback is not None else f"decode {plan.decode.node_id}",
        )
        self.metrics.prefill_failovers.inc()
        if fallback is None:
            # A decode node that retains takes the turn as its own (its prefix cache, and
            # the turn retained for the next); one that does not computes it as any request.
            plan.path = "DECODE_LOCAL"
            return None, decode_local_params() if routing.retains_kv(
                plan.decode
            ) else decided_params()
        try:
            return fallback, await self.router.prefill(fallback, turn, None)
        except httpx.HTTPError as error:
            raise leg_failed("prefill", fallback, error) from error

    async def _stream(
        self,
        leg: httpx.Request,
        node: node_pb2.NodeSpec,
        headers: dict[str, str],
        started: float,
        prefill_done: float,
        api: Api,
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
            relay(self.router, response, first, chunks, node, prefill_done, api.errors),
            media_type=content_type,
            headers=headers,
        )

    async def count_tokens(self, request: Request) -> Response:
        """Messages' token count (Claude Code asks it before a turn), answered by a ready
        prefill engine of the model: no turn, so nothing to plan and nothing retained."""
        body = parse_object(await self._body(request))
        check_required(body, _MODEL)
        model: str = body["model"]
        node = self.router.other_prefill("", model)
        if node is None:
            if not await self.router.may_serve(model):
                raise _model_not_found(str(ModelNotFound(model)))
            raise ApiError(
                503,
                f"no ready node serves {model} now",
                ErrorType.UNAVAILABLE,
                ErrorCode.NO_READY_NODE,
            )
        try:
            response = await self.router.http.post(
                node.http_base_url + COUNT_TOKENS_PATH, content=encode(body), headers=JSON_HEADERS
            )
        except httpx.HTTPError as error:
            raise leg_failed("token count", node, error) from error
        engine_answer(response, "token count", node)  # raises unless a 200 with an object
        return Response(response.content, media_type="application/json")

    async def models(self, request: Request) -> Response:
        names = sorted({n.spec.model for n in self.router.known_nodes if n.spec.model})
        data = [{"id": name, "object": "model", "owned_by": "kvbroker"} for name in names]
        return JSONResponse({"object": "list", "data": data})

    async def health(self, request: Request) -> Response:
        """200 ``ok`` while the registry answers, having taken this router's hint calls as
        well as its node reads; 200 ``degraded`` while it does not but the last node list can
        still route plain P/D (a load balancer should keep this router: every other one is in
        the same place); 503 ``unavailable`` when neither, as every request would get a 503;
        503 ``misconfigured`` while the registry refuses this router's credential for any
        call it makes (a node's credential lists nodes but gets no hints)."""
        # What the router could route by were the registry away, in every answer.
        ready = {"ready_nodes": self.router.ready_nodes()}
        refused = self.router.registry_refused
        if refused is not None:
            # A configuration error: a rollout of it should stop here, not serve on quietly.
            refusal = f"refused this router's credential: {refused}"
            return JSONResponse({"status": "misconfigured", "registry": refusal, **ready}, 503)
        away = self.router.registry_away
        if self.router.registry_confirmed:
            return JSONResponse({"status": "ok", **ready})
        # Not ``ok`` on the node list alone: the registry must have taken a hint call too.
        why = f"unreachable: {away}" if away else "has not yet answered a hint call"
        detail = {"registry": why, **ready}
        if self.router.can_route_alone():
            serving = "plain P/D from the last known node list, without KV reuse"
            return JSONResponse({"status": "degraded", **detail, "serving": serving})
        return JSONResponse({"status": "unavailable", **detail}, 503)

    async def prometheus(self, request: Request) -> Response:
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)


# Messages' token count, on the router and on every engine.
COUNT_TOKENS_PATH = MESSAGES.path + "/count_tokens"
_MODEL = Required("model", (str,), "a string")


def _model_not_found(message: str) -> ApiError:
    return ApiError(404, message, ErrorType.INVALID_REQUEST, ErrorCode.MODEL_NOT_FOUND, "model")


def _scoped(tenant: Tenant, turn: Turn) -> Turn:
    """The turn with its session id scoped to ``tenant``, as the registry and both legs see it
    (each leg carries the turn's conversation, ``Turn.prefill_leg`` and ``Turn.decode_leg``,
    and the decode engine reports its retention under it)."""
    conversation = tenant.conversation(turn.conversation)
    if conversation == turn.conversation:
        return turn
    return dataclasses.replace(turn, conversation=conversation)


def build_app(router: Router) -> Starlette:
    handlers = Handlers(router)
    return Starlette(
        routes=[
            *(
                Route(
                    path,
                    _guarded(functools.partial(handlers.turn, api), api.errors),
                    methods=["POST"],
                )
                for path, api in APIS.items()
            ),
            Route(
                COUNT_TOKENS_PATH,
                _guarded(handlers.count_tokens, MESSAGES.errors),
                methods=["POST"],
            ),
            Route("/v1/models", _guarded(handlers.models), methods=["GET"]),
            Route("/health", _guarded(handlers.health), methods=["GET"]),
            Route("/metrics", _guarded(handlers.prometheus), methods=["GET"]),
            Route(
                "/v1/placement",
                _guarded(functools.partial(placement.endpoint, router)),
                methods=["GET"],
            ),
            # A session id is the client's: whatever the completion routes take (``/`` too,
            # percent-encoded or not), so ``path``, not one segment. The greedy match leaves
            # the last ``/keepalive`` to the route: session "a/keepalive" is
            # /v1/sessions/a/keepalive/keepalive.
            Route(
                "/v1/sessions/{session_id:path}/keepalive",
                _guarded(functools.partial(sessions.keepalive, router)),
                methods=["POST"],
            ),
            Route(
                "/v1/sessions/{session_id:path}",
                _guarded(functools.partial(sessions.close, router)),
                methods=["DELETE"],
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
