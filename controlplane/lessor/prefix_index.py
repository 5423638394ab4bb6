"""The registry's prefix index: live leases found by content, so that a fork reuses what its
parent retained (docs/design.md, "Forks: reuse by content").

A sub-agent's prompt is its parent's whole history plus its own task, under a new session id:
reuse by session id finds nothing, though the parent's lease holds every block of that history.
The prefill engine, which has the prompt's token ids, computes kvbroker's prefix hashes
(chained sha256, deterministic across processes) and asks for the longest live lease whose
hashes equal its own. Hashes chain, so one equal hash at block i proves blocks 0..i equal; the
index therefore keys each lease only by its hashes at block indexes 2^k - 1
(``checkpoints.probe_blocks``) that are among its checkpoints (every one at or past its
stride, as the stride is a power of two), of full blocks only. A lease costs about
log2(blocks) entries (14 for 8,192 blocks), and a look-up about as many table probes.

Scope: a lease is found only under its tenant (the conversation id's ``TENANT/`` prefix,
``tenants.tenant_of``), its holder's model and its block size, so no tenant's look-up can name
another's lease. Maintained from one place, ``LeaseTracking.track``, which every change of a
lease's state passes through (grant, claim, end, revival, a takeover's rebuild): a live lease
is indexed, an ended one removed. Soft state, as leases are: rebuilt from the replays.
"""

from __future__ import annotations

import functools
from array import array
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from kvbroker.common.rules.checkpoints import BLOCK_HASH_BYTES, checkpoint_blocks, probe_blocks
from kvbroker.controlplane.records import codec
from kvbroker.controlplane.storage.id_rows import RowTable

# The most probe hashes a look-up may carry: 2^31 blocks, far past any context.
MAX_PROBES = 32
# The leases a key keeps, newest: they all give a prompt the same prefix there.
KEEP_PER_KEY = 8
# The bytes of a probe hash a key keeps: 7 of its ``BLOCK_HASH_BYTES``, so a key is a
# non-negative int64.
KEY_BYTES = 7
# The table doubles past this share of its slots in use (linear probing stays short below it).
MAX_LOAD = 0.75
# Mixes a scope's number into where its keys start probing (the golden ratio's 64 bits).
_MIX = 0x9E3779B97F4A7C15


def key_of(digest: bytes) -> int:
    """A probe hash's key: its first ``KEY_BYTES`` bytes."""
    return int.from_bytes(digest[:KEY_BYTES])


class Scope(NamedTuple):
    """What a look-up may match: one tenant's leases of one model at one block size. A tuple,
    not a dataclass: every lease indexed and every look-up finds its scope's number by it, and
    a tuple's hash and equality are C's (0.7 us a look-up, against 2.5)."""

    tenant: str
    model: str
    block_size: int


@dataclass(frozen=True, slots=True)
class Hit:
    """Leases whose hash at block ``2**level - 1`` equals the prompt's: they share its first
    ``blocks`` blocks."""

    blocks: int
    lease_ids: tuple[str, ...]


