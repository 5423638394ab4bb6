"""The one digest a presented token is looked up by, in every credentials and keys file: its
SHA-256 in lower-case hex, so the files hold no secret."""

from __future__ import annotations

import hashlib


def token_digest(token: str) -> str:
    """A token's SHA-256, in hex: what a credentials file holds for it."""
    return hashlib.sha256(token.encode()).hexdigest()
