"""The registry: a small facade over its parts that owns the lock and the unit of work.

The parts, each the one owner of its state (as etcd keeps its lessor apart from sessions):
node sessions (``nodes``), the lessor with lease expiry and claim deadlines (``leases``),
retention reports and replay (``retention``), routing hints (``hints``, over the pure rule in
``kvbroker.common.rules.routing``), turns still finishing (``turns``) and the command outbox
(``outbox``). Deadlines of every kind live in one heap (``DeadlineQueue``), each kind with one
handler.

Every mutation runs under one asyncio lock, so a store with real awaits (etcd) sees the same
ordering as the memory store; its writes are then committed (group commit: the next mutation
may already run while they are in flight), and only after that does it answer or send its lease
commands to holders (``storage.unit_of_work.Mutation``). Time comes from the registry's own
clock; expiries are also checked on read, so an expired lease is never offered even if the
deadline task is momentarily behind.

A registry over etcd can take over from another replica: ``restore()`` rebuilds deadlines and
the routing view from the store, and until a holder has replayed to it (its sidecar reconnects
with a full snapshot) hints do not offer that holder's leases and say DEGRADED.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

import structlog

from kvbroker.common.rules.checkpoints import Checkpoints
from kvbroker.common.rules.clock import MonotonicClock
from kvbroker.controlplane.config import MAX_HINT_BATCH, RegistryConfig
from kvbroker.controlplane.context import RegistryContext
from kvbroker.controlplane.deadlines import DeadlineKey, DeadlineKind, DeadlineQueue
from kvbroker.controlplane.errors import (
    BatchFull,
    CommitUndone,
    InvalidArgument,
    RegistryError,
    StoreRefused,
    StoreUnavailable,
    hint_error,
)
from kvbroker.controlplane.lessor.lease_reads import LeaseReads
from kvbroker.controlplane.lessor.leases import Leases
from kvbroker.controlplane.lessor.prefix_index import MAX_PROBES
from kvbroker.controlplane.lessor.retention import RetentionReports
from kvbroker.controlplane.lessor.turns import Turns, wait_budget
from kvbroker.controlplane.metrics import RegistryMetrics
from kvbroker.controlplane.placement.hints import Hints
from kvbroker.controlplane.placement.planner import UNSAID, TurnRequest
from kvbroker.controlplane.placement.prefix_match import PrefixMatch, PrefixMatches
from kvbroker.controlplane.records import codec
from kvbroker.controlplane.records.answers import LeaseAnswer, NodeAnswer, Registration
from kvbroker.controlplane.records.model import DOWN, Conversation, CostProfile, Node
from kvbroker.controlplane.records.requests import (
    LIVE_LEASES,
    Heartbeat,
    LeaseGrant,
    LeaseListing,
    PrefixProbe,
    RetentionReport,
)
from kvbroker.controlplane.records.validation import Validation
from kvbroker.controlplane.sessions.idle_ttl import IdleTtl
from kvbroker.controlplane.sessions.nodes import NodeSessions
from kvbroker.controlplane.storage.outbox import Outbox
from kvbroker.controlplane.storage.store import Store
from kvbroker.controlplane.storage.unit_of_work import Mutation
from kvbroker.v1 import node_pb2, registry_pb2

log = structlog.get_logger("kvbroker.registry")


class Registry:
    def __init__(
        self,
        store: Store,
        config: RegistryConfig | None = None,
        metrics: RegistryMetrics | None = None,
        clock: Callable[[], float] | None = None,
        on_store_failure: Callable[[StoreUnavailable], None] | None = None,
        term: int = 0,
    ) -> None:
        """``term``: rises with every registry that may grant, and sets the floor of the
        epochs this one grants (``lease_ids.next_epoch``): a replica's election revision, a
        standalone registry's start time; 0 (tests): epochs count from the conversation's."""
        self.store = store
        self.config = config = config or RegistryConfig()
        self.metrics = metrics = metrics or RegistryMetrics()
        self.now = now = clock or MonotonicClock().now
        self.idle_ttl = IdleTtl(config.idle_ttl())
        metrics.idle_ttl.set(self.idle_ttl.ttl())
        self._deadlines: DeadlineQueue = DeadlineQueue(now)
        self._expiry_task: asyncio.Task[None] | None = None
        # Bound once, after logging is configured: through the module's lazy proxy every call
        # (debug ones too, filtered out) costs ~2 µs, and a grant or hint makes several.
        self._log = log.bind()
        self._validate = Validation(config)
        context = RegistryContext(
            store, config, metrics, now, self._deadlines, self._validate, self._log
        )
        self.outbox = Outbox(config.max_pending_commands, metrics)
        self._mutation = Mutation(store, self.outbox, self._resync, on_store_failure, self._log)
        self.nodes = NodeSessions(context)
        self.turns = Turns(context, self.nodes)
        self.leases = Leases(context, self.nodes, self.outbox, self.turns, self.idle_ttl, term)
        self.reads = LeaseReads(context, self.leases.view)
        self.retention = RetentionReports(
            context, self.nodes, self.leases, self.reads, self.outbox, self.turns
        )
        self.hints = Hints(context, self.nodes, self.leases, self.turns, self.idle_ttl)
        self.prefix_matches = PrefixMatches(context, self.nodes, self.leases)
        self._on_due: dict[DeadlineKind, Callable[[str], Awaitable[None]]] = {
            DeadlineKind.LEASE_EXPIRY: self.leases.on_expiry,
            DeadlineKind.CLAIM_END: self.leases.on_claim_end,
            DeadlineKind.NODE_SESSION: self._on_session_expired,
            DeadlineKind.FORGET_LEASE: self.leases.forget_lease,
            DeadlineKind.FORGET_CONVERSATION: self.leases.forget_conversation,
            DeadlineKind.FORGET_NODE: self._forget_node,
        }
        metrics.watch_nodes(self.nodes.figures)

    # ----------------------------------------------------------------- lifecycle

    def start(self) -> None:
        self._expiry_task = asyncio.create_task(
            self._deadlines.run(self._on_deadlines, self.config.max_expiries_per_batch),
            name="kvbroker-registry-deadlines",
        )

    async def stop(self) -> None:
        if self._expiry_task is not None:
            self._expiry_task.cancel()
            await asyncio.gather(self._expiry_task, return_exceptions=True)
        self.outbox.close()

    async def _resync(self) -> None:
        """After the store refused a record and undid the cache to what is durable: rebuilds
        the deadlines and node runtimes from the records, as a takeover does, but keeps what
        only this leader knows of sessions that go on (their applied sequence, their sync)."""
        self.store.resync_due = False
        kept = {
            node_id: (runtime.spec.incarnation, runtime.applied_sequence, runtime.synced)
            for node_id, runtime in self.nodes.runtime.items()
        }
        inherited = self.leases.inherited_claims_until
        self._deadlines.clear()
        self.nodes.runtime.clear()
        self.nodes.restore(await self.store.list_nodes())
        for node_id, runtime in self.nodes.runtime.items():
            incarnation, applied, synced = kept.get(node_id, ("", 0, False))
            if incarnation == runtime.spec.incarnation:
                runtime.applied_sequence, runtime.synced = applied, synced
        live = await self.leases.restore()
        self.leases.inherited_claims_until = inherited
        self._log.warning("registry_resynced", live_leases=live)

    async def restore(self) -> None:
        """Rebuilds deadlines and the routing view from the store (a takeover)."""
        nodes = await self.store.list_nodes()
        self.nodes.restore(nodes)
        for node in nodes:
            self.outbox.open(node.spec.node_id, node.spec.incarnation)
        live = await self.leases.restore()
        self._log.info("registry_restored", nodes=len(nodes), live_leases=live)

    # ----------------------------------------------------------------- nodes

    async def register_node(self, spec: node_pb2.NodeSpec) -> Registration:
        self._validate.node_spec(spec)
        async with self._mutation:
            old = await self.store.get_node(spec.node_id)
            self.nodes.refuse_rival(spec, old)
            if old is None or old.spec.incarnation != spec.incarnation:
                if old is not None:
                    await self.leases.withdraw(
                        spec.node_id, "holder node lost its session: new incarnation"
                    )
                self.outbox.open(spec.node_id, spec.incarnation)
            node = self.nodes.view(await self.nodes.register(spec, old))
        config = self.config
        return Registration(node, config.heartbeat_interval_s, config.session_ttl_s)

    async def heartbeat(self, beat: Heartbeat) -> NodeAnswer:
        """A node's heartbeat, with its engine's load and the work it did since the last
        one."""
        self._validate.heartbeat(beat)
        await self.nodes.heard(beat)
        async with self._mutation:
            return self.nodes.view(await self.nodes.heartbeat(beat))

    async def deregister_node(self, node_id: str, incarnation: str) -> NodeAnswer:
        self._validate.session(node_id, incarnation)
        async with self._mutation:
            node = await self.nodes.session(node_id, incarnation)
            await self._mark_down(node, "deregistered")
            return self.nodes.view(node)

    async def drain_node(self, node_id: str) -> NodeAnswer:
        """Takes the node out of routing (``routing.ROUTABLE_STATES``) and ends its unclaimed
        leases; claimed reads finish. The answer's ``drained`` says when it is done."""
        self._validate.id(node_id, "node_id")
        async with self._mutation:
            node = await self.nodes.drain(node_id)
            await self.leases.drain(node_id)
            return self.nodes.view(node)

    async def set_cost_profile(self, node_id: str, cost: CostProfile | None) -> NodeAnswer:
        """Stores a node's measured costs; ``cost`` None (not said when it was measured) is
        refused."""
        self._validate.id(node_id, "node_id")
        self._validate.costs(cost)
        async with self._mutation:
            return self.nodes.view(await self.nodes.set_costs(node_id, cost))

    async def get_node(self, node_id: str) -> NodeAnswer:
        return self.nodes.view(await self.nodes.node(node_id))

    async def list_nodes(self, role: int = 0, model: str = "") -> list[NodeAnswer]:
        self._validate.list_nodes(role, model)
        return await self.nodes.list_nodes(role, model)

    async def _mark_down(self, node: Node, why: str) -> None:
        """Ends a node's session and withdraws its leases."""
        await self.leases.withdraw(node.spec.node_id, f"holder node lost its session: {why}")
        await self.nodes.mark_down(node, why)

    async def _on_session_expired(self, node_id: str) -> None:
        node = await self.store.get_node(node_id)
        if node is not None and node.state != DOWN:
            await self._mark_down(node, "missed heartbeats")

    async def _forget_node(self, node_id: str) -> None:
        if await self.nodes.forget(node_id):
            self.outbox.forget(node_id)

    # ----------------------------------------------------------------- leases

    async def grant_lease(self, grant: LeaseGrant) -> LeaseAnswer:
        blocks = self._validate.grant(grant)
        checkpoints = Checkpoints.of(grant.block_hashes, grant.block_hash_stride)
        async with self._mutation:
            node = await self.nodes.session(grant.node_id, grant.incarnation)
            self.nodes.require_holder_role(node)
            lease_ttl = self.leases.ttl(grant.ttl, grant.node_id)
            lease = await self.leases.grant(
                node,
                grant.conversation_id,
                codec.handle_of(grant.handle, blocks),
                checkpoints,
                grant.token_count,
                lease_ttl,
            )
            return self.leases.view(lease)

    async def renew_lease(
        self, lease_id: str = "", conversation_id: str = "", ttl: float | None = None
    ) -> LeaseAnswer:
        self._validate.lease_ref(lease_id, conversation_id)
        self._validate.ttl(ttl)
        async with self._mutation:
            lease = await self.reads.by_id_or_conversation(lease_id, conversation_id)
            await self.leases.renew(lease, self.leases.ttl(ttl, lease.node_id))
            return self.leases.view(lease)

    async def release_lease(
        self, lease_id: str, node_id: str, incarnation: str, reason: str
    ) -> LeaseAnswer:
        self._validate.release(lease_id, node_id, incarnation, reason)
        async with self._mutation:
            lease = await self.reads.lease(lease_id)
            await self.leases.release(lease, node_id, incarnation, reason)
            return self.leases.view(lease)

    async def revoke_lease(
        self, lease_id: str = "", conversation_id: str = "", reason: str = ""
    ) -> LeaseAnswer:
        self._validate.lease_ref(lease_id, conversation_id)
        self._validate.text(reason, "reason")
        async with self._mutation:
            lease = await self.reads.by_id_or_conversation(lease_id, conversation_id)
            await self.leases.revoke(lease, reason)
            return self.leases.view(lease)

    async def get_lease(self, lease_id: str) -> LeaseAnswer:
        lease = await self.reads.lease(lease_id)
        async with self._mutation:
            await self.leases.expire_if_due(lease)
        return self.leases.view(lease)

    async def list_leases(
        self, listing: LeaseListing = LIVE_LEASES
    ) -> tuple[list[LeaseAnswer], str]:
        return await self.reads.page(listing)

    async def get_conversation(self, conversation_id: str) -> Conversation:
        return await self.reads.conversation(conversation_id)

    # ----------------------------------------------------------------- retention reports

    async def report_retention(
        self, report: RetentionReport
    ) -> registry_pb2.ReportRetentionResponse:
        self._validate.session(report.node_id, report.incarnation)
        checked = self.retention.check(report.events)
        async with self._mutation:
            node = await self.nodes.session(report.node_id, report.incarnation)
            return await self.retention.apply(node, checked, report.full_snapshot)

    # ----------------------------------------------------------------- commands

    async def watch_commands(
        self, node_id: str, incarnation: str
    ) -> AsyncIterator[registry_pb2.LeaseCommand]:
        self._validate.session(node_id, incarnation)
        await self.nodes.session(node_id, incarnation)
        async for command in self.outbox.watch(node_id, incarnation):
            yield command

    # ----------------------------------------------------------------- hints

    async def routing_hint(
        self,
        conversation_id: str,
        model: str,
        dry_run: bool = False,
        asked: TurnRequest = UNSAID,
        time_remaining: float | None = None,
    ) -> registry_pb2.RoutingHint:
        """``time_remaining``: the caller's deadline, in seconds from now (None: none), which
        bounds any wait for a previous turn's retention (``turns.wait_budget``)."""
        self._validate.hint(conversation_id, model, asked.on_node_id, asked.wanted)
        if conversation_id and not dry_run:
            await self.turns.settled((conversation_id,), wait_budget(self.config, time_remaining))
        hint = registry_pb2.RoutingHint()
        async with self._mutation:
            await self.hints.hint(conversation_id, model, dry_run, hint, asked)
        return hint

    async def routing_hints(
        self,
        requests: Sequence[registry_pb2.GetRoutingHintRequest],
        time_remaining: float | None = None,
    ) -> registry_pb2.BatchGetRoutingHintsResponse:
        """Each request's hint, or the error it alone would have failed with, under one lock
        and one commit; written straight into the response (at saturation a copy of each hint
        cost a tenth of the registry's time). ``time_remaining`` as for ``routing_hint``."""
        if len(requests) > MAX_HINT_BATCH:
            raise InvalidArgument(
                f"{len(requests)} hint requests exceed the batch limit of {MAX_HINT_BATCH}"
            )
        response = registry_pb2.BatchGetRoutingHintsResponse()
        # Each request is checked before any is served: a malformed one is answered with its
        # error alone, and never fails the batch after others have claimed leases.
        refused: dict[int, InvalidArgument] = {}
        for index, request in enumerate(requests):
            try:
                self._validate.hint(
                    request.conversation_id, request.model, request.on_node_id, request.path
                )
            except InvalidArgument as error:
                refused[index] = error
        if self.turns:
            await self.turns.settled(
                (
                    r.conversation_id
                    for i, r in enumerate(requests)
                    if r.conversation_id and not r.dry_run and i not in refused
                ),
                wait_budget(self.config, time_remaining),
            )
        answered_bytes = 0
        budget = self.config.max_answer_bytes
        async with self._mutation:
            for index, request in enumerate(requests):
                result = response.results.add()
                if answered_bytes > budget:
                    # Answered unclaimed: the client sends it again in its next batch.
                    full = BatchFull(f"the batch's answer passed {budget} bytes; retry")
                    result.error.CopyFrom(hint_error(full))
                    continue
                try:
                    if index in refused:
                        raise refused[index]
                    await self.hints.hint(
                        request.conversation_id,
                        request.model,
                        request.dry_run,
                        result.hint,
                        TurnRequest.of(request),
                    )
                except RegistryError as error:
                    result.error.CopyFrom(hint_error(error))  # replaces a half-made hint
                answered_bytes += result.ByteSize()
        return response

    async def match_prefix(self, probe: PrefixProbe) -> PrefixMatch:
        """The live lease a prefill node's prompt shares the longest prefix with, pinned for
        its read (``PrefixMatches.match``); a fork of another conversation reads it."""
        self._validate.prefix_match(probe, MAX_PROBES)
        async with self._mutation:
            return await self.prefix_matches.match(probe)

    async def end_read_pin(self, node_id: str, lease_id: str, pin_id: str) -> None:
        """``node_id``'s read of a pinned lease has ended: its pin ends (an unknown one, or
        another node's, is left alone; pins also end at their timeout)."""
        self._validate.id(node_id, "node_id")
        self._validate.id(lease_id, "lease_id")
        self._validate.id(pin_id, "pin_id")
        async with self._mutation:
            self.leases.pins.end(lease_id, pin_id, node_id)

    # ----------------------------------------------------------------- deadlines

    async def _on_deadlines(self, keys: list[DeadlineKey]) -> None:
        # Unavailable: the replica steps down and reloads; refused: the next mutation resyncs.
        with contextlib.suppress(StoreUnavailable, StoreRefused, CommitUndone):
            async with self._mutation:
                for kind, key in keys:
                    # Popped before the lock: a mutation that waited for it ahead of this one
                    # (a heartbeat, a renewal behind a long report) may have set the key a new
                    # deadline since it fell due, and that one stands.
                    if self._deadlines.deadline((kind, key)) is None:
                        await self._on_due[kind](key)
