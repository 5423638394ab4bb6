"""Reuse behind any router: the engine resolves a conversation's handle itself.

kvbroker's router writes the lease's handle into each prefill leg's ``kv_transfer_params``.
The routers fleets already run (vLLM's example P/D proxy, ``vllm-router``, llm-d's decode
sidecar, Dynamo's frontend) know nothing of leases, but all of them forward the client's
session id (``X-Session-ID``, which vLLM reads into ``Request.session_id``). So this ASGI
middleware, loaded into vLLM's own API server::

    vllm serve ... --middleware kvbroker.engine_ext.session_reuse.SessionReuse

looks at each completion request before vLLM parses it, and for a request with a session id
and no kvbroker parameters asks its sidecar (``ResolveHandle``), which asks the registry for a
hint for a turn already placed on this node (``GetRoutingHintRequest.on_node_id``):

- a **prefill leg** (``do_remote_decode`` without a handle): READ gets the lease's handle,
  claimed for this node, merged into the parameters; the connector then fences and verifies
  it as it does every handle (``engine_ext.lease_check``). Otherwise the leg goes on as sent.
- a **turn on this node alone** (no transfer parameters): when this decode node holds the
  conversation's live lease, it is served as DECODE_LOCAL (its own cache, the retained tail
  copied); either way it is retained afterwards for the conversation's next turn, if the
  registry lets this node lease it.
- the same with ``Prefer: if-available`` (llm-d's coordinator, ``conditional-decode``): served
  only when the planner chooses DECODE_LOCAL on this node; otherwise answered at once with
  **412 Precondition Failed** and the hint in ``x-kvbroker-*`` headers, computing nothing.

A decode leg (``do_remote_prefill``) and anything kvbroker's router already prepared pass
untouched. The middleware runs in the API server's event loop, never on the engine's
scheduler thread; when the sidecar or registry cannot answer in time it fails open (the
request goes on as sent: no reuse), except a conditional request, which is refused (it has a
fallback and nothing was confirmed). The registry stays the one authority: it claims, fences
and plans exactly as for kvbroker's router.

Given the router's keys file (``kvbroker_api_keys``) or the tenants' session keys
(``kvbroker_session_keys``), the middleware takes no session id as given: it applies the tenant
rule (``kvbroker.common.rules.tenants.ScopedSessions``), so a request resolves only its own
tenant's conversation (its API key's, or its signed session id's) and anything else is served
as a plain turn; an API key the file does not hold is refused with 401.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from kvbroker.common.process.credentials import load_api_keys, load_session_keys
from kvbroker.common.rules import handles
from kvbroker.common.rules.prompt_size import PromptSize, PromptText
from kvbroker.common.rules.tenants import KeyRefused, ScopedSessions
from kvbroker.engine_ext import vllm_compat
from kvbroker.engine_ext.settings import KvBrokerSettings
from kvbroker.v1 import registry_pb2, sidecar_pb2, sidecar_pb2_grpc

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

log = vllm_compat.engine_logger("session_reuse")

COMPLETION_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})
SESSION_HEADER = b"x-session-id"
# Anthropic's header for an API key (its SDK and Claude Code send it).
API_KEY_HEADER = b"x-api-key"
# The longest request body read to look for a session: a larger one is refused with 413
# (passing on what was read would hand the engine a part of the body as if it were whole).
MAX_BODY_BYTES = 64 << 20

READ = registry_pb2.TURN_PATH_READ
DECODE_LOCAL = registry_pb2.TURN_PATH_DECODE_LOCAL
ASK_PLANNER = registry_pb2.TURN_PATH_UNSPECIFIED


@dataclass(frozen=True, slots=True)
class Turn:
    """What the middleware reads of a request: its session, what its transfer parameters say
    it is, and whether it is conditional (``Prefer: if-available``)."""

    session_id: str
    params: dict[str, Any] | None
    conditional: bool

    @property
    def prepared(self) -> bool:
        """kvbroker's router (or an earlier pass) already decided this turn."""
        return bool((self.params or {}).get(handles.DECIDED_KEY))

    @property
    def prefill_leg(self) -> bool:
        p = self.params or {}
        return bool(p.get("do_remote_decode") and not p.get("remote_block_ids"))

    @property
    def alone(self) -> bool:
        """No P/D transfer asked: the whole turn runs here."""
        p = self.params or {}
        return not (p.get("do_remote_decode") or p.get("do_remote_prefill"))


def read_turn(headers: list[tuple[bytes, bytes]], body: dict[str, Any]) -> Turn | None:
    """The turn a request body and its headers describe; None when there is nothing to
    resolve (no session id, or transfer parameters that are not an object)."""
    header = dict(headers)
    session = _session(body, header)
    params = body.get("kv_transfer_params")
    if not session or (params is not None and not isinstance(params, dict)):
        return None
    prefer = header.get(b"prefer", b"").decode("latin-1").lower()
    conditional = "if-available" in (token.strip() for token in prefer.split(","))
    return Turn(session, params, conditional)


