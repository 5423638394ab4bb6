"""Routing hints: the routing rule (``kvbroker.common.routing``) applied to the registry's
state, by the leader (which may claim the lease it offers) and by a follower answering from its
cache while no leader can be reached (which may not).

The leader's hint goes on the planner's path (``controlplane.planner``), and to the prefill
node the planner chose: the least-loaded one the routing rule picks, or the one whose own
prefix cache holds the conversation's last prompt (``PrefillCaches``) when that is estimated
faster. A follower knows no such cache and keeps the routing rule's pick.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

from kvbroker.common import routing
from kvbroker.controlplane import planner
from kvbroker.controlplane.errors import NoLeader, NoReadyNode
from kvbroker.controlplane.idle_ttl import IdleTtl
from kvbroker.controlplane.leases import Leases
from kvbroker.controlplane.metrics import RegistryMetrics
from kvbroker.controlplane.model import Conversation, Lease
from kvbroker.controlplane.nodes import NodeRuntime, NodeSessions
from kvbroker.controlplane.planner import UNSAID, TurnRequest
from kvbroker.controlplane.prefill_caches import PrefillCaches
from kvbroker.controlplane.store import Store
from kvbroker.controlplane.turns import Turns
from kvbroker.v1 import registry_pb2

EXACT = registry_pb2.HINT_CONSISTENCY_EXACT
DEGRADED = registry_pb2.HINT_CONSISTENCY_DEGRADED


class Hints:
    def __init__(
        self,
        store: Store,
        metrics: RegistryMetrics,
        now: Callable[[], float],
        nodes: NodeSessions,
        leases: Leases,
        turns: Turns,
        idle_ttl: IdleTtl,
        planner_config: planner.PlannerConfig,
    ) -> None:
        self._store = store
        self._metrics = metrics
        self._now = now
        self._nodes = nodes
        self._leases = leases
        self._turns = turns
        self._idle_ttl = idle_ttl
        self._round_robin = itertools.count()
        self._planner = planner_config
        self.prefill_caches = PrefillCaches()

    async def hint(
        self,
        conversation_id: str,
        model: str,
        dry_run: bool,
        hint: registry_pb2.RoutingHint,
        asked: TurnRequest = UNSAID,
    ) -> None:
        """Writes one hint into ``hint`` (call under the lock); unless ``dry_run``, claims the
        lease it offers for a READ and counts the choice. The turn's path is the planner's."""
        started = self._now()
        try:
            routes = self._nodes.routes(model)
        except routing.NoReadyNode as error:
            raise NoReadyNode(error.message) from error
        conversation = (
            await self._store.get_conversation(conversation_id) if conversation_id else None
        )
        lease = await self._current_lease(conversation, claim=not dry_run)
        holder = self._nodes.runtime.get(lease.node_id) if lease is not None else None
        reuse = routing.reuse_decision(
            conversation_id, conversation, lease, holder, holder is not None and holder.synced
        )
        holder_id = conversation.decode_node_id if conversation is not None else ""
        prefill, decode = routing.choose(routes, next(self._round_robin), holder=holder_id)
        usable = lease if reuse.reuses else None
        plan = self._plan(conversation_id, model, usable, prefill, decode, asked)
        path = plan.path if plan is not None else planner.READ if usable else planner.RECOMPUTE
        if plan is not None:
            prefill = self._nodes.runtime[plan.prefill_node_id]
        if reuse.reuses and plan is not None and plan.path == planner.RECOMPUTE:
            why = (
                "recomputing was asked for"
                if asked.wanted == planner.RECOMPUTE
                else f"recomputing is estimated fastest ({plan.chosen.ttft_ms:.0f} ms)"
            )
            reuse = routing.Reuse(registry_pb2.HINT_DECISION_RECOMPUTE, why)
        if path == planner.READ and reuse.reuses and lease is not None and not dry_run:
            # Only a read needs the blocks kept for it. A DECODE_LOCAL turn reads nothing:
            # the decode node shares the blocks once it admits the turn, and if they are
            # released before that it computes the prompt itself. Claiming for it would keep
            # them from the holder's pressure release for a whole claim.
            await self._leases.claim(lease)
        if not dry_run:
            if path != planner.DECODE_LOCAL:  # a turn on D alone gives P no work
                prefill.assigned_since_heartbeat += 1
            decode.assigned_since_heartbeat += 1
            if conversation_id:
                self._turns.started(
                    conversation_id, decode, prefill if path != planner.DECODE_LOCAL else None
                )
                retained = usable.token_count if usable is not None else 0
                self._note_prefill(conversation_id, path, prefill, retained, asked)
        hint.decision = reuse.decision
        hint.reason = reuse.reason
        hint.consistency = EXACT if reuse.exact else DEGRADED
        hint.prefill.CopyFrom(prefill.spec)
        hint.decode.CopyFrom(decode.spec)
        if reuse.reuses and lease is not None:
            self._leases.view(lease, into=hint.lease)
        hint.path = path
        for estimate in plan.estimates if plan is not None else ():
            hint.estimates.add(
                path=estimate.path,
                ttft_ms=estimate.ttft_ms,
                not_eligible=estimate.not_eligible,
                prefill_node_id=estimate.prefill_node_id,
                prefill_cached_tokens=estimate.cached_tokens,
            )
        self._metrics.hint(reuse.decision, reuse.exact, path)
        self._metrics.hint_latency.observe(self._now() - started)

    def _plan(
        self,
        conversation_id: str,
        model: str,
        lease: Lease | None,
        prefill: NodeRuntime,
        decode: NodeRuntime,
        asked: TurnRequest,
    ) -> planner.Plan | None:
        """The planner's choice for a turn that may reuse ``lease`` (None: nothing usable is
        retained), between the least-loaded ``prefill`` and the prefill node whose own cache
        holds the conversation. None when there is nothing to weigh: without a usable lease
        only recomputing is left, and the prefill node matters only when one caches the
        conversation; without the router's word on the prompt's size, a reused turn reads."""
        cached = (
            self.prefill_caches.cached(conversation_id, model, self._nodes.runtime)
            if conversation_id
            else None
        )
        if lease is None and cached is None:
            return None
        retained = lease.token_count if lease is not None else 0
        new_tokens = asked.new_after(retained) if lease is not None else asked.prompt_after(0)
        if new_tokens is None and asked.wanted and lease is not None:
            new_tokens = 1  # unsaid: eligibility is all that is weighed for the asked path
        if new_tokens is None:
            return None
        candidates = [_prefill(prefill)]
        if cached is not None:
            node, tokens = cached
            if node is prefill:
                candidates = [_prefill(prefill, tokens)]
            else:
                candidates.append(_prefill(node, tokens))
        # D: the holder, whose cache has the retained tokens; else the turn's decode node.
        holder = self._nodes.runtime[lease.node_id] if lease is not None else decode
        turn = planner.Turn(
            retained_tokens=retained,
            new_tokens=new_tokens,
            block_size=holder.spec.block_size,
            decode_running=holder.pending,
            holder_decodes=decode is holder,
        )
        return planner.plan(turn, candidates, holder.costs, self._planner, asked.wanted)

    def _note_prefill(
        self,
        conversation_id: str,
        path: registry_pb2.TurnPath,
        prefill: NodeRuntime,
        retained: int,
        asked: TurnRequest,
    ) -> None:
        """A turn with a prefill leg leaves its prompt in that node's cache (when it caches
        prefixes: ``PrefillCaches`` checks that when it is asked); a DECODE_LOCAL turn leaves
        the prefill nodes' caches as they were, and so does a prompt of unknown size."""
        if path == planner.DECODE_LOCAL:
            return
        tokens = asked.prompt_after(retained)
        if tokens is not None:
            self.prefill_caches.computed(conversation_id, prefill.spec, tokens)

    async def _current_lease(self, conversation: Conversation | None, claim: bool) -> Lease | None:
        """The conversation's current lease as of now (expired if its time is up); a turn that
        starts (``claim``) teaches the idle TTL the gap since the conversation was active."""
        if conversation is None:
            return None
        if claim and conversation.last_active_time is not None:
            gap = self._now() - conversation.last_active_time
            self._idle_ttl.observe_gap(gap)
            self._metrics.idle_ttl.set(self._idle_ttl.ttl())
        if not conversation.lease_id:
            return None
        lease = await self._store.get_lease(conversation.lease_id)
        if lease is not None:
            await self._leases.expire_if_due(lease)
        return lease


