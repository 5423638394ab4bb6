"""Routing hints: the routing rule (``kvbroker.common.rules.routing``) applied to the registry's
state: by the leader (which may claim the lease it offers), and by a follower from its etcd
cache while no leader can be reached (``cached_hint``, DEGRADED). A follower answers hints that
write nothing from its copy of the leader's state by ``kvbroker.common.rules.fed_hints``, the
rule a router's own copy answers by too.

The leader's hint goes on the planner's path (``controlplane.placement.planner``), and to the
prefill node the planner chose: the least-loaded one the routing rule picks, or the one whose own
prefix cache holds the conversation's last prompt (``PrefillCaches``) when that is estimated
faster. A follower knows no such cache and keeps the routing rule's pick.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from kvbroker.common.rules import fed_hints, routing
from kvbroker.common.rules.fed_hints import DEGRADED
from kvbroker.controlplane.context import RegistryContext
from kvbroker.controlplane.errors import (
    NodeNotRegistered,
    NoLeader,
    NoReadyNode,
    NotADecodeNode,
    NotAPrefillNode,
)
from kvbroker.controlplane.lessor.leases import Leases
from kvbroker.controlplane.lessor.turns import Turns
from kvbroker.controlplane.placement import planner
from kvbroker.controlplane.placement.planner import UNSAID, TurnRequest
from kvbroker.controlplane.placement.prefill_caches import PrefillCaches
from kvbroker.controlplane.records import codec
from kvbroker.controlplane.records.model import Conversation, Lease
from kvbroker.controlplane.sessions.idle_ttl import IdleTtl
from kvbroker.controlplane.sessions.nodes import NodeRuntime, NodeSessions
from kvbroker.controlplane.storage.store import Store
from kvbroker.v1 import registry_pb2


class Hints:
    def __init__(
        self,
        context: RegistryContext,
        nodes: NodeSessions,
        leases: Leases,
        turns: Turns,
        idle_ttl: IdleTtl,
    ) -> None:
        self._store = context.store
        self._metrics = context.metrics
        self._now = context.now
        self._nodes = nodes
        self._leases = leases
        self._turns = turns
        self._idle_ttl = idle_ttl
        self._round_robin = itertools.count()
        self._planner = context.config.planner
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
        lease it offers for a READ and counts the choice. The turn's path is the planner's;
        for a turn another router already placed (``asked.on_node_id``), what that node can
        do (``_placed``)."""
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
        reuse = fed_hints.reuse(
            conversation_id,
            conversation,
            lease,
            lease.handle.registration_generation if lease is not None else 0,
            holder,
            holder is not None and holder.synced,
        )
        holder_id = conversation.decode_node_id if conversation is not None else ""
        prefill, decode = routing.choose(
            routes, next(self._round_robin), holder=holder_id, conversation=bool(conversation_id)
        )
        if asked.on_node_id:
            choice = self._placed(
                conversation_id, model, conversation, lease, reuse, prefill, asked
            )
        else:
            choice = self._routed(conversation_id, model, lease, reuse, prefill, decode, asked)
        path, reuse = choice.path, choice.reuse
        if path == planner.READ and reuse.reuses and lease is not None and not dry_run:
            # Only a read needs the blocks kept for it. A DECODE_LOCAL turn reads nothing:
            # the decode node shares the blocks once it admits the turn, and if they are
            # released before that it computes the prompt itself. Claiming for it would keep
            # them from the holder's pressure release for a whole claim.
            await self._leases.claim(lease)
        if not dry_run and choice.records_turn:
            turn_prefill = choice.prefill if path != planner.DECODE_LOCAL else None
            if turn_prefill is not None:  # a turn on D alone gives P no work
                turn_prefill.assigned_since_heartbeat += 1
            if choice.decode is not None:
                choice.decode.assigned_since_heartbeat += 1
            if conversation_id:
                self._turns.started(conversation_id, choice.decode, turn_prefill)
                retained = lease.token_count if lease is not None and reuse.reuses else 0
                self._note_prefill(conversation_id, path, choice.prefill, retained, asked)
        fed_hints.answer(hint, reuse, path, choice.prefill, choice.decode or holder)
        if reuse.reuses and lease is not None:
            self._leases.view_into(lease, hint.lease)
        for estimate in choice.plan.estimates if choice.plan is not None else ():
            hint.estimates.add(
                path=estimate.path,
                ttft_ms=estimate.ttft_ms,
                not_eligible=estimate.not_eligible,
                prefill_node_id=estimate.prefill_node_id,
                prefill_cached_tokens=estimate.cached_tokens,
            )
        self._metrics.hint(reuse.decision, reuse.exact, path)
        self._metrics.hint_latency.observe(self._now() - started)

    def _routed(
        self,
        conversation_id: str,
        model: str,
        lease: Lease | None,
        reuse: routing.Reuse,
        prefill: NodeRuntime,
        decode: NodeRuntime,
        asked: TurnRequest,
    ) -> _Choice:
        """kvbroker's router places the turn: the planner's path, on the planner's prefill
        node (the routing rule's least-loaded one, or one whose cache holds the
        conversation) and the routing rule's decode node. When no prefill node can hand KV to
        the decode node (a fleet mid-upgrade, ``routing.pairs``), the decode node computes the
        turn itself, from what it retains if it holds the conversation's lease."""
        usable = lease if reuse.reuses else None
        if not routing.pairs(prefill, decode):
            return _Choice(
                planner.DECODE_LOCAL,
                fed_hints.unpaired(reuse, usable, decode),
                None,
                prefill,
                decode,
            )
        candidates = self._candidates(conversation_id, model, prefill, decode)
        plan = self._plan(usable, candidates, decode, asked)
        path = plan.path if plan is not None else planner.READ if usable else planner.RECOMPUTE
        if plan is not None:
            prefill = self._nodes.runtime[plan.prefill_node_id]
            reuse = _not_read(reuse, plan, asked)
        return _Choice(path, reuse, plan, prefill, decode)

    def _placed(
        self,
        conversation_id: str,
        model: str,
        conversation: Conversation | None,
        lease: Lease | None,
        reuse: routing.Reuse,
        least_loaded: NodeRuntime,
        asked: TurnRequest,
    ) -> _Choice:
        """A router other than kvbroker's already sent the turn to ``asked.on_node_id``.

        Asked with READ, that node is the turn's prefill node: READ there (its connector can
        read from the holder, and reading is estimated faster), else RECOMPUTE. The decode
        node is the other router's to pick, so the turn names none: whichever decode node
        reports it ends it.

        Otherwise the node got the turn alone (a decode-first router). It computes it from its
        own cache (DECODE_LOCAL) when it holds the conversation's live lease: always when
        asked for DECODE_LOCAL (it computes the turn in any case), when the planner says so
        otherwise (the answer to a conditional ``Prefer: if-available``, with the least-loaded
        prefill node as the alternative). A node that holds nothing is told so; the turn is
        recorded as routed there only if it could lease the conversation anyway (a new
        conversation, or the one it last held), so placing a turn never moves a
        conversation's lease to a node its holder's rules would refuse."""
        node = self._nodes.runtime.get(asked.on_node_id)
        if node is None or not routing.routable(node, model):
            raise NodeNotRegistered(
                f"node {asked.on_node_id!r} is not a ready node serving model {model!r}"
            )
        usable = lease if reuse.reuses else None
        if asked.wanted == planner.READ:
            if not node.prefills:
                raise NotAPrefillNode(f"node {node.node_id!r} does not prefill")
            candidates = self._candidates(conversation_id, model, node, None)[:1]
            holder = self._nodes.runtime[usable.node_id] if usable is not None else node
            plan = self._plan(usable, candidates, holder, asked)
            path = plan.path if plan is not None else planner.READ if usable else planner.RECOMPUTE
            if plan is not None:
                reuse = _not_read(reuse, plan, asked)
            return _Choice(path, reuse, plan, node, None)
        if not node.decodes:
            raise NotADecodeNode(f"node {node.node_id!r} does not decode")
        if usable is None or usable.node_id != node.node_id:
            if usable is not None:
                reuse = routing.Reuse(
                    registry_pb2.HINT_DECISION_RECOMPUTE,
                    f"lease {usable.lease_id} is on node {usable.node_id!r}, not on "
                    f"{node.node_id!r}",
                    registry_pb2.NO_REUSE_REASON_NOT_HOLDER,
                )
            last_holder = conversation.decode_node_id if conversation is not None else ""
            leasable = usable is None and last_holder in ("", node.node_id)
            return _Choice(planner.RECOMPUTE, reuse, None, least_loaded, node, leasable)
        if asked.wanted == planner.DECODE_LOCAL:
            return _Choice(planner.DECODE_LOCAL, reuse, None, least_loaded, node)
        candidates = self._candidates(conversation_id, model, least_loaded, node)
        plan = self._plan(usable, candidates, node, asked)
        path = plan.path if plan is not None else planner.DECODE_LOCAL
        prefill = self._nodes.runtime[plan.prefill_node_id] if plan is not None else least_loaded
        return _Choice(path, reuse, plan, prefill, node, path == planner.DECODE_LOCAL)

    def _candidates(
        self, conversation_id: str, model: str, first: NodeRuntime, decode: NodeRuntime | None
    ) -> list[tuple[NodeRuntime, int]]:
        """The prefill nodes a turn may go to, ``first`` first, each with the tokens of the
        conversation its own cache holds: ``first``, and the node whose cache holds the
        conversation's last prompt if another, and if ``decode`` (when known) can read from
        it."""
        cached = (
            self.prefill_caches.cached(conversation_id, model, self._nodes.runtime)
            if conversation_id
            else None
        )
        if cached is None:
            return [(first, 0)]
        node, tokens = cached
        if node is first:
            return [(first, tokens)]
        if decode is not None and not routing.can_transfer(decode.spec, node.spec):
            return [(first, 0)]
        return [(first, 0), (node, tokens)]

    def _plan(
        self,
        lease: Lease | None,
        prefills: list[tuple[NodeRuntime, int]],
        decode: NodeRuntime,
        asked: TurnRequest,
    ) -> planner.Plan | None:
        """The planner's choice for a turn that may reuse ``lease`` (None: nothing usable is
        retained) among ``prefills`` (the first the least loaded). None when there is
        nothing to weigh: without a usable lease only recomputing is left, and the prefill
        node matters only when one caches the conversation; without the router's word on the
        prompt's size, a reused turn reads."""
        if lease is None and len(prefills) == 1 and not prefills[0][1]:
            return None
        retained = lease.token_count if lease is not None else 0
        new_tokens = asked.new_after(retained) if lease is not None else asked.prompt_after(0)
        if new_tokens is None and asked.wanted and lease is not None:
            new_tokens = 1  # unsaid: eligibility is all that is weighed for the asked path
        if new_tokens is None:
            return None
        # D: the holder, whose cache has the retained tokens; else the turn's decode node.
        holder = self._nodes.runtime[lease.node_id] if lease is not None else decode
        turn = planner.Turn(
            retained_tokens=retained,
            new_tokens=new_tokens,
            block_size=holder.spec.block_size,
            decode_running=holder.pending,
            holder_decodes=decode is holder,
            retained_block_ids=codec.retained_block_ids(lease),
        )
        candidates = [
            planner.Prefill(
                node.node_id,
                node.costs,
                node.pending,
                tokens,
                routing.can_transfer(node.spec, holder.spec),
            )
            for node, tokens in prefills
        ]
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