def _session(body: dict[str, Any], headers: dict[bytes, bytes]) -> str:
    """The session id as vLLM reads it: the body's ``session_id``, the ``X-Session-ID``
    header, then ``vllm_xargs.session_id``."""
    xargs = body.get("vllm_xargs")
    for candidate in (
        body.get("session_id"),
        headers.get(SESSION_HEADER, b"").decode("latin-1"),
        xargs.get("session_id") if isinstance(xargs, dict) else None,
    ):
        if isinstance(candidate, str) and candidate.strip():
            return candidate.strip()
    return ""


def hint_headers(hint: registry_pb2.RoutingHint) -> list[tuple[bytes, bytes]]:
    """The hint as response headers: what a router needs to send the turn elsewhere."""
    out = [
        (b"x-kvbroker-decision", _name(registry_pb2.HintDecision, hint.decision)),
        (b"x-kvbroker-path", _name(registry_pb2.TurnPath, hint.path)),
    ]
    if hint.no_reuse:
        out.append((b"x-kvbroker-no-reuse", _name(registry_pb2.NoReuseReason, hint.no_reuse)))
    if hint.lease.lease_id:
        out.append((b"x-kvbroker-lease", f"{hint.lease.lease_id}:{hint.lease.epoch}".encode()))
        out.append((b"x-kvbroker-retained-tokens", str(hint.lease.token_count).encode()))
    if hint.prefill.node_id:
        out.append((b"x-kvbroker-prefill", hint.prefill.node_id.encode()))
        if hint.prefill.http_base_url:
            out.append((b"x-kvbroker-prefill-url", hint.prefill.http_base_url.encode()))
    return out


def _name(enum: Any, value: int) -> bytes:
    return str(enum.Name(value)).encode()


class SessionReuse:
    """The ASGI middleware (see the module docstring)."""

    def __init__(self, app: App) -> None:
        self.app = app
        self._sidecar: sidecar_pb2_grpc.SidecarServiceStub | None = None
        self._read_settings: KvBrokerSettings | None = None
        self._scoped_sessions: ScopedSessions | None = None
        self._timeout_s = KvBrokerSettings.lease_check_timeout_s
        self._sizes = PromptSize()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] != "http"
            or scope["method"] != "POST"
            or scope["path"] not in COMPLETION_PATHS
        ):
            await self.app(scope, receive, send)
            return
        raw, read = await _read_body(receive)
        if read is BodyRead.GONE:
            return  # the client went away: nobody is left to answer
        if read is BodyRead.TOO_LARGE:
            # Never passed on cut short (the engine would take a part for the whole).
            await _refuse(
                send,
                413,
                f"request body over {MAX_BODY_BYTES} bytes, the most kvbroker's session "
                "middleware reads",
                "request_too_large",
            )
            return
        body = _json_object(raw)
        turn = read_turn(scope["headers"], body) if body is not None else None
        # Whether the body was changed: it is encoded again once, when handed on (a large
        # body's encoding costs the API server's event loop, which serves every request).
        changed = False
        if turn is not None and body is not None and not turn.prepared:
            sessions = self._sessions(scope)
            if sessions is not None:
                try:
                    # "" (no key nor a verified signed id, or another tenant's): a plain turn.
                    conversation = sessions.conversation(
                        turn.session_id,
                        _header(scope, b"authorization"),
                        _header(scope, API_KEY_HEADER),
                    )
                except KeyRefused:
                    await _refuse(send, 401, "Incorrect API key provided.", "invalid_api_key")
                    return
                scope = _scoped(scope, body, conversation)
                changed = True
                turn = read_turn(scope["headers"], body)
        sidecar = self._stub(scope) if turn is not None and not turn.prepared else None
        resolvable = turn is not None and (turn.prefill_leg or turn.alone)
        if resolvable and turn is not None and body is not None and sidecar is not None:
            hint = await self._resolve(sidecar, turn, body)
            params = self._params(turn, hint)
            if turn.conditional and turn.alone and params is None:
                await _precondition_failed(send, hint)
                return
            if params is not None:
                body["kv_transfer_params"] = params
                changed = True
        if changed and body is not None:
            raw = json.dumps(body).encode()
            scope = _with_length(scope, len(raw))
        await self.app(scope, _replay(raw, receive), send)

    def _params(self, turn: Turn, hint: registry_pb2.RoutingHint | None) -> dict[str, Any] | None:
        """The transfer parameters the turn goes on with (None: as it was sent)."""
        if turn.prefill_leg:
            if hint is None or hint.path != READ or not hint.lease.lease_id:
                return None
            return {**(turn.params or {}), **handles.prefill_params(hint.lease)}
        if hint is None or (turn.conditional and hint.path != DECODE_LOCAL):
            return None  # not a decode node the registry knows, or not this node's turn
        # Served here either way: as DECODE_LOCAL it is retained for the next turn, and its
        # retained tail (if any) is copied, not recomputed.
        return handles.decode_local_params()

    async def _resolve(
        self, sidecar: sidecar_pb2_grpc.SidecarServiceStub, turn: Turn, body: dict[str, Any]
    ) -> registry_pb2.RoutingHint | None:
        text = PromptText.of(body)
        path = READ if turn.prefill_leg else ASK_PLANNER if turn.conditional else DECODE_LOCAL
        request = sidecar_pb2.ResolveHandleRequest(
            conversation_id=turn.session_id,
            prompt_tokens=self._sizes.tokens(text.chars, text.messages),
            path=path,
        )
        try:
            response: sidecar_pb2.ResolveHandleResponse = await sidecar.ResolveHandle(
                request, timeout=self._timeout_s
            )
        except grpc.aio.AioRpcError as error:
            log.info(
                "kvbroker: no handle resolved for session %r (%s: %s); the request goes on as sent",
                turn.session_id,
                error.code().name,
                error.details(),
            )
            return None
        return response.hint

    def _settings(self, scope: Scope) -> KvBrokerSettings | None:
        """The engine's own connector settings (None: it has no kvbroker connector)."""
        if self._read_settings is None:
            vllm_config = vllm_compat.app_vllm_config(scope.get("app"))
            if vllm_config is None or vllm_config.kv_transfer_config is None:
                return None
            self._read_settings = KvBrokerSettings.from_extra_config(
                vllm_compat.kv_connector_extra_config(vllm_config)
            )
        return self._read_settings

    def _sessions(self, scope: Scope) -> ScopedSessions | None:
        """The tenant rule, when the engine is given a keys file or a session keys file
        (None: an open door). A file it cannot read stops every session here rather than
        serving it open."""
        settings = self._settings(scope)
        if settings is None or not (settings.api_keys or settings.session_keys):
            return None
        if self._scoped_sessions is None:
            self._scoped_sessions = ScopedSessions(
                load_api_keys(Path(settings.api_keys)) if settings.api_keys else None,
                load_session_keys(Path(settings.session_keys)) if settings.session_keys else None,
            )
        return self._scoped_sessions

    def _stub(self, scope: Scope) -> sidecar_pb2_grpc.SidecarServiceStub | None:
        """The sidecar, from the engine's own connector settings (None: it has none)."""
        if self._sidecar is None:
            settings = self._settings(scope)
            if settings is None or not settings.sidecar:
                return None
            self._timeout_s = settings.lease_check_timeout_s
            channel = grpc.aio.insecure_channel(settings.sidecar)
            self._sidecar = sidecar_pb2_grpc.SidecarServiceStub(channel)
        return self._sidecar