def _prefill(node: NodeRuntime, cached_tokens: int = 0) -> planner.Prefill:
    return planner.Prefill(node.node_id, node.costs, node.pending, cached_tokens)


async def cached_hint(
    store: Store, conversation_id: str, model: str, why: str, turn: int
) -> registry_pb2.RoutingHint:
    """A follower's answer while no leader can be reached: nodes from its watch-fed cache, no
    reuse (only a leader can claim a lease), the conversation's last decode node kept."""
    nodes = [routing.RoutedNode.of_record(node) for node in await store.list_nodes()]
    try:
        routes = routing.candidates(nodes, model)
    except routing.NoReadyNode as error:
        # Not the leader's word on the nodes: a router then routes from its own node list.
        raise NoLeader(
            f"no registry leader reachable ({why}) and this replica's cache cannot route: "
            + error.message
        ) from error
    conversation = await store.get_conversation(conversation_id) if conversation_id else None
    holder = conversation.decode_node_id if conversation is not None else ""
    prefill, decode = routing.choose(routes, turn, holder=holder)
    reuse = routing.leaderless_decision(conversation is not None, why)
    return registry_pb2.RoutingHint(
        decision=reuse.decision,
        reason=reuse.reason,
        consistency=DEGRADED,
        prefill=prefill.spec,
        decode=decode.spec,
    )
