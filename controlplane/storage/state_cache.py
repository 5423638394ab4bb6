"""The registry's state in memory: every record, as a plain object (``controlplane.records.model``),
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
from collections.abc import Iterable, Iterator
from enum import Enum
from typing import TypeVar

from sortedcontainers import SortedList

from kvbroker.common.rules.routing import LIVE_LEASE_STATES
from kvbroker.controlplane.records import codec
from kvbroker.controlplane.records.model import Conversation, Lease, Node, Record
from kvbroker.controlplane.storage.lease_rows import LeaseRows


class RecordKind(Enum):
    """What a record is; its value is the name backends key it under."""

    NODE = "node"
    CONVERSATION = "conversation"
    LEASE = "lease"


class StateCache:
    def __init__(self) -> None:
        self._nodes: dict[str, Node] = {}
        self._conversations: dict[str, Conversation] = {}
        # Leases as rows of columns (``lease_rows``): a read builds the copy it hands out.
        self._leases = LeaseRows()
        # Lease ids in order, for listings that page (ids sort in grant order): ~8 bytes a
        # lease, where a per-lease key tuple cost ~170.
        self._lease_order: SortedList[str] = SortedList()
        # node id -> remote request id -> lease id (all the node's leases, live or ended)
        self._by_node: defaultdict[str, dict[str, str]] = defaultdict(dict)
        self._live_by_node: defaultdict[str, set[str]] = defaultdict(set)

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
            _set(self._conversations, ident, record)

    def _keep_lease(self, lease: Lease) -> None:
        node_id = lease.node_id
        new = lease.lease_id not in self._leases
        # Indexed once, with one string object for the id everywhere: an update (a claim,
        # a renewal) leaves the indexes' strings as they are.
        lease_id = self._leases.put(lease)
        if new:
            self._lease_order.add(lease_id)
            self._by_node[node_id][lease.handle.remote_request_id] = lease_id
        live = self._live_by_node[node_id]
        if lease.state in LIVE_LEASE_STATES:
            live.add(lease_id)
        else:
            live.discard(lease_id)

    def _forget_lease(self, lease_id: str) -> None:
        lease = self._leases.pop(lease_id)
        if lease is None:
            return
        self._lease_order.discard(lease_id)
        requests = self._by_node[lease.node_id]
        request_id = lease.handle.remote_request_id
        if requests.get(request_id) == lease_id:
            del requests[request_id]
        self._live_by_node[lease.node_id].discard(lease_id)

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
        conversation = self._conversations.get(conversation_id)
        return conversation.copy() if conversation is not None else None

    def conversations(self) -> Iterator[Conversation]:
        return (conversation.copy() for conversation in self._conversations.values())

    def lease(self, lease_id: str) -> Lease | None:
        return self._leases.get(lease_id)

    def find_lease(self, node_id: str, remote_request_id: str) -> Lease | None:
        requests = self._by_node.get(node_id)
        lease_id = requests.get(remote_request_id) if requests is not None else None
        return self.lease(lease_id) if lease_id is not None else None

    def live_leases_of_node(self, node_id: str) -> list[Lease]:
        leases = self._leases
        return [leases[i] for i in sorted(self._live_by_node.get(node_id, ()))]

    def live_lease_ids(self, node_id: str) -> set[str]:
        return set(self._live_by_node.get(node_id, ()))

    def live_lease_count(self, node_id: str) -> int:
        live = self._live_by_node.get(node_id)
        return len(live) if live is not None else 0

    def leases(
        self, node_id: str = "", conversation_id: str = "", after: str = ""
    ) -> Iterator[Lease]:
        ids: Iterable[str]
        if node_id:
            ids = sorted(i for i in self._by_node.get(node_id, {}).values() if i > after)
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


R = TypeVar("R")


def _set(records: dict[str, R], ident: str, record: R | None) -> None:
    if record is None:
        records.pop(ident, None)
    else:
        records[ident] = record
