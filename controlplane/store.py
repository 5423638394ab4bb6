"""Where the registry keeps nodes, conversations and leases.

One interface; the in-memory store is the default (nothing else to start), the etcd store
(``controlplane.etcd_store``) spans machines. Records are the proto messages, so any store can
serialise them as they are. Every store hands out copies: callers put a record back after
changing it. The registry serialises its mutations and ends each with ``commit()``, which makes
the puts since the last commit durable as one unit (a no-op in memory).
"""

from __future__ import annotations

import sys
from collections import defaultdict
from collections.abc import Iterable, Iterator
from typing import Protocol

from sortedcontainers import SortedList

from kvbroker.v1 import lease_pb2, node_pb2

LIVE_STATES = frozenset({lease_pb2.LEASE_STATE_ACTIVE, lease_pb2.LEASE_STATE_CLAIMED})


class Store(Protocol):
    async def get_node(self, node_id: str) -> node_pb2.Node | None: ...
    async def put_node(self, node: node_pb2.Node, durable: bool = True) -> None: ...
    async def list_nodes(self) -> list[node_pb2.Node]: ...

    async def get_conversation(self, conversation_id: str) -> lease_pb2.Conversation | None: ...
    async def put_conversation(self, conversation: lease_pb2.Conversation) -> None: ...
    async def delete_conversation(self, conversation_id: str) -> None: ...
    async def list_conversations(self) -> Iterable[lease_pb2.Conversation]: ...

    async def get_lease(self, lease_id: str) -> lease_pb2.Lease | None: ...
    async def put_lease(self, lease: lease_pb2.Lease, durable: bool = True) -> None:
        """``durable=False``: soft state (a claim) that a successor may lose; not written out."""
        ...

    async def delete_lease(self, lease_id: str) -> None: ...
    async def find_lease(self, node_id: str, remote_request_id: str) -> lease_pb2.Lease | None:
        """The lease a node holds for one of its engine's requests, if any."""
        ...

    async def live_leases_of_node(self, node_id: str) -> list[lease_pb2.Lease]: ...
    def live_lease_ids(self, node_id: str) -> set[str]:
        """Ids of the node's live leases, from memory (a replay compares 100k of them)."""
        ...

    async def list_leases(
        self, node_id: str = "", conversation_id: str = "", after: str = ""
    ) -> Iterable[lease_pb2.Lease]:
        """Leases in lease id order after ``after``, optionally of one node or one
        conversation; parsed as the caller reads on."""
        ...

    async def commit(self) -> None:
        """Makes the changes since the last commit durable, all or none; raises
        ``StoreUnavailable`` when it cannot (the caller's view is then ahead of the store)."""
        ...


