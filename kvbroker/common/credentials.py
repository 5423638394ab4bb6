"""Files of credentials that hold no secret: one line per token, ``HOLDER SHA256_HEX`` (the
token's SHA-256), ``#`` comments and blank lines skipped. The registry's ``--credentials``
(holders ``ROLE[:NODE_ID]``) and the router's ``--api-keys`` (holders tenants) are both read
here, and a presented token is looked up by ``token_digest``, the one digest both use."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

H = TypeVar("H")


def token_digest(token: str) -> str:
    """A token's SHA-256, in hex: what a credentials file holds for it."""
    return hashlib.sha256(token.encode()).hexdigest()


def read_digest_file(path: Path, holder: Callable[[str], H], form: str) -> dict[str, H]:
    """``path``'s lines as digest -> holder, each holder read by ``holder`` (which raises
    ValueError for one it refuses). Raises ValueError naming the line of a malformed one
    (``form`` says what a line should look like), and of a digest given to two holders."""
    held: dict[str, H] = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        text = line.split("#", 1)[0].strip()
        if not text:
            continue
        who, _, digest = text.partition(" ")
        digest = digest.strip().lower()
        if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            raise ValueError(f"{path}:{number}: expected '{form}'")
        try:
            parsed = holder(who)
        except ValueError as error:
            raise ValueError(f"{path}:{number}: {error}") from None
        if held.get(digest, parsed) != parsed:
            raise ValueError(f"{path}:{number}: this token is already given to another holder")
        held[digest] = parsed
    return held
