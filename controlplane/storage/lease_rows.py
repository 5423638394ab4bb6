"""The state cache's leases as rows of columns, not one object graph per lease.

A million live leases as ``Lease`` objects cost ~1,170 bytes each in objects alone (the
record, its handle, two bytes objects, boxed times and ints); most of that is object headers,
not data. Here a lease is a row number: its numbers and times sit in typed ``array`` columns
(times as float64, NaN for None), its lease id and end reason in lists (one object each, the
lease id the same the cache's indexes key by), its conversation and request ids packed into
16-byte slots (``id_rows``), its node id and incarnation as numbers into a table of the few
distinct names, and its two blobs (the packed handle, then the checkpoint hashes) side by side
in one ``bytearray`` arena. Since the store hands out a copy on every read, nothing outside
sees this: a read builds a new ``Lease`` from the row, a write overwrites the row.

Rows of deleted leases are reused. A rewrite whose blobs fit the row's slot in the arena is
written in place (a claim, a renewal); a larger one moves to the arena's end, and the arena is
compacted once more than half of it is dead.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Iterator

from kvbroker.controlplane.records.model import Lease, kv_handle
from kvbroker.controlplane.storage.id_rows import IdColumn

_NONE = math.nan
# Compacting is a copy of the live bytes, so it waits for at least this much dead space.
_MIN_COMPACT = 1 << 20


def _time(value: float | None) -> float:
    return _NONE if value is None else value


def _or_none(value: float) -> float | None:
    return None if value != value else value  # noqa: PLR0124 (NaN: None)


class LeaseRows:
    """Leases by id, each one row of the columns below."""

    def __init__(self) -> None:
        self._row: dict[str, int] = {}
        self._free: list[int] = []
        self._names: list[str] = []
        self._name_number: dict[str, int] = {}
        # strings, one object a lease ("" for a free row)
        self._lease_id: list[str] = []
        self._end_reason: list[str] = []
        # ids packed in slots (``id_rows``), "" for a free row
        self._conversation_id = IdColumn()
        self._request_id = IdColumn()
        # numbers
        self._node = array("I")
        self._incarnation = array("I")
        self._epoch = array("q")
        self._state = array("b")
        self._end_cause = array("b")
        self._stride = array("i")
        self._tokens = array("q")
        self._blocks = array("q")
        self._generation = array("q")
        # times, NaN for None
        self._grant = array("d")
        self._renew = array("d")
        self._expire = array("d")
        self._end = array("d")
        self._claim_expire = array("d")
        # the arena: a row's packed handle, then its checkpoints, at its offset
        self._arena = bytearray()
        self._offset = array("Q")
        self._capacity = array("I")
        self._handle_len = array("I")
        self._checkpoints_len = array("I")
        self._used = 0  # bytes of the arena that rows in use hold

    def __len__(self) -> int:
        return len(self._row)

    def __contains__(self, lease_id: str) -> bool:
        return lease_id in self._row

    def keys(self) -> Iterator[str]:
        """The lease ids (with ``[]``, ``dict(rows)`` is a snapshot of the leases)."""
        return iter(self._row)

    def __getitem__(self, lease_id: str) -> Lease:
        """A new ``Lease`` from the row of ``lease_id`` (KeyError: none)."""
        return self._lease(self._row[lease_id])

    def get(self, lease_id: str) -> Lease | None:
        """A new ``Lease`` from the row of ``lease_id`` (None: none)."""
        row = self._row.get(lease_id)
        return None if row is None else self._lease(row)

    def row(self, lease_id: str) -> int | None:
        """The row number of ``lease_id`` (None: none); valid until the lease is deleted."""
        return self._row.get(lease_id)

    def at(self, row: int) -> Lease:
        """A new ``Lease`` from ``row`` (a row in use)."""
        return self._lease(row)

    def lease_id_at(self, row: int) -> str:
        return self._lease_id[row]

    def request_id_at(self, row: int) -> str:
        return self._request_id[row]

    def state_at(self, row: int) -> int:
        return self._state[row]

    def node_id(self, lease_id: str) -> str:
        return self._names[self._node[self._row[lease_id]]]

    def conversation_id(self, lease_id: str) -> str:
        return self._conversation_id[self._row[lease_id]]

    def request_id(self, lease_id: str) -> str:
        return self._request_id[self._row[lease_id]]

    # ------------------------------------------------------------ writes

    def put(self, lease: Lease) -> str:
        """Sets the row of ``lease.lease_id``; returns the id as kept (an update keeps the
        first string, so the indexes that key by it share one object)."""
        row = self._row.get(lease.lease_id)
        if row is None:
            row = self._new_row(lease.lease_id)
        handle = lease.handle
        self._conversation_id[row] = lease.conversation_id
        self._request_id[row] = handle.remote_request_id
        self._end_reason[row] = lease.end_reason
        self._node[row] = self._number(lease.node_id)
        self._incarnation[row] = self._number(lease.node_incarnation)
        self._epoch[row] = lease.epoch
        self._state[row] = lease.state
        self._end_cause[row] = lease.end_cause
        self._stride[row] = lease.block_hash_stride
        self._tokens[row] = lease.token_count
        self._blocks[row] = handle.block_count
        self._generation[row] = handle.registration_generation
        self._grant[row] = _time(lease.grant_time)
        self._renew[row] = _time(lease.renew_time)
        self._expire[row] = _time(lease.expire_time)
        self._end[row] = _time(lease.end_time)
        self._claim_expire[row] = _time(lease.claim_expire_time)
        self._store_blobs(row, handle.packed, lease.checkpoints)
        return self._lease_id[row]

    def pop(self, lease_id: str) -> Lease | None:
        """Deletes the row of ``lease_id``, returning it as it was (None: none)."""
        row = self._row.pop(lease_id, None)
        if row is None:
            return None
        lease = self._lease(row)
        self._used -= self._capacity[row]
        self._capacity[row] = 0
        self._handle_len[row] = 0
        self._checkpoints_len[row] = 0
        self._lease_id[row] = self._conversation_id[row] = ""
        self._request_id[row] = self._end_reason[row] = ""
        self._free.append(row)
        self._maybe_compact()
        return lease

    # ------------------------------------------------------------ inside

    def _lease(self, row: int) -> Lease:
        names = self._names
        offset = self._offset[row]
        middle = offset + self._handle_len[row]
        arena = self._arena
        return Lease(
            self._lease_id[row],
            self._conversation_id[row],
            names[self._node[row]],
            names[self._incarnation[row]],
            self._epoch[row],
            kv_handle(
                self._request_id[row],
                self._blocks[row],
                bytes(arena[offset:middle]),
                self._generation[row],
            ),
            bytes(arena[middle : middle + self._checkpoints_len[row]]),
            self._stride[row],
            self._tokens[row],
            self._state[row],  # type: ignore[arg-type]  # an enum's int, as protobuf's
            self._end_cause[row],  # type: ignore[arg-type]
            self._end_reason[row],
            _or_none(self._grant[row]),
            _or_none(self._renew[row]),
            _or_none(self._expire[row]),
            _or_none(self._end[row]),
            _or_none(self._claim_expire[row]),
        )

    def _number(self, name: str) -> int:
        number = self._name_number.get(name)
        if number is None:
            number = self._name_number[name] = len(self._names)
            self._names.append(name)
        return number

    def _new_row(self, lease_id: str) -> int:
        if self._free:
            row = self._free.pop()
            self._lease_id[row] = lease_id
        else:
            row = len(self._lease_id)
            self._lease_id.append(lease_id)
            self._end_reason.append("")
            self._conversation_id.append("")
            self._request_id.append("")
            for numbers in (
                self._node,
                self._incarnation,
                self._epoch,
                self._state,
                self._end_cause,
                self._stride,
                self._tokens,
                self._blocks,
                self._generation,
                self._offset,
                self._capacity,
                self._handle_len,
                self._checkpoints_len,
            ):
                numbers.append(0)
            for times in (self._grant, self._renew, self._expire, self._end, self._claim_expire):
                times.append(_NONE)
        self._row[lease_id] = row
        return row

    def _store_blobs(self, row: int, handle: bytes, checkpoints: bytes) -> None:
        size = len(handle) + len(checkpoints)
        capacity = self._capacity[row]
        if size > capacity:
            self._used += size - capacity
            self._capacity[row] = size
            self._offset[row] = len(self._arena)
            self._arena += handle
            self._arena += checkpoints
        else:
            offset = self._offset[row]
            middle = offset + len(handle)
            self._arena[offset:middle] = handle
            self._arena[middle : middle + len(checkpoints)] = checkpoints
        self._handle_len[row] = len(handle)
        self._checkpoints_len[row] = len(checkpoints)
        self._maybe_compact()

    def _maybe_compact(self) -> None:
        dead = len(self._arena) - self._used
        if dead > _MIN_COMPACT and dead > self._used:
            self._compact()

    def _compact(self) -> None:
        """Copies the rows' slots to a new arena, end to end (each slot cut to its blobs)."""
        arena = bytearray()
        old = self._arena
        for row in self._row.values():
            offset = self._offset[row]
            size = self._handle_len[row] + self._checkpoints_len[row]
            self._offset[row] = len(arena)
            self._capacity[row] = size
            arena += old[offset : offset + size]
        self._arena = arena
        self._used = len(arena)