class BodyRead(enum.Enum):
    """How reading a request body ended."""

    WHOLE = enum.auto()
    TOO_LARGE = enum.auto()  # over ``MAX_BODY_BYTES``
    GONE = enum.auto()  # the client went away first


async def _read_body(receive: Receive) -> tuple[bytes, BodyRead]:
    """The request body as far as it was read, and how reading it ended."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return b"".join(chunks), BodyRead.GONE
        chunk = message.get("body", b"")
        chunks.append(chunk)
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            return b"", BodyRead.TOO_LARGE
        if not message.get("more_body", False):
            return b"".join(chunks), BodyRead.WHOLE


def _replay(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that gives the app ``body`` first, then whatever the client sends on
    (a disconnect)."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed


def _json_object(raw: bytes) -> dict[str, Any] | None:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return None  # vLLM answers a malformed body itself
    return body if isinstance(body, dict) else None


def _header(scope: Scope, name: bytes) -> str | None:
    value = dict(scope["headers"]).get(name)
    return value.decode("latin-1") if value is not None else None


def _scoped(scope: Scope, body: dict[str, Any], conversation: str) -> Scope:
    """The request naming ``conversation`` as its session ("": none) wherever vLLM reads one
    (``_session``): the body's ``session_id`` set or removed, the header and ``vllm_xargs``'s
    removed. Returns the new scope; ``body`` is changed in place."""
    if conversation:
        body["session_id"] = conversation
    else:
        body.pop("session_id", None)
    xargs = body.get("vllm_xargs")
    if isinstance(xargs, dict):
        xargs.pop("session_id", None)
    return {**scope, "headers": [(k, v) for k, v in scope["headers"] if k != SESSION_HEADER]}


def _with_length(scope: Scope, length: int) -> Scope:
    headers = [(k, v) for k, v in scope["headers"] if k != b"content-length"]
    headers.append((b"content-length", str(length).encode()))
    return {**scope, "headers": headers}


async def _precondition_failed(send: Send, hint: registry_pb2.RoutingHint | None) -> None:
    """412 for a conditional request this node does not serve from its cache, with the hint
    (when the registry gave one) for the caller's fallback."""
    reason = hint.reason if hint is not None else "the registry could not be asked"
    await _refuse(
        send,
        412,
        f"not served from this node's cache: {reason}",
        "precondition_failed",
        hint_headers(hint) if hint is not None else [],
    )


async def _refuse(
    send: Send,
    status: int,
    message: str,
    error_type: str,
    headers: list[tuple[bytes, bytes]] | None = None,
) -> None:
    """Answers the request with an error in OpenAI's shape, as vLLM's own errors are."""
    payload = json.dumps({"error": {"message": message, "type": error_type, "code": status}})
    encoded = payload.encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(encoded)).encode()),
                *(headers or []),
            ],
        }
    )
    await send({"type": "http.response.body", "body": encoded})
