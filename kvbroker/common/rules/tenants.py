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
"""

from __future__ import annotations

import enum
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
