"""Placement hints anyone can send: ``GET /v1/placement`` answers where a conversation's next
turn should go, as the affinity headers the routers fleets run already honour
(``kvbroker.common.rules.placement``), for a router or a gateway filter to ask before it picks
nodes.

The engines resolve their own handles (``engine_ext/session_reuse.py``), so reuse is correct
whatever a fleet's router picks; these hints make it fast, by steering the turn to the node
holding the conversation's KV. The answer is the registry's dry run (no lease claimed, no
turn counted): the engine the turn reaches claims for itself. A router that keeps its own copy
of the leader's hint state (``router.local_hints``) answers it in process, and says so in the
``x-kvbroker-hint-source`` header.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kvbroker.common.client.grpc_client import RegistryCallError
from kvbroker.common.rules import routing
from kvbroker.common.rules.labels import label
from kvbroker.common.rules.placement import pins
from kvbroker.router.auth import tenant_of
from kvbroker.router.errors import (
    ApiError,
    ErrorCode,
    ErrorType,
    invalid_request,
    registry_refusal,
)
from kvbroker.router.local_hints import HintSource
from kvbroker.router.proxy import Router
from kvbroker.router.requests import session_id
from kvbroker.v1 import registry_pb2

# Who answered the placement: "router" (this router's copy of the leader's hint state) or
# "registry".
HINT_SOURCE_HEADER = "x-kvbroker-hint-source"


async def endpoint(router: Router, request: Request) -> Response:
    """Where the conversation's next turn should go, as the affinity headers other routers
    honour; the headers are also the response's own."""
    tenant = tenant_of(request)
    query = request.query_params
    session = session_id(query.get("session_id", ""), limit=tenant.id_limit)
    tokens = query.get("prompt_tokens", "0")
    # ASCII digits only ("²" is a digit to str.isdigit, and int() refuses it), and few enough
    # that int() reads them at all.
    if (
        not (tokens.isascii() and tokens.isdecimal() and len(tokens) <= 10)
        or int(tokens) >= 1 << 32
    ):
        raise invalid_request(
            "prompt_tokens must be a whole number of tokens",
            ErrorCode.INVALID_VALUE,
            "prompt_tokens",
        )
    asked = registry_pb2.GetRoutingHintRequest(
        conversation_id=tenant.conversation(session),
        model=query.get("model", ""),
        dry_run=True,
        prompt_tokens=int(tokens),
    )
    try:
        hint, source = await router.dry_run_hint(asked)
    except RegistryCallError as error:
        raise registry_refusal(error) from error
    except routing.NoReadyNode as error:  # the router's copy has none for the model
        raise ApiError(
            503, error.message, ErrorType.UNAVAILABLE, ErrorCode.NO_READY_NODE
        ) from error
    body = answer(session, hint)
    by = "router" if source is HintSource.LOCAL else "registry"
    return JSONResponse(body, headers={**body["headers"], HINT_SOURCE_HEADER: by})


def answer(session: str, hint: registry_pb2.RoutingHint) -> dict[str, Any]:
    """The placement as JSON: the registry's decision and path, the nodes, and the headers."""
    return {
        "session_id": session,
        "decision": label(registry_pb2.HintDecision, hint.decision),
        "path": label(registry_pb2.TurnPath, hint.path) if hint.path else None,
        "no_reuse": label(registry_pb2.NoReuseReason, hint.no_reuse) if hint.no_reuse else None,
        "reason": hint.reason,
        "decode": hint.decode.node_id or None,
        "prefill": hint.prefill.node_id or None,
        "retained_tokens": hint.lease.token_count,
        "headers": pins(hint),
    }
