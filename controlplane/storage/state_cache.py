"""The registry's state in memory: every record (``controlplane.records.model``), nodes as
objects, leases and conversations as rows of columns (``lease_rows``, ``conversation_rows``),
with the indexes its hot paths need.

Every read hands out a copy (``copy()``: one object, its fields immutable), and the store puts
copies in (``CachedStore``), so no two callers share a record and a caller's change exists
only once it is put back; the cache never changes a record it holds, it replaces it. Every
change comes in through ``put``, whether it is the registry's own write, an undo, or a
backend's load or watch (``apply``, which decodes the stored bytes), so the indexes have one
way in and are derived from the records alone. The live leases of each node are one index,
and every count of them is its size.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from enum import Enum
from typing import TypeVar

from sortedcontainers import SortedList

from kvbroker.common.rules.routing import LIVE_LEASE_STATES
from kvbroker.controlplane.records import codec
from kvbroker.controlplane.records.model import Conversation, Lease, Node, Record
from kvbroker.controlplane.storage.conversation_rows import ConversationRows
from kvbroker.controlplane.storage.id_rows import RowTable
from kvbroker.controlplane.storage.lease_rows import LeaseRows


class RecordKind(Enum):
    """What a record is; its value is the name backends key it under."""

    NODE = "node"
    CONVERSATION = "conversation"
    LEASE = "lease"


class StateCache:
    def __init__(self) -> None:
        self._nodes: dict[str, Node] = {}
        # Conversations as rows too (``conversation_rows``): a read builds its copy.
        self._conversations = ConversationRows()
        # Leases as rows of columns (``lease_rows``): a read builds the copy it hands out.
        self._leases = LeaseRows()
        # Lease ids in order, for listings that page (ids sort in grant order): ~8 bytes a
        # lease, where a per-lease key tuple cost ~170.
        self._lease_order: SortedList[str] = SortedList()
        # Row-number tables (``id_rows.RowTable``), not dicts and sets of strings: ~70 bytes
        # a lease less. node id -> remote request id's hash -> row (all the node's leases,
        # live or ended); node id -> row (its live leases).
        self._by_node: defaultdict[str, RowTable] = defaultdict(RowTable)
        self._live_by_node: defaultdict[str, RowTable] = defaultdict(RowTable)

    # ------------------------------------------------------------ writes

    def apply(self, kind: RecordKind, ident: str, raw: bytes | None) -> None:
        """Sets one record to its stored bytes ``raw`` (None: deletes it)."""
        self.put(kind, ident, None if raw is None else decode(kind, raw))

    def put(self, kind: RecordKind, ident: str, record: Record | None) -> None:
        """Sets one record (None: deletes it), keeping the indexes in step."""
        if kind is RecordKind.LEASE:
            if record is None:
                self._forget_lease(ident)
            else:
                assert isinstance(record, Lease)
                self._keep_lease(record)
        elif kind is RecordKind.NODE:
            assert record is None or isinstance(record, Node)
            _set(self._nodes, ident, record)
        else:
            assert record is None or isinstance(record, Conversation)
            if record is None:
                self._conversations.pop(ident)
            else:
                self._conversations.put(record)

    def _keep_lease(self, lease: Lease) -> None:
        node_id = lease.node_id
        leases = self._leases
        row = leases.row(lease.lease_id)
        live = lease.state in LIVE_LEASE_STATES
        # An update that leaves the lease as live or not, on its node, as it was (a renewal)
        # leaves the indexes as they are.
        indexed = (
            row is not None
            and leases.node_id(lease.lease_id) == node_id
            and (leases.state_at(row) in LIVE_LEASE_STATES) == live
        )
        lease_id = leases.put(lease)
        if indexed:
            return
        if row is None:
            row = leases.row(lease_id)
            assert row is not None
            self._lease_order.add(lease_id)
            request_id = lease.handle.remote_request_id
            self._by_node[node_id].put(hash(request_id), row, self._asks(request_id))
        live_rows = self._live_by_node[node_id]
        if live:
            live_rows.put(row, row, _any_row)
        else:
            live_rows.pop(row, _any_row)

    def _forget_lease(self, lease_id: str) -> None:
        row = self._leases.row(lease_id)
        if row is None:
            return
        lease = self._leases.pop(lease_id)
        assert lease is not None
        self._lease_order.discard(lease_id)
        request_id = lease.handle.remote_request_id
        # only where this lease is the one kept for its request id
        self._by_node[lease.node_id].pop(hash(request_id), row.__eq__)
        self._live_by_node[lease.node_id].pop(row, _any_row)

    def _asks(self, request_id: str) -> Callable[[int], bool]:
        """Whether a row's lease is for ``request_id`` (hashes may collide)."""
        leases = self._leases
        return lambda row: leases.request_id_at(row) == request_id

    # ------------------------------------------------------------ reads

    def record(self, kind: RecordKind, ident: str) -> Record | None:
        """A record as kept, not a copy (what an undo puts back; never to be changed)."""
        if kind is RecordKind.LEASE:
            return self._leases.get(ident)  # built from its row: no one else holds it
        if kind is RecordKind.NODE:
            return self._nodes.get(ident)
        return self._conversations.get(ident)

    def node(self, node_id: str) -> Node | None:
        node = self._nodes.get(node_id)
        return node.copy() if node is not None else None

    def nodes(self) -> list[Node]:
        return [self._nodes[k].copy() for k in sorted(self._nodes)]

    def conversation(self, conversation_id: str) -> Conversation | None:
        return self._conversations.get(conversation_id)  # built from its row

    def conversations(self) -> Iterator[Conversation]:
        return self._conversations.values()

    def lease(self, lease_id: str) -> Lease | None:
        return self._leases.get(lease_id)

    def find_lease(self, node_id: str, remote_request_id: str) -> Lease | None:
        requests = self._by_node.get(node_id)
        if requests is None:
            return None
        row = requests.get(hash(remote_request_id), self._asks(remote_request_id))
        return None if row is None else self._leases.at(row)

    def live_leases_of_node(self, node_id: str) -> list[Lease]:
        leases = self._leases
        return [leases[i] for i in sorted(self.live_lease_ids(node_id))]

    def live_lease_ids(self, node_id: str) -> set[str]:
        return self._ids(self._live_by_node.get(node_id))

    def _ids(self, table: RowTable | None) -> set[str]:
        leases = self._leases
        return set() if table is None else {leases.lease_id_at(row) for row in table.rows()}

    def live_lease_count(self, node_id: str) -> int:
        live = self._live_by_node.get(node_id)
        return len(live) if live is not None else 0

    def leases(
        self, node_id: str = "", conversation_id: str = "", after: str = ""
    ) -> Iterator[Lease]:
        ids: Iterable[str]
        if node_id:
            ids = sorted(i for i in self._ids(self._by_node.get(node_id)) if i > after)
        else:
            ids = self._lease_order.irange(minimum=after, inclusive=(False, True))
        return self._copies(ids, conversation_id)

    def _copies(self, ids: Iterable[str], conversation_id: str) -> Iterator[Lease]:
        leases = self._leases
        for lease_id in ids:
            if not conversation_id or leases.conversation_id(lease_id) == conversation_id:
                yield leases[lease_id]

    def counts(self) -> dict[str, int]:
        """Records of each kind, for logs."""
        return {
            "nodes": len(self._nodes),
            "conversations": len(self._conversations),
            "leases": len(self._leases),
        }


def decode(kind: RecordKind, raw: bytes) -> Record:
    """The record of ``kind`` in stored bytes."""
    if kind is RecordKind.LEASE:
        return codec.lease_of_bytes(raw)
    if kind is RecordKind.NODE:
        return codec.node_of_bytes(raw)
    return codec.conversation_of_bytes(raw)


def _any_row(row: int) -> bool:
    """A live table's key is the row itself: any row under it is the one sought."""
    return True


R = TypeVar("R")


def _set(records: dict[str, R], ident: str, record: R | None) -> None:
    if record is None:
        records.pop(ident, None)
    else:
        records[ident] = record
