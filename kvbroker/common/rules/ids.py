"""The rule for an id (a conversation's, a node's, a lease's, a request's) that every part
applies alike: the registry to what it is sent, the router to a client's session id before it
asks the registry about it, so a client learns of a bad id as its own mistake."""

from __future__ import annotations

# The registry's default limit (``RegistryConfig.max_id_length``), and the router's.
MAX_ID_LENGTH = 256


class InvalidId(ValueError):
    """The value cannot be an id; the message says why, naming what it was for."""


def check_id(value: str, what: str, limit: int = MAX_ID_LENGTH) -> str:
    """``value`` if it is a usable id: not empty, at most ``limit`` characters, and text a
    protobuf string can carry (UTF-8: a lone surrogate, which JSON's ``\\ud800`` can produce,
    cannot be encoded)."""
    if not value:
        raise InvalidId(f"{what} is required")
    if len(value) > limit:
        raise InvalidId(f"{what} is {len(value)} characters long; the limit is {limit}")
    try:
        value.encode()
    except UnicodeEncodeError:
        raise InvalidId(f"{what} is not valid Unicode text (it holds a lone surrogate)") from None
    return value
