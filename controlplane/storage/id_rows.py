"""Conversation and request ids packed into fixed slots of one ``bytearray``, not one string
object each.

A million leases hold two ids each; as ``str`` objects a 32-character hex id costs ~81 bytes
(49 of header) plus the list's pointer. Most ids are either a hex uuid (16 bytes as binary) or
short text (``conv-12``, ``req-7``: at most 16 bytes of UTF-8), so each packs into a 17-byte
slot: a kind byte, then the bytes. Any other id is kept as the string it is, in a side table,
so no id is lost or changed; a read gives back a string equal to the one put in.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterator

WIDTH = 16  # bytes of an id in its slot
SLOT = WIDTH + 1  # the kind byte, then the id
_HEX = 0xFF  # kind: a lowercase hex id of 2 * WIDTH characters, as binary
_OTHER = 0xFE  # kind: kept as a string (in the column's side table)
# any other kind: the length of the id's UTF-8 bytes (0 to WIDTH)
_HEX_KIND = bytes((_HEX,))


def pack(ident: str) -> bytes | str:
    """``ident`` as a slot of ``SLOT`` bytes, or ``ident`` itself where none holds it."""
    # lower case only (or digits): upper case would not come back as it was
    if len(ident) == 2 * WIDTH and (ident.islower() or ident.isdigit()):
        try:
            binary = bytes.fromhex(ident)
        except ValueError:
            binary = b""
        if len(binary) == WIDTH:  # fewer: it had spaces, which would not come back
            return _HEX_KIND + binary
    text = ident.encode("utf-8", "surrogatepass")
    if len(text) <= WIDTH:
        return bytes((len(text),)) + text.ljust(WIDTH, b"\0")
    return ident


def unpack(packed: bytes | bytearray | str, start: int = 0) -> str:
    """The id that ``pack`` gave ``packed`` for (a slot at ``start`` of a buffer of them)."""
    if isinstance(packed, str):
        return packed
    kind = packed[start]
    if kind == _HEX:
        return packed[start + 1 : start + SLOT].hex()
    return packed[start + 1 : start + 1 + kind].decode("utf-8", "surrogatepass")


class IdColumn:
    """An id a row, each in its slot of one ``bytearray`` (rows are appended, then set)."""

    def __init__(self) -> None:
        self._slots = bytearray()
        self._other: dict[int, str] = {}  # row -> an id that does not pack

    def __len__(self) -> int:
        return len(self._slots) // SLOT

    def append(self, ident: str) -> None:
        self._slots += bytes(SLOT)  # a zeroed slot is "" (kind 0: no bytes)
        if ident:
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
        return unpack(self._slots, start)


class RowTable:
    """Row numbers by an int key (a request id's hash, or the row itself), in two ``array``s:
    open addressing, linear probing, a deletion shifting the rest of its run back. 16 bytes a
    slot, at most 3/4 full (21 to 43 bytes a row), where a dict entry and the request id it
    keyed by were ~100.

    Keys may collide (two request ids, one hash): each lookup takes ``same``, which tells
    whether a row is the one sought, and probes on past rows that are not."""

    def __init__(self) -> None:
        self._keys = array("q", bytes(8 * 8))
        self._rows = array("q", [-1]) * 8
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def rows(self) -> Iterator[int]:
        return (row for row in self._rows if row >= 0)

    def get(self, key: int, same: Callable[[int], bool]) -> int | None:
        slot = self._slot(key, same)
        return None if self._rows[slot] < 0 else self._rows[slot]

    def put(self, key: int, row: int, same: Callable[[int], bool]) -> None:
        """Sets the row ``same`` tells of to ``row`` (none: adds ``row``)."""
        slot = self._slot(key, same)
        if self._rows[slot] < 0:
            self._count += 1
            self._keys[slot] = key
        self._rows[slot] = row
        if 4 * self._count > 3 * len(self._rows):
            self._resize(2 * len(self._rows))

    def pop(self, key: int, same: Callable[[int], bool]) -> int | None:
        """Removes the row ``same`` tells of, returning it (None: none)."""
        slot = self._slot(key, same)
        row = self._rows[slot]
        if row < 0:
            return None
        self._count -= 1
        self._delete(slot)
        return row

    def _slot(self, key: int, same: Callable[[int], bool]) -> int:
        """The slot holding the sought row, else the empty slot that ends its run."""
        rows, keys = self._rows, self._keys
        mask = len(rows) - 1
        slot = key & mask
        while rows[slot] >= 0 and not (keys[slot] == key and same(rows[slot])):
            slot = (slot + 1) & mask
        return slot

    def _delete(self, slot: int) -> None:
        rows, keys = self._rows, self._keys
        mask = len(rows) - 1
        rows[slot] = -1
        probe = (slot + 1) & mask
        while rows[probe] >= 0:
            home = keys[probe] & mask
            # moves back unless its home lies (cyclically) in (slot, probe]
            if (probe - home) & mask >= (probe - slot) & mask:
                rows[slot], keys[slot] = rows[probe], keys[probe]
                rows[probe] = -1
                slot = probe
            probe = (probe + 1) & mask

    def _resize(self, size: int) -> None:
        old = zip(self._keys, self._rows, strict=True)
        self._keys = array("q", bytes(8 * size))
        self._rows = array("q", [-1]) * size
        mask = size - 1
        for key, row in old:
            if row >= 0:
                slot = key & mask
                while self._rows[slot] >= 0:
                    slot = (slot + 1) & mask
                self._keys[slot], self._rows[slot] = key, row
