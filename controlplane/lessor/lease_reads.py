"""Reading leases and conversations: one by id (or a conversation's live lease), with the
typed error a caller gets when there is none, and ``ListLeases`` a page at a time.

Apart from the lessor because it only reads and changes nothing: listing pages the store
from the token on (never a scan of every lease per page), finds a conversation's live lease
without a scan, and bounds each answer's size.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from kvbroker.common.rules.routing import LIVE_LEASE_STATES
from kvbroker.controlplane.context import RegistryContext
from kvbroker.controlplane.errors import ConversationNotFound, LeaseNotFound, NoLiveLease
from kvbroker.controlplane.records import codec
from kvbroker.controlplane.records.answers import LeaseAnswer
from kvbroker.controlplane.records.model import Conversation, Lease
from kvbroker.controlplane.records.requests import LeaseListing


class LeaseReads:
    def __init__(self, context: RegistryContext, view: Callable[[Lease], LeaseAnswer]) -> None:
        self._store = context.store
        self._validate = context.validate
        # The lease as an answer, its time left as of now (``Leases.view``).
        self._view = view
        # A page stops growing once past this (``RegistryConfig.max_answer_bytes``).
        self._answer_bytes = context.config.max_answer_bytes

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

    async def page(self, listing: LeaseListing) -> tuple[list[LeaseAnswer], str]:
        self._validate.list_leases(listing)
        node_id, conversation_id, page_token = (
            listing.node_id,
            listing.conversation_id,
            listing.page_token,
        )
        wanted = set(listing.states) or LIVE_LEASE_STATES
        limit = listing.page_size or 100
        page: list[LeaseAnswer] = []
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
            # Counted as stored: the answer adds a few bytes of time left to each, well
            # within the budget's margin below gRPC's limit.
            page_bytes += len(codec.lease_bytes(lease))
        return page, ""

    async def _current_leases(self, conversation_id: str, node_id: str, after: str) -> list[Lease]:
        conversation = await self._store.get_conversation(conversation_id)
        if conversation is None or conversation.lease_id <= after:
            return []
        lease = await self._store.get_lease(conversation.lease_id)
        return [lease] if lease is not None and node_id in ("", lease.node_id) else []
