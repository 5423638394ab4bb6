"""Who a router's client is (API keys) and what its session ids name (its tenant's
conversations only).

With ``--api-keys FILE`` every request but ``/health`` and ``/metrics`` must carry
``Authorization: Bearer KEY``, OpenAI's convention (on Anthropic's Messages routes
``X-Api-Key: KEY`` too, Anthropic's, which its SDK and Claude Code send with an API key); the
file holds one line per key, ``TENANT SHA256_HEX`` (the key's SHA-256, so the file holds no
secret; the registry's credentials file has the same form and the same reader,
``kvbroker.common.process.credentials``). A request without a key, or with one the file does
not hold, gets 401 ``invalid_api_key`` (Anthropic's ``authentication_error`` on its routes).

The key's tenant scopes every session id its client gives: the registry is asked about the
conversation ``TENANT/SESSION``. A tenant name holds no ``/``, so ``TENANT/`` is a prefix no
other tenant's ids can have, and one tenant's session id can never name another tenant's
conversation, whatever it holds. The id limit (``kvbroker.common.rules.ids``) applies to the
scoped id, so a client's session id may be as long as the limit less the prefix.

Without ``--api-keys`` the router is open: every client is the one unnamed tenant, and its
session ids go to the registry as they are. Such a router must be reachable by trusted clients
only: any of them can close, keep alive or probe any conversation.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from kvbroker.common.process.credentials import read_digest_file, token_digest
from kvbroker.common.rules.ids import MAX_ID_LENGTH
from kvbroker.router.errors import ApiError, ErrorCode, ErrorShape, ErrorType
from kvbroker.router.metrics import RouterMetrics
from kvbroker.router.requests import error_shape

# Between a tenant and its client's session id in the conversation id the registry sees.
SEPARATOR = "/"
# A tenant's name: short, printable, and without the separator.
_TENANT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@:-]{0,63}")
# The paths open without a key: a load balancer's health check and Prometheus.
OPEN_PATHS = frozenset({"/health", "/metrics"})
# Anthropic's header for a key (its Messages API's only).
API_KEY = "x-api-key"
# Where the middleware leaves a request's tenant for its handler (the ASGI scope).
SCOPE_KEY = "kvbroker.tenant"


@dataclass(frozen=True)
class Tenant:
    """Whose request it is; ``name`` empty for every client of an open router."""

    name: str = ""

    @property
    def prefix(self) -> str:
        return self.name + SEPARATOR if self.name else ""

    @property
    def id_limit(self) -> int:
        """The longest session id this tenant's client may give: the scoped id must fit."""
        return MAX_ID_LENGTH - len(self.prefix)

    def conversation(self, session: str) -> str:
        """The conversation id the registry knows ``session`` by ("" stays "": none)."""
        return self.prefix + session if session else ""


OPEN = Tenant()


def parse_tenant(text: str) -> Tenant:
    if not _TENANT.fullmatch(text):
        raise ValueError(
            f"tenant {text!r} is not 1-64 letters, digits and ._@:- (starting with a letter "
            "or digit)"
        )
    return Tenant(text)


@dataclass(frozen=True)
class ApiKeys:
    """The keys a router accepts: SHA-256 (hex) of a key -> its tenant."""

    tenants: Mapping[str, Tenant]

    @classmethod
    def load(cls, path: Path) -> ApiKeys:
        """Raises ValueError naming the line of a malformed file, or a file with no key (which
        would refuse every client)."""
        return cls(read_digest_file(path, parse_tenant, "TENANT SHA256_HEX"))

    def tenant(self, authorization: str | None, api_key: str | None = None) -> Tenant:
        """The tenant whose key the ``Authorization`` header carries, else the ``X-Api-Key``
        header; else a 401."""
        scheme, _, key = (authorization or "").partition(" ")
        key = key.strip() if scheme.lower() == "bearer" else ""
        key = key or (api_key or "").strip()
        if not key:
            raise unauthenticated(
                "You didn't provide an API key. Provide it in an Authorization header using "
                "Bearer auth (Authorization: Bearer YOUR_KEY), or in an X-Api-Key header."
            )
        tenant = self.tenants.get(token_digest(key))
        if tenant is None:
            raise unauthenticated("Incorrect API key provided.")
        return tenant


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
                except ApiError as error:
                    self.metrics.auth_failures.inc()
                    await error.answer(path, shape)(scope, receive, send)
                    return
            scope[SCOPE_KEY] = tenant
        await self.app(scope, receive, send)