@dataclass(frozen=True, slots=True)
class _Choice:
    """Where a turn goes and how it gets its KV. ``prefill`` is shown in the hint even when
    the turn has no prefill leg (the alternative); ``decode`` is None when another router
    picks the decode node. ``records_turn``: the turn counts on its nodes and is tracked
    until its decode node reports its end."""

    path: registry_pb2.TurnPath
    reuse: routing.Reuse
    plan: planner.Plan | None
    prefill: NodeRuntime
    decode: NodeRuntime | None
    records_turn: bool = True


def _not_read(reuse: routing.Reuse, plan: planner.Plan, asked: TurnRequest) -> routing.Reuse:
    """The decision once the planner chose: a usable lease the turn does not read (or use on
    its holder) is a RECOMPUTE, with why."""
    if not reuse.reuses or plan.path != planner.RECOMPUTE:
        return reuse
    read = next((e for e in plan.estimates if e.path == planner.READ), None)
    if read is not None and read.not_eligible == planner.VERSION_MISMATCH:
        return routing.Reuse(
            registry_pb2.HINT_DECISION_RECOMPUTE,
            read.not_eligible,
            registry_pb2.NO_REUSE_REASON_VERSION_MISMATCH,
        )
    why = (
        "recomputing was asked for"
        if asked.wanted == planner.RECOMPUTE
        else f"recomputing is estimated fastest ({plan.chosen.ttft_ms:.0f} ms)"
    )
    return routing.Reuse(
        registry_pb2.HINT_DECISION_RECOMPUTE, why, registry_pb2.NO_REUSE_REASON_RECOMPUTE_FASTER
    )


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
    prefill, decode = routing.choose(
        routes, turn, holder=holder, conversation=bool(conversation_id)
    )
    reuse = routing.leaderless_decision(conversation is not None, why)
    return registry_pb2.RoutingHint(
        decision=reuse.decision,
        reason=reuse.reason,
        consistency=DEGRADED,
        prefill=prefill.spec,
        decode=decode.spec,
        # Plain P/D, unless no prefill node can hand KV to the decode node.
        path=planner.RECOMPUTE if routing.pairs(prefill, decode) else planner.DECODE_LOCAL,
    )
