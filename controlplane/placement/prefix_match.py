"""A fork's match: the live lease whose retained prefix its prompt starts with, found by
content (the prefix index) and pinned for the reader (docs/design.md, "Forks: reuse by
content").

The asker is a prefill engine with a turn that has no handle of its own (a sub-agent under a
new session id): it sends its prompt's prefix hashes at blocks 2^k - 1, and gets the lease of
the longest hit that it may read, with a read pin, or a typed reason for none
(``NoReuseReason``). The lease stays its conversation's: a pin changes no state, so the
parent's own next turn is still REUSE, and N forks may pin it at once.

What may be matched: a live lease of the asker's tenant, model and block size (the index's
scope); not CLAIMED (a claimed read frees the blocks on its completion, which a fork must not
race); held by a serving node that has replayed to this leader and whose connector the asker's
can read from; never the asker's own conversation's, and nothing at all when that conversation
has a live lease of its own (reuse by session id decides for it: no double work). Among equal
hits: the newest epoch, then the latest grant.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvbroker.common.rules import routing
from kvbroker.common.rules.routing import LIVE_LEASE_STATES
from kvbroker.common.rules.tenants import tenant_of
from kvbroker.controlplane.context import RegistryContext
from kvbroker.controlplane.errors import NodeNotRegistered, NotAPrefillNode
from kvbroker.controlplane.lessor.leases import Leases
from kvbroker.controlplane.lessor.prefix_index import Scope
from kvbroker.controlplane.records.answers import LeaseAnswer
from kvbroker.controlplane.records.model import CLAIMED, Lease
from kvbroker.controlplane.records.requests import PrefixProbe
from kvbroker.controlplane.sessions.nodes import NodeRuntime, NodeSessions
from kvbroker.v1 import registry_pb2

NoReuseReason = registry_pb2.NoReuseReason


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """MatchPrefix's answer: the pinned lease (None: no match, and why)."""

    lease: LeaseAnswer | None
    matched_blocks: int = 0
    no_reuse: NoReuseReason = registry_pb2.NO_REUSE_REASON_UNSPECIFIED
    reason: str = ""
    # The reader's pin on the lease (to end when its read has).
    pin_id: str = ""


def _no_match(no_reuse: NoReuseReason, reason: str) -> PrefixMatch:
    return PrefixMatch(None, 0, no_reuse, reason)


class PrefixMatches:
    def __init__(self, context: RegistryContext, nodes: NodeSessions, leases: Leases) -> None:
        self._store = context.store
        self._metrics = context.metrics
        self._nodes = nodes
        self._leases = leases

    async def match(self, probe: PrefixProbe) -> PrefixMatch:
        """The longest readable lease sharing the prompt's prefix, pinned for the asking
        node (call under the lock)."""
        node_id, conversation_id = probe.node_id, probe.conversation_id
        asker = self._asker(node_id, probe.model)
        if conversation_id and await self._has_own_lease(conversation_id):
            return _no_match(
                registry_pb2.NO_REUSE_REASON_OWN_CONVERSATION,
                f"conversation {conversation_id!r} has a live lease of its own",
            )
        scope = Scope(tenant_of(conversation_id), asker.model, probe.block_size)
        refusal: PrefixMatch | None = None
        for hit in self._leases.prefix_index.hits(scope, list(probe.probes)):
            readable: list[Lease] = []
            for lease_id in hit.lease_ids:
                lease = await self._store.get_lease(lease_id)
                if lease is None:
                    continue
                await self._leases.expire_if_due(lease)
                why = self._refusal(lease, conversation_id, scope.tenant, asker)
                if why is None:
                    readable.append(lease)
                elif refusal is None:
                    refusal = why
            if readable:
                chosen = max(readable, key=lambda lease: (lease.epoch, lease.grant_time or 0.0))
                pin_id = await self._leases.pin(chosen, node_id)
                self._metrics.lease_event("prefix_match").inc()
                return PrefixMatch(self._leases.view(chosen), hit.blocks, pin_id=pin_id)
        if refusal is not None:
            return refusal
        return _no_match(
            registry_pb2.NO_REUSE_REASON_NO_PREFIX_MATCH,
            "no live lease of this tenant, model and block size shares the prompt's prefix",
        )

    def _asker(self, node_id: str, model: str) -> NodeRuntime:
        node = self._nodes.runtime.get(node_id)
        if node is None or not routing.routable(node, model):
            raise NodeNotRegistered(f"node {node_id!r} is not a ready node serving model {model!r}")
        if not node.prefills:
            raise NotAPrefillNode(f"node {node_id!r} does not prefill")
        return node

    async def _has_own_lease(self, conversation_id: str) -> bool:
        conversation = await self._store.get_conversation(conversation_id)
        if conversation is None or not conversation.lease_id:
            return False
        lease = await self._store.get_lease(conversation.lease_id)
        if lease is None:
            return False
        await self._leases.expire_if_due(lease)
        return lease.state in LIVE_LEASE_STATES

    def _refusal(
        self, lease: Lease, conversation_id: str, tenant: str, asker: NodeRuntime
    ) -> PrefixMatch | None:
        """Why the asker may not read this hit (None: it may)."""
        if tenant_of(lease.conversation_id) != tenant or lease.conversation_id == conversation_id:
            return _no_match(
                registry_pb2.NO_REUSE_REASON_NO_PREFIX_MATCH, "not a lease this turn may share"
            )
        if lease.state not in LIVE_LEASE_STATES or lease.state == CLAIMED:
            return _no_match(
                registry_pb2.NO_REUSE_REASON_LEASE_NOT_LIVE,
                f"lease {lease.lease_id} has ended or a read of it is in flight",
            )
        holder = self._nodes.runtime.get(lease.node_id)
        if holder is None or holder.state not in routing.SERVING_STATES or not holder.synced:
            return _no_match(
                registry_pb2.NO_REUSE_REASON_HOLDER_UNAVAILABLE,
                f"the holder of lease {lease.lease_id} is not serving or has not replayed",
            )
        if not routing.can_transfer(asker.spec, holder.spec):
            return _no_match(
                registry_pb2.NO_REUSE_REASON_VERSION_MISMATCH,
                f"node {asker.node_id!r} cannot read from {holder.node_id!r}",
            )
        stale = routing.registered_anew(
            lease.lease_id, lease.handle.registration_generation, holder.spec
        )
        if stale is not None:
            return _no_match(stale.no_reuse, stale.reason)
        return None
