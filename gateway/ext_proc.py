"""Envoy's external processing protocol (``envoy.service.ext_proc.v3.ExternalProcessor``) as
the placement hop speaks it: for each request, read the session id from its headers, ask the
registry's dry-run hint where the conversation's KV is, and write the answer as the hints the
fleet's router honours (``kvbroker.common.rules.placement``).

Only request headers are asked for (the Envoy filter's processing mode sends them and skips
everything else), so bodies and server-sent event streams never pass through the hop. The hop
fails open: when the registry is slow (past ``hint_timeout_s``), away or answers that nothing
is retained, the request goes on exactly as sent and the fleet's router places it as it would.
The engine the turn reaches resolves its own handle (``engine_ext/session_reuse.py``), so
reuse stays correct whatever is picked; the hop only makes it likely to be fast.

With the tenants' keys (``PlacementConfig.sessions``) the hop applies the engines' tenant rule
to the session header, so a client can never have the hop ask about, or steer by, another
tenant's conversation.
"""

from __future__ import annotations

import hmac
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence

import grpc
import structlog
from google.protobuf import struct_pb2

from kvbroker.common.client.grpc_client import AUTH_METADATA_KEY
from kvbroker.common.process.credentials import token_digest
from kvbroker.common.rules.labels import label
from kvbroker.common.rules.placement import DYNAMO_PINS, SUBSET_HEADER, pinned_endpoints, pins
from kvbroker.common.rules.tenants import KeyRefused
from kvbroker.gateway.config import SUBSET_NAMESPACE, Mode, PlacementConfig
from kvbroker.gateway.envoy_v3.envoy.config.core.v3 import base_pb2
from kvbroker.gateway.envoy_v3.envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from kvbroker.v1 import registry_pb2
from kvbroker.v1.registry_pb2_grpc import RegistryServiceStub

log = structlog.get_logger("kvbroker.gateway")

# The session id, as engines read it (vLLM's ``X-Session-ID``) first, then the agents' own
# session headers in the order llm-d's ``agent-identity`` plugin reads them: Claude Code,
# OpenCode, Codex.
SESSION_HEADERS = (
    "x-session-id",
    "x-claude-code-session-id",
    "x-session-affinity",
    "session-id",
    "session_id",
)
# Dynamo's pin headers, which ``dynamo-headers`` mode writes of the placement's headers.


def request_headers(message: ep.HttpHeaders) -> dict[str, str]:
    """The request's headers by lower-case name; Envoy sends values as raw bytes."""
    return {
        h.key.lower(): h.raw_value.decode("latin-1") if h.raw_value else h.value
        for h in message.headers.headers
    }


def session_of(headers: Mapping[str, str]) -> str:
    """The conversation the request continues: the first session header with a value."""
    for name in SESSION_HEADERS:
        value = headers.get(name, "").strip()
        if value:
            return value
    return ""


def placement(hint: registry_pb2.RoutingHint, mode: Mode) -> ep.HeadersResponse:
    """The mutation that steers the request to the nodes the hint names (none for a turn
    that reuses nothing)."""
    headers = pins(hint)
    if mode is Mode.DYNAMO_HEADERS:
        headers = {name: value for name, value in headers.items() if name in DYNAMO_PINS}
    mutation = ep.HeaderMutation(
        set_headers=[
            base_pb2.HeaderValueOption(
                header=base_pb2.HeaderValue(key=name, raw_value=value.encode()),
                append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
            )
            for name, value in headers.items()
        ]
    )
    return ep.HeadersResponse(response=ep.CommonResponse(header_mutation=mutation))


def subset_metadata(hint: registry_pb2.RoutingHint) -> struct_pb2.Struct | None:
    """The endpoint subset as the dynamic metadata GIE's pickers read; None for no pin."""
    endpoints = pinned_endpoints(hint)
    if not endpoints:
        return None
    metadata = struct_pb2.Struct()
    metadata.get_or_create_struct(SUBSET_NAMESPACE)[SUBSET_HEADER] = endpoints
    return metadata


class HintBudget:
    """A token bucket of registry hints: ``rate`` a second, up to a second's worth at once."""

    def __init__(self, rate: float, now: Callable[[], float] = time.monotonic) -> None:
        self._rate = rate
        self._now = now
        self._tokens = rate
        self._at = now()

    def take(self) -> bool:
        """Whether a hint may be asked now (one is spent if so)."""
        now = self._now()
        self._tokens = min(self._rate, self._tokens + (now - self._at) * self._rate)
        self._at = now
        if self._tokens < 1:
            return False
        self._tokens -= 1
        return True


