"""Conversation and request ids packed into fixed slots of one ``bytearray``, not one string
object each.

A million leases hold two ids each; as ``str`` objects a 32-character hex id costs ~81 bytes
(49 of header) plus the list's pointer. Most ids are either a hex uuid (16 bytes as binary) or
short text (``conv-12``, ``req-7``: at most 16 bytes of UTF-8), so each packs into a 17-byte
slot: a kind byte, then the bytes. Any other id is kept as the string it is, in a side table,
so no id is lost or changed; a read gives back a string equal to the one put in.
"""

from __future__ import annotations

WIDTH = 16  # bytes of an id in its slot
SLOT = WIDTH + 1  # the kind byte, then the id
_HEX = 0xFF  # kind: a lowercase hex id of 2 * WIDTH characters, as binary
_OTHER = 0xFE  # kind: kept as a string (in the column's side table)
# any other kind: the length of the id's UTF-8 bytes (0 to WIDTH)


def pack(ident: str) -> bytes | str:
    """``ident`` as a slot of ``SLOT`` bytes, or ``ident`` itself where none holds it."""
    text = ident.encode("utf-8", "surrogatepass")
    if len(text) <= WIDTH:
        return bytes((len(text),)) + text.ljust(WIDTH, b"\0")
    if len(ident) == 2 * WIDTH:
        try:
            binary = bytes.fromhex(ident)
        except ValueError:
            return ident
        if binary.hex() == ident:  # upper case or spaces would not come back as they were
            return bytes((_HEX,)) + binary
    return ident


def unpack(packed: bytes | str) -> str:
    """The id that ``pack`` gave ``packed`` for."""
    if isinstance(packed, str):
        return packed
    kind = packed[0]
    if kind == _HEX:
        return packed[1:SLOT].hex()
    return packed[1 : 1 + kind].decode("utf-8", "surrogatepass")


class IdColumn:
    """An id a row, each in its slot of one ``bytearray`` (rows are appended, then set)."""

    def __init__(self) -> None:
        self._slots = bytearray()
        self._other: dict[int, str] = {}  # row -> an id that does not pack

    def __len__(self) -> int:
        return len(self._slots) // SLOT

    def append(self, ident: str) -> None:
        self._slots += bytes(SLOT)
        self[len(self) - 1] = ident

    def __setitem__(self, row: int, ident: str) -> None:
        start = row * SLOT
        if not 0 <= start < len(self._slots):
            raise IndexError(row)
        packed = pack(ident)
        if isinstance(packed, str):
            self._slots[start] = _OTHER
            self._other[row] = packed
        else:
            self._slots[start : start + SLOT] = packed
            self._other.pop(row, None)

    def __getitem__(self, row: int) -> str:
        start = row * SLOT
        if self._slots[start] == _OTHER:
            return self._other[row]
        return unpack(bytes(self._slots[start : start + SLOT]))