class MemoryStore:
    """Dicts with the indexes the registry's hot paths need; no scans on hint or report.

    Leases and conversations are kept serialised: a parsed Lease costs ~3 KB of Python and upb
    objects, its bytes ~0.8 KB, and parsing one on access takes a few microseconds. Like any
    durable store, it hands out copies: a change exists once it is put back.
    """

    def __init__(self) -> None:
        self._nodes: dict[str, node_pb2.Node] = {}
        self._conversations: dict[str, bytes] = {}
        self._leases: dict[str, bytes] = {}
        # Lease ids in order, for listings that page (ids sort in grant order): ~8 bytes a
        # lease, where a per-lease key tuple cost ~170.
        self._lease_order: SortedList[str] = SortedList()
        # node id -> remote request id -> lease id (all the node's leases, live or ended)
        self._by_node: defaultdict[str, dict[str, str]] = defaultdict(dict)
        self._live_by_node: defaultdict[str, set[str]] = defaultdict(set)

    def adopt(self, other: MemoryStore) -> None:
        """Takes over another memory store's records and indexes (a reload's result)."""
        self._nodes, self._conversations, self._leases = (
            other._nodes,
            other._conversations,
            other._leases,
        )
        self._lease_order, self._by_node, self._live_by_node = (
            other._lease_order,
            other._by_node,
            other._live_by_node,
        )

    async def get_node(self, node_id: str) -> node_pb2.Node | None:
        return self._nodes.get(node_id)

    async def put_node(self, node: node_pb2.Node, durable: bool = True) -> None:
        self._nodes[node.spec.node_id] = node

    async def list_nodes(self) -> list[node_pb2.Node]:
        return [self._nodes[k] for k in sorted(self._nodes)]

    async def get_conversation(self, conversation_id: str) -> lease_pb2.Conversation | None:
        raw = self._conversations.get(conversation_id)
        return lease_pb2.Conversation.FromString(raw) if raw is not None else None

    async def put_conversation(self, conversation: lease_pb2.Conversation) -> None:
        self._conversations[conversation.conversation_id] = conversation.SerializeToString()

    async def delete_conversation(self, conversation_id: str) -> None:
        self._conversations.pop(conversation_id, None)

    async def list_conversations(self) -> Iterable[lease_pb2.Conversation]:
        return (lease_pb2.Conversation.FromString(raw) for raw in self._conversations.values())

    async def get_lease(self, lease_id: str) -> lease_pb2.Lease | None:
        raw = self._leases.get(lease_id)
        return lease_pb2.Lease.FromString(raw) if raw is not None else None

    async def put_lease(self, lease: lease_pb2.Lease, durable: bool = True) -> None:
        self._keep_lease(lease, lease.SerializeToString())

    def _keep_lease(self, lease: lease_pb2.Lease, raw: bytes) -> None:
        lease_id = lease.lease_id
        node_id = sys.intern(lease.node_id)  # one string per node, not one per lease
        if lease_id not in self._leases:
            # Indexed once, with one string object for the id everywhere: an update (a claim,
            # a renewal) leaves the indexes' strings as they are instead of adding copies.
            self._lease_order.add(lease_id)
            self._by_node[node_id][lease.handle.remote_request_id] = lease_id
        self._leases[lease_id] = raw
        live = self._live_by_node[node_id]
        if lease.state in LIVE_STATES:
            live.add(lease_id)
        else:
            live.discard(lease_id)

    async def delete_lease(self, lease_id: str) -> None:
        self._forget_lease(lease_id)

    def _forget_lease(self, lease_id: str) -> None:
        raw = self._leases.pop(lease_id, None)
        if raw is None:
            return
        self._lease_order.discard(lease_id)
        lease = lease_pb2.Lease.FromString(raw)  # once per lease: cheaper than keeping keys
        requests = self._by_node[lease.node_id]
        if requests.get(lease.handle.remote_request_id) == lease_id:
            del requests[lease.handle.remote_request_id]
        self._live_by_node[lease.node_id].discard(lease_id)

    async def find_lease(self, node_id: str, remote_request_id: str) -> lease_pb2.Lease | None:
        requests = self._by_node.get(node_id)
        lease_id = requests.get(remote_request_id) if requests is not None else None
        return await self.get_lease(lease_id) if lease_id is not None else None

    async def live_leases_of_node(self, node_id: str) -> list[lease_pb2.Lease]:
        return [
            lease_pb2.Lease.FromString(self._leases[i])
            for i in sorted(self._live_by_node.get(node_id, ()))
        ]

    def live_lease_ids(self, node_id: str) -> set[str]:
        return set(self._live_by_node.get(node_id, ()))

    async def list_leases(
        self, node_id: str = "", conversation_id: str = "", after: str = ""
    ) -> Iterable[lease_pb2.Lease]:
        ids: Iterable[str]
        if node_id:
            ids = sorted(i for i in self._by_node.get(node_id, {}).values() if i > after)
        else:
            ids = self._lease_order.irange(minimum=after, inclusive=(False, True))
        return self._parsed(ids, conversation_id)

    def _parsed(self, ids: Iterable[str], conversation_id: str) -> Iterator[lease_pb2.Lease]:
        for lease_id in ids:
            lease = lease_pb2.Lease.FromString(self._leases[lease_id])
            if not conversation_id or lease.conversation_id == conversation_id:
                yield lease

    async def commit(self) -> None:
        return None  # every change is already all there is
