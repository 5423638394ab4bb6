"""Reading leases and conversations: one by id (or a conversation's live lease), with the
typed error a caller gets when there is none, and ``ListLeases`` a page at a time.

Apart from the lessor because it only reads and changes nothing: listing pages the store
from the token on (never a scan of every lease per page), finds a conversation's live lease
without a scan, and bounds each answer's size.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from kvbroker.common.routing import LIVE_LEASE_STATES
from kvbroker.controlplane.errors import ConversationNotFound, LeaseNotFound, NoLiveLease
from kvbroker.controlplane.model import Conversation, Lease
from kvbroker.controlplane.store import Store
from kvbroker.controlplane.validation import Validation
from kvbroker.v1 import lease_pb2


class LeaseReads:
    def __init__(
        self,
        store: Store,
        validate: Validation,
        view: Callable[[Lease], lease_pb2.Lease],
        answer_bytes: int,
    ) -> None:
        self._store = store
        self._validate = validate
        # The lease as an answer, its time left as of now (``Leases.view``).
        self._view = view
        # A page stops growing once past this (``RegistryConfig.max_answer_bytes``).
        self._answer_bytes = answer_bytes

    async def lease(self, lease_id: str) -> Lease:
        lease = await self._store.get_lease(self._validate.id(lease_id, "lease_id"))
        if lease is None:
            raise LeaseNotFound(f"lease {lease_id!r} does not exist (or ended long ago)")
        return lease

    async def conversation(self, conversation_id: str) -> Conversation:
        conversation = await self._store.get_conversation(
            self._validate.id(conversation_id, "conversation_id")
        )
        if conversation is None:
            raise ConversationNotFound(f"conversation {conversation_id!r} is unknown")
        return conversation

    async def current_live(self, conversation_id: str) -> Lease:
        conversation = await self.conversation(conversation_id)
        lease = (
            await self._store.get_lease(conversation.lease_id) if conversation.lease_id else None
        )
        if lease is None or lease.state not in LIVE_LEASE_STATES:
            raise NoLiveLease(f"conversation {conversation_id!r} has no live lease")
        return lease

    async def by_id_or_conversation(self, lease_id: str, conversation_id: str) -> Lease:
        if conversation_id:
            return await self.current_live(conversation_id)
        return await self.lease(lease_id)

    async def page(
        self,
        node_id: str,
        conversation_id: str,
        states: Sequence[int],
        page_size: int,
        page_token: str,
    ) -> tuple[list[lease_pb2.Lease], str]:
        self._validate.list_leases(node_id, conversation_id, states, page_size)
        wanted = set(states) or LIVE_LEASE_STATES
        limit = page_size or 100
        page: list[lease_pb2.Lease] = []
        leases: Iterable[Lease]
        if conversation_id and wanted <= LIVE_LEASE_STATES:
            # A conversation has at most one live lease, its current one: no scan.
            leases = await self._current_leases(conversation_id, node_id, page_token)
        else:
            leases = await self._store.list_leases(node_id, conversation_id, after=page_token)
        page_bytes = 0
        for lease in leases:
            if lease.state not in wanted:
                continue
            if len(page) == limit or page_bytes > self._answer_bytes:
                return page, page[-1].lease_id
            page.append(self._view(lease))
            page_bytes += page[-1].ByteSize()
        return page, ""

    async def _current_leases(self, conversation_id: str, node_id: str, after: str) -> list[Lease]:
        conversation = await self._store.get_conversation(conversation_id)
        if conversation is None or conversation.lease_id <= after:
            return []
        lease = await self._store.get_lease(conversation.lease_id)
        return [lease] if lease is not None and node_id in ("", lease.node_id) else []