def indexed_hashes(
    checkpoints: bytes, stride: int, token_count: int, block_size: int
) -> list[tuple[int, bytes]]:
    """A lease's (block index, hash) pairs the index keys it by: its checkpoints at probe
    blocks, of full blocks only (a partial last block's hash covers fewer tokens than any
    prompt's block there)."""
    if block_size <= 0 or token_count <= 0:
        return []
    # Kept by an older version (16-byte hashes), none of them can match a prompt of ours,
    # though a block 0 hash cut to 8 bytes is ours, so keying it would only cost reads.
    kept = codec.checkpoints_of_width(checkpoints, BLOCK_HASH_BYTES)
    if not kept:
        return []
    shape = _probe_places(-(-token_count // block_size), max(stride, 1), token_count // block_size)
    return [
        (block, checkpoints[start : start + BLOCK_HASH_BYTES])
        for block, at, start in shape
        if at < kept
    ]


@functools.lru_cache(maxsize=4096)
def _probe_places(
    block_count: int, stride: int, full_blocks: int
) -> tuple[tuple[int, int, int], ...]:
    """For a lease of this shape, each probe block among its checkpoints, with that
    checkpoint's place in its hashes and where it starts in its blob
    (``codec.checkpoints_of_width``). Leases share a few shapes (a replay of 100k leases
    computed the same places 100k times): per shape, a lease's keys are cut in one pass."""
    place = {block: at for at, block in enumerate(checkpoint_blocks(block_count, stride))}
    return tuple(
        (block, place[block], 1 + place[block] * BLOCK_HASH_BYTES)
        for block in probe_blocks(full_blocks)
        if block in place
    )


def _home(key: int, number: int, mask: int) -> int:
    """The slot a key of scope ``number`` starts probing at, in a table of ``mask`` + 1 slots
    (keys are hash bytes already: the scope's number only moves where each scope's fall)."""
    return (key ^ (number * _MIX)) & mask


class PrefixIndex:
    """Live leases by (scope, hash at a probe block).

    Bounded by what a look-up can use. Leases that share a key share every block up to it
    (hashes chain), so any of them gives a prompt the same prefix there: a key keeps only its
    ``KEEP_PER_KEY`` newest leases (the spares are for when the newest cannot be read). One
    system prompt under a million conversations is then 8 ids at each of its keys, not a
    million, and a look-up reads at most 8 leases a level. A key is the hash's first
    ``KEY_BYTES`` bytes (``key_of``); a collision (one in 2^56 a probe) costs nothing but a
    lease the reader's check against its checkpoints turns down.

    Kept in flat arrays, not Python objects per key (a dictionary's key, slot and list cost
    ~80 bytes a key, ~530 a lease of 6 keys): an open-addressing table of (key, row) pairs,
    one pair per key of each lease, linear probing from a slot the key and its scope's number
    give, deleted by shifting the rest of a run back (no tombstones); and a row per indexed
    lease: its id, scope number, longest key and the order it was added in (newest first in
    a hit). A pair costs 12 bytes a slot, and 1.3 to 2.7 slots as the table fills to 3/4 and
    doubles."""

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self._bits = 10
        self._keys = array("q", bytes(8 << self._bits))
        # Each slot's row + 1; 0: empty.
        self._slots = array("i", bytes(4 << self._bits))
        self._used = 0
        self._limit = int(MAX_LOAD * (1 << self._bits))
        # Rows: a lease's id (None: a free row), scope number, longest key, and when added.
        self._ids: list[str | None] = []
        self._row_scope = array("i")
        self._row_last = array("q")
        self._row_added = array("q")
        self._free_rows: list[int] = []
        self._added = 0
        # Rows by their lease id's hash (a dict's slot and boxed row number: ~76 bytes a lease).
        self._rows = RowTable()
        # Scopes by number, one object each, shared by their leases; and their live rows.
        self._scope_numbers: dict[Scope, int] = {}
        self._scopes: list[Scope | None] = []
        self._scope_rows: list[int] = []

    def __len__(self) -> int:
        return len(self._rows)

    def __contains__(self, lease_id: str) -> bool:
        return self._row(lease_id) is not None

    def entries(self) -> int:
        """Lease ids held under keys in all: about log2(blocks) per lease, fewer where many
        leases share a key."""
        return self._used

    def scope(self, lease_id: str) -> Scope | None:
        """The scope an indexed lease is found under; None when it is not indexed."""
        row = self._row(lease_id)
        return self._scopes[self._row_scope[row]] if row is not None else None

    def add(self, lease_id: str, scope: Scope, hashes: Sequence[tuple[int, bytes]]) -> None:
        """Indexes a live lease (again: a no-op) under its ``indexed_hashes``."""
        if lease_id in self:
            return
        number = self._scope_number(scope)
        row = self._new_row(lease_id, number)
        key = -1
        for _, digest in hashes:
            key = key_of(digest)
            if self._used >= self._limit:
                self._grow()
            # One probe finds the key's pairs of this scope and, at the run's end, a free slot.
            keys, slots, scopes = self._keys, self._slots, self._row_scope
            mask = len(slots) - 1
            slot = _home(key, number, mask)
            held: list[int] = []
            while found := slots[slot]:
                if keys[slot] == key and scopes[found - 1] == number:
                    held.append(slot)
                slot = (slot + 1) & mask
            if len(held) >= KEEP_PER_KEY:
                oldest = min(held, key=lambda at: self._row_added[self._slots[at] - 1])
                self._delete(oldest)  # shifts the run: probe again for the free slot
                slot = _home(key, number, mask)
                while slots[slot]:
                    slot = (slot + 1) & mask
            keys[slot] = key
            slots[slot] = row + 1
            self._used += 1
        self._row_last[row] = key

    def remove(self, lease_id: str, hashes: Sequence[tuple[int, bytes]]) -> None:
        """Forgets an indexed lease; ``hashes``: what it was added under."""
        row = self._rows.pop(hash(lease_id), self._holds(lease_id))
        if row is None:
            return
        number = self._row_scope[row]
        for _, digest in hashes:
            for slot in self._find(number, key_of(digest)):
                if self._slots[slot] == row + 1:
                    self._delete(slot)
                    break
        self._ids[row] = None
        self._free_rows.append(row)
        self._scope_rows[number] -= 1
        if not self._scope_rows[number]:
            scope = self._scopes[number]
            assert scope is not None
            del self._scope_numbers[scope]
            self._scopes[number] = None

    def clear(self) -> None:
        self._reset()

    def sharing_all(self, scope: Scope, hashes: Sequence[tuple[int, bytes]]) -> list[str]:
        """The leases whose every indexed hash is among ``hashes`` (a lease's own
        ``indexed_hashes``): hashes chain, so those whose longest indexed key (the last of
        their keys) is one of them. The candidates a sessionless lease may supersede; a lease
        sharing only a shorter prefix (a common system prompt) is not among them."""
        number = self._scope_numbers.get(scope)
        if number is None:
            return []
        found: set[str] = set()
        for _, digest in hashes:
            key = key_of(digest)
            for slot in self._find(number, key):
                row = self._slots[slot] - 1
                if self._row_last[row] == key:
                    found.add(self._id(row))
        return sorted(found)

    def hits(self, scope: Scope, probes: Sequence[bytes]) -> Iterator[Hit]:
        """The leases sharing the prompt's prefix, longest share first, newest lease first
        within one: ``probes`` are the prompt's hashes at blocks 0, 1, 3, 7, ... in order."""
        number = self._scope_numbers.get(scope)
        if number is None:
            return
        added = self._row_added
        for level in range(min(len(probes), MAX_PROBES) - 1, -1, -1):
            rows = [self._slots[slot] - 1 for slot in self._find(number, key_of(probes[level]))]
            if rows:
                rows.sort(key=added.__getitem__, reverse=True)
                yield Hit(1 << level, tuple(self._id(row) for row in rows))

    # ----------------------------------------------------------------- rows and slots

    def _row(self, lease_id: str) -> int | None:
        return self._rows.get(hash(lease_id), self._holds(lease_id))

    def _holds(self, lease_id: str) -> Callable[[int], bool]:
        """Whether a row is ``lease_id``'s (two ids may share a hash)."""
        ids = self._ids
        return lambda row: ids[row] == lease_id

    def _id(self, row: int) -> str:
        lease_id = self._ids[row]
        assert lease_id is not None
        return lease_id

    def _scope_number(self, scope: Scope) -> int:
        number = self._scope_numbers.get(scope)
        if number is None:
            number = len(self._scopes)
            self._scope_numbers[scope] = number
            self._scopes.append(scope)
            self._scope_rows.append(0)
        return number

    def _new_row(self, lease_id: str, number: int) -> int:
        self._added += 1
        if self._free_rows:
            row = self._free_rows.pop()
            self._ids[row] = lease_id
            self._row_scope[row] = number
            self._row_added[row] = self._added
        else:
            row = len(self._ids)
            self._ids.append(lease_id)
            self._row_scope.append(number)
            self._row_last.append(-1)
            self._row_added.append(self._added)
        self._rows.put(hash(lease_id), row, self._holds(lease_id))
        self._scope_rows[number] += 1
        return row

    def _find(self, number: int, key: int) -> list[int]:
        """The slots holding ``key`` for a lease of scope ``number``."""
        keys, slots, scopes = self._keys, self._slots, self._row_scope
        mask = (1 << self._bits) - 1
        slot = _home(key, number, mask)
        found = []
        while held := slots[slot]:
            if keys[slot] == key and scopes[held - 1] == number:
                found.append(slot)
            slot = (slot + 1) & mask
        return found

    def _delete(self, slot: int) -> None:
        """Empties a slot, moving back the pairs after it in its run that probing would no
        longer reach across the gap (so a run never has holes, and no tombstones are kept)."""
        keys, slots, scopes = self._keys, self._slots, self._row_scope
        mask = (1 << self._bits) - 1
        gap, at = slot, slot
        while True:
            at = (at + 1) & mask
            held = slots[at]
            if not held:
                break
            home = _home(keys[at], scopes[held - 1], mask)
            # The pair stays unless the gap lies between its home and it, cyclically.
            if (at - home) & mask >= (at - gap) & mask:
                keys[gap], slots[gap] = keys[at], held
                gap = at
        slots[gap] = 0
        self._used -= 1

    def reserve(self, pairs: int) -> None:
        """Sizes the table for ``pairs`` more pairs at once: a replay's thousands of leases
        would otherwise double it ten times over, every pair probed in again each time."""
        bits = self._bits
        while self._used + pairs >= int(MAX_LOAD * (1 << bits)):
            bits += 1
        if bits > self._bits:
            self._resize(bits)

    def _grow(self) -> None:
        """Doubles the table."""
        self._resize(self._bits + 1)

    def _resize(self, bits: int) -> None:
        """A table of ``2**bits`` slots, every pair probed in again."""
        old_keys, old_slots, scopes = self._keys, self._slots, self._row_scope
        self._bits = bits
        self._keys = keys = array("q", bytes(8 << self._bits))
        self._slots = slots = array("i", bytes(4 << self._bits))
        self._limit = int(MAX_LOAD * (1 << self._bits))
        mask = (1 << self._bits) - 1
        for at, held in enumerate(old_slots):
            if held:
                key = old_keys[at]
                slot = _home(key, scopes[held - 1], mask)
                while slots[slot]:
                    slot = (slot + 1) & mask
                keys[slot] = key
                slots[slot] = held
