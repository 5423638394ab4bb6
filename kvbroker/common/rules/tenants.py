"""Whose conversation a session id names: the tenant rule every door applies (kvbroker's
router, the engine's session middleware), so one tenant's client can never name another's.

A tenant is named by the API key its client presents (``Authorization: Bearer KEY``, or
Anthropic's ``X-Api-Key``), looked up in a keys file of lines ``TENANT SHA256_HEX`` (the key's
SHA-256, so the file holds no secret; ``kvbroker.common.process.credentials.load_api_keys``
reads it).
The key's tenant scopes every session id its client gives: the registry knows the conversation
as ``TENANT/SESSION``. A tenant name holds no ``/``, so ``TENANT/`` is a prefix no other
tenant's ids can have. The id limit (``kvbroker.common.rules.ids``) applies to the scoped id.

A door without a keys file is open: every client is the one unnamed tenant, and session ids
reach the registry as they are (trusted clients only: any of them can name any conversation).

A router that forwards no client header to the engines (``vllm-router`` forwards only the
body's session id) leaves a keyed engine nothing to learn the tenant from. For it a client
sends a **signed session id** (``sign_session``): ``kvbs1~TENANT~MAC~SESSION``, where MAC is
an HMAC of ``TENANT/SESSION`` keyed by the tenant's *session key*, itself derived from the API
key (``session_key``). A door that holds the tenants' session keys (``SessionKeys``: a file of
``TENANT SESSION_KEY_HEX`` lines, a secret, unlike the keys file) verifies it and resolves
``TENANT/SESSION``, the conversation the same client's key would name; a signature that does
not verify resolves nothing. The session key is a derivation, not the API key itself nor the
keys file's digest, so an engine that can verify a tenant's session ids cannot call the router
as that tenant, and the keys file stays free of secrets.
``ScopedSessions`` is the rule such a door (an engine's session middleware, the placement
hop) applies to every request: the API key's tenant, else the signature's, else nothing.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import re
from collections.abc import Mapping
from dataclasses import dataclass

from kvbroker.common.rules.digests import token_digest
from kvbroker.common.rules.ids import MAX_ID_LENGTH

# Between a tenant and its client's session id in the conversation id the registry sees.
SEPARATOR = "/"
# A tenant's name: short, printable, and without the separator.
_TENANT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@:-]{0,63}")


@dataclass(frozen=True)
class Tenant:
    """Whose request it is; ``name`` empty for every client of an open door."""

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


def tenant_of(conversation_id: str) -> str:
    """The tenant a conversation id belongs to, ``Tenant.conversation`` read backwards ("" for
    an unscoped id: the open tenant). What is shared by content (a fork's match of another
    conversation's lease) is shared only within one tenant."""
    tenant, separator, _ = conversation_id.partition(SEPARATOR)
    return tenant if separator else ""


def parse_tenant(text: str) -> Tenant:
    if not _TENANT.fullmatch(text):
        raise ValueError(
            f"tenant {text!r} is not 1-64 letters, digits and ._@:- (starting with a letter "
            "or digit)"
        )
    return Tenant(text)


class KeyRefusal(enum.Enum):
    """Why a request names no tenant."""

    MISSING = "no API key"
    UNKNOWN = "an API key the keys file does not hold"


class KeyRefused(Exception):
    def __init__(self, refusal: KeyRefusal) -> None:
        super().__init__(refusal.value)
        self.refusal = refusal


@dataclass(frozen=True)
class ApiKeys:
    """The keys a door accepts: SHA-256 (hex) of a key -> its tenant."""

    tenants: Mapping[str, Tenant]

    def tenant(self, authorization: str | None, api_key: str | None = None) -> Tenant:
        """The tenant whose key the ``Authorization`` header carries (Bearer), else the
        ``X-Api-Key`` header; raises ``KeyRefused`` saying why there is none."""
        scheme, _, key = (authorization or "").partition(" ")
        key = key.strip() if scheme.lower() == "bearer" else ""
        key = key or (api_key or "").strip()
        if not key:
            raise KeyRefused(KeyRefusal.MISSING)
        tenant = self.tenants.get(token_digest(key))
        if tenant is None:
            raise KeyRefused(KeyRefusal.UNKNOWN)
        return tenant


# A signed session id: ``kvbs1~TENANT~MAC~SESSION`` (a tenant's name holds no ``~``).
SIGNED_PREFIX = "kvbs1~"
_SIGNED_SEPARATOR = "~"
# What a session key is derived for, so that it is no other HMAC of the API key.
_SESSION_KEY_CONTEXT = b"kvbroker session key v1"
# The MAC's length in hex digits (128 bits).
_MAC_DIGITS = 32


def session_key(api_key: str) -> str:
    """The secret (64 hex digits) a door verifies its tenant's signed session ids with:
    HMAC-SHA256 of a fixed context keyed by the API key. Knowing it lets one sign session ids
    as the tenant, never call a router with its key."""
    return hmac.new(api_key.encode(), _SESSION_KEY_CONTEXT, hashlib.sha256).hexdigest()


def _mac(key_hex: str, conversation: str) -> str:
    digest = hmac.new(bytes.fromhex(key_hex), conversation.encode(), hashlib.sha256)
    return digest.hexdigest()[:_MAC_DIGITS]


def sign_session(api_key: str, tenant: Tenant, session: str) -> str:
    """The session id a client of ``tenant`` holding ``api_key`` sends where no router
    forwards its key: names its tenant and session, and proves the key. Raises ValueError for
    an open tenant, an empty session or one whose conversation id would be over the limit."""
    if not tenant.name:
        raise ValueError("a signed session id names a tenant")
    if not session:
        raise ValueError("a signed session id names a session")
    if len(session) > tenant.id_limit:
        raise ValueError(
            f"session id is {len(session)} characters long; tenant {tenant.name!r}'s limit is "
            f"{tenant.id_limit}"
        )
    mac = _mac(session_key(api_key), tenant.conversation(session))
    return _SIGNED_SEPARATOR.join((SIGNED_PREFIX + tenant.name, mac, session))


@dataclass(frozen=True)
class SessionKeys:
    """The session keys a door verifies signed session ids with: tenant -> its keys (hex;
    several for a tenant with several API keys)."""

    keys: Mapping[Tenant, frozenset[str]]

    @classmethod
    def of(cls, by_key: Mapping[str, Tenant]) -> SessionKeys:
        """From a file's form: each session key -> its tenant."""
        keys: dict[Tenant, set[str]] = {}
        for key, tenant in by_key.items():
            keys.setdefault(tenant, set()).add(key)
        return cls({tenant: frozenset(held) for tenant, held in keys.items()})

    def conversation(self, signed: str) -> str:
        """The conversation a signed session id names when its MAC verifies with one of its
        tenant's keys; "" otherwise (not signed, an unknown tenant, a forged or foreign MAC)."""
        if not signed.startswith(SIGNED_PREFIX):
            return ""
        fields = signed[len(SIGNED_PREFIX) :].split(_SIGNED_SEPARATOR, 2)
        if len(fields) != 3 or not fields[2]:
            return ""
        name, mac, session = fields
        tenant = Tenant(name)
        if len(session) > tenant.id_limit:
            return ""
        conversation = tenant.conversation(session)
        for key in self.keys.get(tenant, ()):
            if hmac.compare_digest(_mac(key, conversation), mac):
                return conversation
        return ""


@dataclass(frozen=True)
class ScopedSessions:
    """The tenant rule at a door that takes no session id as given (an engine's session
    middleware, the placement hop): a request's session resolves to its tenant's
    conversation, or to none (a plain turn, no pin)."""

    keys: ApiKeys | None = None
    signed: SessionKeys | None = None

    def conversation(self, session: str, authorization: str | None, api_key: str | None) -> str:
        """The conversation ``session`` names for this request ("": none):

        - a signed session id (``sign_session``): its own when its signature verifies and no
          API key names another tenant;
        - any other id: its API key's tenant's (``Tenant.conversation``);
        - without a key (a router that forwards none): none.

        Raises ``KeyRefused`` (``UNKNOWN``) for an API key the keys file does not hold: the
        door decides whether that is a refusal (the engine's 401) or a request left as sent
        (the hop's)."""
        tenant: Tenant | None = None
        if self.keys is not None:
            try:
                tenant = self.keys.tenant(authorization, api_key)
            except KeyRefused as refused:
                if refused.refusal is not KeyRefusal.MISSING:
                    raise
        if not session:
            return ""
        if session.startswith(SIGNED_PREFIX):
            signed = self.signed.conversation(session) if self.signed is not None else ""
            if tenant is not None and tenant_of(signed) != tenant.name:
                return ""  # a key's client may name only its own tenant's conversations
            return signed
        return tenant.conversation(session) if tenant is not None else ""
