"""Where the registry keeps nodes, conversations and leases.

One interface; the in-memory store is the default (nothing else to start). Records are the
proto messages themselves, so a durable store can serialise them as they are. Callers put a
record back after changing it; the memory store hands out its own objects, so callers must not
keep a record across an ``await`` they do not own (the registry serialises its mutations).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from typing import Protocol

from kvbroker.v1 import lease_pb2, node_pb2

LIVE_STATES = frozenset({lease_pb2.LEASE_STATE_ACTIVE, lease_pb2.LEASE_STATE_CLAIMED})


class Store(Protocol):
    async def get_node(self, node_id: str) -> node_pb2.Node | None: ...
    async def put_node(self, node: node_pb2.Node) -> None: ...
    async def list_nodes(self) -> list[node_pb2.Node]: ...

    async def get_conversation(self, conversation_id: str) -> lease_pb2.Conversation | None: ...
    async def put_conversation(self, conversation: lease_pb2.Conversation) -> None: ...
    async def delete_conversation(self, conversation_id: str) -> None: ...

    async def get_lease(self, lease_id: str) -> lease_pb2.Lease | None: ...
    async def put_lease(self, lease: lease_pb2.Lease) -> None: ...
    async def delete_lease(self, lease_id: str) -> None: ...
    async def find_lease(self, node_id: str, remote_request_id: str) -> lease_pb2.Lease | None:
        """The lease a node holds for one of its engine's requests, if any."""
        ...

    async def live_leases_of_node(self, node_id: str) -> list[lease_pb2.Lease]: ...
    async def list_leases(
        self, node_id: str = "", conversation_id: str = ""
    ) -> Iterable[lease_pb2.Lease]:
        """Leases in lease id order, optionally of one node or one conversation."""
        ...


class MemoryStore:
    """Dicts with the indexes the registry's hot paths need; no scans on hint or report."""

    def __init__(self) -> None:
        self._nodes: dict[str, node_pb2.Node] = {}
        self._conversations: dict[str, lease_pb2.Conversation] = {}
        self._leases: dict[str, lease_pb2.Lease] = {}
        self._by_request: dict[tuple[str, str], str] = {}
        self._live_by_node: defaultdict[str, set[str]] = defaultdict(set)

    async def get_node(self, node_id: str) -> node_pb2.Node | None:
        return self._nodes.get(node_id)

    async def put_node(self, node: node_pb2.Node) -> None:
        self._nodes[node.spec.node_id] = node

    async def list_nodes(self) -> list[node_pb2.Node]:
        return [self._nodes[k] for k in sorted(self._nodes)]

    async def get_conversation(self, conversation_id: str) -> lease_pb2.Conversation | None:
        return self._conversations.get(conversation_id)

    async def put_conversation(self, conversation: lease_pb2.Conversation) -> None:
        self._conversations[conversation.conversation_id] = conversation

    async def delete_conversation(self, conversation_id: str) -> None:
        self._conversations.pop(conversation_id, None)

    async def get_lease(self, lease_id: str) -> lease_pb2.Lease | None:
        return self._leases.get(lease_id)

    async def put_lease(self, lease: lease_pb2.Lease) -> None:
        self._leases[lease.lease_id] = lease
        self._by_request[(lease.node_id, lease.handle.remote_request_id)] = lease.lease_id
        live = self._live_by_node[lease.node_id]
        if lease.state in LIVE_STATES:
            live.add(lease.lease_id)
        else:
            live.discard(lease.lease_id)

    async def delete_lease(self, lease_id: str) -> None:
        lease = self._leases.pop(lease_id, None)
        if lease is None:
            return
        key = (lease.node_id, lease.handle.remote_request_id)
        if self._by_request.get(key) == lease_id:
            del self._by_request[key]
        self._live_by_node[lease.node_id].discard(lease_id)

    async def find_lease(self, node_id: str, remote_request_id: str) -> lease_pb2.Lease | None:
        lease_id = self._by_request.get((node_id, remote_request_id))
        return self._leases.get(lease_id) if lease_id is not None else None

    async def live_leases_of_node(self, node_id: str) -> list[lease_pb2.Lease]:
        return [self._leases[i] for i in sorted(self._live_by_node.get(node_id, ()))]

    async def list_leases(
        self, node_id: str = "", conversation_id: str = ""
    ) -> Iterable[lease_pb2.Lease]:
        return (
            lease
            for _, lease in sorted(self._leases.items())
            if (not node_id or lease.node_id == node_id)
            and (not conversation_id or lease.conversation_id == conversation_id)
        )