def authorized(metadata: Sequence[tuple[str, str | bytes]], digests: frozenset[str]) -> bool:
    """Whether a stream's caller presented one of the hop's tokens (always, with none
    configured)."""
    if not digests:
        return True
    for key, value in metadata:
        if key.lower() != AUTH_METADATA_KEY:
            continue
        text = value.decode("latin-1") if isinstance(value, bytes) else value
        scheme, _, token = text.partition(" ")
        if scheme.lower() == "bearer" and token:
            presented = token_digest(token.strip())
            return any(hmac.compare_digest(presented, digest) for digest in digests)
    return False


class PlacementProcessor:
    """One ext_proc stream per HTTP request; one hint per stream, and at most
    ``max_hints_per_s`` for the hop as a whole. Envoy sends a request's headers once per
    stream: a stream that sends more gets them passed on unchanged, never a registry call
    each (a stream of 3,000 header messages made 3,000 registry calls, issue 36)."""

    def __init__(self, stub: RegistryServiceStub, config: PlacementConfig) -> None:
        self.stub = stub
        self.config = config
        self.budget = HintBudget(config.max_hints_per_s)

    async def process(
        self, requests: AsyncIterator[ep.ProcessingRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[ep.ProcessingResponse]:
        if not authorized(context.invocation_metadata() or (), self.config.token_digests):
            await context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                "the placement hop needs 'authorization: Bearer TOKEN' metadata with one of "
                "its tokens (Envoy's grpc_service.initial_metadata)",
            )
        hinted = False
        async for request in requests:
            phase = request.WhichOneof("request")
            if phase == "request_headers" and not hinted:
                hinted = True
                yield await self.on_request_headers(request.request_headers)
            else:
                # Not asked for (the filter's processing mode skips them), or headers again on
                # the same stream; each passes unchanged.
                yield _unchanged(phase)

    def conversation(self, headers: Mapping[str, str]) -> str:
        """The conversation a request continues ("": none to pin): its session header, scoped
        by the tenant rule when the hop has one. Envoy hands the hop the client's own headers,
        so its key (or signed session id) names the tenant; a request without either, or with
        a key the file does not hold, is pinned nowhere and goes on unchanged (the router or
        engine behind answers for the key)."""
        session = session_of(headers)
        if self.config.sessions is None or not session:
            return session
        try:
            return self.config.sessions.conversation(
                session, headers.get("authorization"), headers.get("x-api-key")
            )
        except KeyRefused:
            return ""

    async def on_request_headers(self, message: ep.HttpHeaders) -> ep.ProcessingResponse:
        session = self.conversation(request_headers(message))
        if not session:
            return ep.ProcessingResponse(request_headers=ep.HeadersResponse())
        if not self.budget.take():
            log.debug("placement_over_budget", session=session)
            return ep.ProcessingResponse(request_headers=ep.HeadersResponse())
        asked = registry_pb2.GetRoutingHintRequest(conversation_id=session, dry_run=True)
        try:
            answered: registry_pb2.GetRoutingHintResponse = await self.stub.GetRoutingHint(
                asked, timeout=self.config.hint_timeout_s
            )
        except grpc.aio.AioRpcError as error:
            # Slow, away or refusing: the request goes on as sent.
            log.debug(
                "placement_open", session=session, code=error.code().name, why=error.details()
            )
            return ep.ProcessingResponse(request_headers=ep.HeadersResponse())
        hint = answered.hint
        answer = ep.ProcessingResponse(request_headers=placement(hint, self.config.mode))
        metadata = subset_metadata(hint) if self.config.mode is Mode.PRE_EPP else None
        if metadata is not None:
            answer.dynamic_metadata.CopyFrom(metadata)
        log.debug(
            "placement",
            session=session,
            decision=label(registry_pb2.HintDecision, hint.decision),
            decode=hint.decode.node_id,
        )
        return answer


def _unchanged(phase: str | None) -> ep.ProcessingResponse:
    """The answer that lets a message other than the request headers pass unchanged: the
    empty response of the same phase (the response's fields are named as the request's)."""
    answer = ep.ProcessingResponse()
    if phase is not None:
        getattr(answer, phase).SetInParent()
    return answer
