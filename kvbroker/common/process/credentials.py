"""Files of credentials that hold no secret: one line per token, ``HOLDER SHA256_HEX`` (the
token's SHA-256 in lower-case hex, as ``token_digest`` writes it), ``#`` comments and blank
lines skipped. The registry's ``--credentials`` (holders ``ROLE[:NODE_ID:
NODE_ROLE]``) and the router's ``--api-keys`` (holders tenants) are both read here, and a
presented token is looked up by ``token_digest``, the one digest both use. The tenants'
session keys (``TENANT SESSION_KEY_HEX``, ``kvbroker.common.rules.tenants.session_key``) have
the same form and reader, but are secrets: they sign session ids.

The reader is strict because it guards a door: a file it half-reads (a byte-order mark, CRLF
line ends, an upper-case digest) would otherwise drop or mangle a
credential, and a file it reads as empty would leave the door open. Every such file is
refused whole with a sentence naming the file and the line, so that it is fixed before the
process serves anyone."""

from __future__ import annotations

import codecs
import secrets
import string
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from kvbroker.common.rules.digests import token_digest
from kvbroker.common.rules.tenants import ApiKeys, SessionKeys, parse_tenant

__all__ = [
    "fresh_credential",
    "load_api_keys",
    "load_session_keys",
    "read_digest_file",
    "token_digest",
]

H = TypeVar("H")

DIGEST_LENGTH = 64
_LOWER_HEX = frozenset(string.hexdigits.lower())


def fresh_credential(holder: str) -> tuple[str, str]:
    """A new random token for ``holder``, and the line a credentials file holds for it."""
    token = secrets.token_urlsafe(32)
    return token, f"{holder} {token_digest(token)}"


def _lines(path: Path) -> list[tuple[int, str]]:
    """``path``'s numbered lines as text; raises ValueError for a file that cannot be read or
    whose bytes are not plain UTF-8 lines ended by LF."""
    try:
        data = path.read_bytes()
    except OSError as error:
        raise ValueError(f"cannot read {path}: {error.strerror or error}") from None
    if data.startswith(codecs.BOM_UTF8):
        raise ValueError(f"{path}:1: the file starts with a UTF-8 byte-order mark; save it without")
    lines = []
    for number, raw in enumerate(data.split(b"\n"), 1):
        if raw.endswith(b"\r"):
            raise ValueError(f"{path}:{number}: the line ends in CRLF; save the file with LF ends")
        try:
            lines.append((number, raw.decode()))
        except UnicodeDecodeError:
            raise ValueError(f"{path}:{number}: the line is not UTF-8 text") from None
    return lines


def read_digest_file(path: Path, holder: Callable[[str], H], form: str) -> dict[str, H]:
    """``path``'s lines as digest -> holder, each holder read by ``holder`` (which raises
    ValueError for one it refuses). Raises ValueError naming the file and line of anything it
    cannot read (``form`` says what a line should look like), of a digest given to two
    holders, and naming the file when it holds no line at all."""
    held: dict[str, H] = {}
    for number, line in _lines(path):
        # A holder never holds '#' (nor whitespace), so a comment can end any line.
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        if len(fields) != 2:
            raise ValueError(f"{path}:{number}: expected '{form}'")
        who, digest = fields
        if len(digest) != DIGEST_LENGTH or not _LOWER_HEX.issuperset(digest):
            raise ValueError(
                f"{path}:{number}: the digest is not {DIGEST_LENGTH} lower-case hex digits "
                "(as 'kvbroker registry credential' or 'kvbroker tenant key' prints it)"
            )
        try:
            parsed = holder(who)
        except ValueError as error:
            raise ValueError(f"{path}:{number}: {error}") from None
        if held.get(digest, parsed) != parsed:
            raise ValueError(f"{path}:{number}: this token is already given to another holder")
        held[digest] = parsed
    if not held:
        raise ValueError(f"{path} holds no credential (expected lines '{form}')")
    return held


def load_api_keys(path: Path) -> ApiKeys:
    """A keys file (``TENANT SHA256_HEX`` lines) as the tenants' keys; raises ValueError naming
    the line of a malformed file, or a file with no key (which would refuse every client)."""
    return ApiKeys(read_digest_file(path, parse_tenant, "TENANT SHA256_HEX"))


def load_session_keys(path: Path) -> SessionKeys:
    """A session keys file (``TENANT SESSION_KEY_HEX`` lines, as ``kvbroker tenant key``
    prints them) as the keys signed session ids are verified with; raises ValueError as
    ``load_api_keys`` does."""
    return SessionKeys.of(read_digest_file(path, parse_tenant, "TENANT SESSION_KEY_HEX"))
