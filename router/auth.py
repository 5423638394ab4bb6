"""Who a router's client is (API keys) and what its session ids name (its tenant's
conversations only): the tenant rule (``kvbroker.common.rules.tenants``) at the router's door.

With ``--api-keys FILE`` every request but ``/health`` and ``/metrics`` must carry
``Authorization: Bearer KEY``, OpenAI's convention (on Anthropic's Messages routes
``X-Api-Key: KEY`` too, Anthropic's, which its SDK and Claude Code send with an API key). A
request without a key, or with one the file does not hold, gets 401 ``invalid_api_key``
(Anthropic's ``authentication_error`` on its routes). The key's tenant scopes every session id
its client gives (``Tenant.conversation``).

Without ``--api-keys`` the router is open: every client is the one unnamed tenant, and its
session ids go to the registry as they are. Such a router must be reachable by trusted clients
only: any of them can close, keep alive or probe any conversation.
"""

from __future__ import annotations

from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from kvbroker.common.rules.tenants import OPEN, ApiKeys, KeyRefusal, KeyRefused, Tenant
from kvbroker.router.errors import ApiError, ErrorCode, ErrorShape, ErrorType
from kvbroker.router.metrics import RouterMetrics
from kvbroker.router.requests import error_shape

__all__ = ["OPEN", "SCOPE_KEY", "ApiKeys", "Authenticate", "Tenant", "tenant_of"]

# The paths open without a key: a load balancer's health check and Prometheus.
OPEN_PATHS = frozenset({"/health", "/metrics"})
# Anthropic's header for a key (its Messages API's only).
API_KEY = "x-api-key"
# Where the middleware leaves a request's tenant for its handler (the ASGI scope).
SCOPE_KEY = "kvbroker.tenant"
# What a client is told for each refusal (OpenAI's sentences).
_REFUSALS = {
    KeyRefusal.MISSING: "You didn't provide an API key. Provide it in an Authorization header "
    "using Bearer auth (Authorization: Bearer YOUR_KEY), or in an X-Api-Key header.",
    KeyRefusal.UNKNOWN: "Incorrect API key provided.",
}


def unauthenticated(message: str) -> ApiError:
    return ApiError(
        401,
        message,
        ErrorType.INVALID_REQUEST,
        ErrorCode.INVALID_API_KEY,
        headers={"www-authenticate": "Bearer"},
    )


class Authenticate:
    """ASGI middleware, before routing: names each request's tenant in its scope
    (``SCOPE_KEY``), refusing with 401 one that needs a key and has none that ``keys``
    holds. Every path but ``OPEN_PATHS`` needs one (an unknown path too: 401 before 404), so
    no route can be left open by mistake; without ``keys`` every request is ``OPEN``'s."""

    def __init__(self, app: ASGIApp, keys: ApiKeys | None, metrics: RouterMetrics) -> None:
        self.app, self.keys, self.metrics = app, keys, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            tenant = OPEN
            if self.keys is not None and scope["path"] not in OPEN_PATHS:
                headers, path = Headers(scope=scope), scope["path"]
                shape = error_shape(path)
                # Anthropic's key header on Anthropic's API only, as each API's clients send.
                api_key = headers.get(API_KEY) if shape is ErrorShape.ANTHROPIC else None
                try:
                    tenant = self.keys.tenant(headers.get("authorization"), api_key)
                except KeyRefused as refused:
                    self.metrics.auth_failures.inc()
                    error = unauthenticated(_REFUSALS[refused.refusal])
                    await error.answer(path, shape)(scope, receive, send)
                    return
            scope[SCOPE_KEY] = tenant
        await self.app(scope, receive, send)


def tenant_of(request: Request) -> Tenant:
    """The request's tenant, named by ``Authenticate`` (a KeyError, so a 500, if the request
    did not pass through it: never served as anyone's)."""
    tenant = request.scope[SCOPE_KEY]
    assert isinstance(tenant, Tenant)
    return tenant
