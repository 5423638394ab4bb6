"""Node sessions: registration, heartbeats and their session deadlines, readiness, draining,
and each node's in-memory runtime (the routing view and the figures derived from its leases).

A session ends when its node deregisters or misses heartbeats for the session TTL; ending it
withdraws the node's leases, which the registry does (``Registry``) because leases are not
this part's to end.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime

from kvbroker.common.rules.clock import from_duration
from kvbroker.common.rules.costs import DEFAULT_COSTS, Costs, default_costs, device_of
from kvbroker.common.rules.labels import label
from kvbroker.common.rules.routing import (
    DECODE_ROLES,
    RoutedNode,
    Routes,
    candidates,
)
from kvbroker.controlplane.context import RegistryContext
from kvbroker.controlplane.deadlines import DeadlineKind
from kvbroker.controlplane.errors import (
    NodeDown,
    NodeInUse,
    NodeNotRegistered,
    NotADecodeNode,
    SessionLost,
)
from kvbroker.controlplane.metrics import NodeFigures
from kvbroker.controlplane.records import codec
from kvbroker.controlplane.records.answers import Correction, NodeAnswer, answering
from kvbroker.controlplane.records.model import (
    DOWN,
    DRAINING,
    NOT_READY,
    READY,
    CostProfile,
    EngineWork,
    Node,
)
from kvbroker.controlplane.records.requests import Heartbeat
from kvbroker.controlplane.sessions.cost_correction import observed, planned_costs
from kvbroker.v1 import node_pb2


@dataclass(slots=True, eq=False)
class NodeRuntime(RoutedNode[Node]):
    """One node as this registry runs it: the routing view over the node's stored record (its
    spec and state are the record's: ``NodeSessions`` points it at every record it puts),
    plus what only the leader knows. Its live leases are counted by the store's index."""

    # The last retention event applied from its sidecar.
    applied_sequence: int = 0
    # False for a node known only from the store (after a takeover) until its sidecar replays:
    # its engine may hold deadlines this registry never sent, so its leases are not offered.
    synced: bool = True
    # Its measured costs (None until calibrated: the defaults apply) and their live correction
    # from the work it reports; set through ``calibrate`` and ``observe``, which keep ``costs``,
    # what the planner weighs, in step with both.
    calibrated: Costs | None = None
    correction: Correction = field(default_factory=Correction)
    costs: Costs = DEFAULT_COSTS
    # What it costs until calibrated: by where its engine keeps its KV (``default_costs``).
    defaults: Costs = DEFAULT_COSTS
    # Draining: when work last touched it (the drain began, a lease on it ended), and when
    # its last heartbeat, with the load it reported, arrived.
    busy_at: float = 0.0
    load_at: float = 0.0
    # Heartbeats applied in this session: a turn sent to the node before the latest one was
    # counted in the load it reported.
    heartbeats: int = 0

    def keep(self, node: Node) -> None:
        """The node's record as now stored."""
        spec_changed = node.spec is not self.node.spec
        self.node = node
        if spec_changed:
            self._read_spec()

    def _read_spec(self) -> None:
        # Named, not super(): slots=True makes the class anew, and zero-argument super()
        # would name the class it replaced.
        RoutedNode._read_spec(self)
        defaults = default_costs(device_of(self.node.spec.kv_device))
        if defaults is not self.defaults:
            self.defaults = defaults
            self.costs = planned_costs(self.calibrated, self.correction, defaults)

    def calibrate(self, calibrated: Costs | None) -> None:
        """New measured costs (or none): the live correction starts again from 1."""
        self.calibrated = calibrated
        self.correction = Correction()
        self.costs = planned_costs(calibrated, self.correction, self.defaults)

    def observe(self, work: EngineWork) -> None:
        """Work the node's engine reported: its correction weighs it."""
        moved = observed(self.correction, work, self.calibrated or self.defaults)
        if moved is not None:
            self.correction = moved
            self.costs = planned_costs(self.calibrated, moved, self.defaults)


class NodeSessions:
    def __init__(self, context: RegistryContext) -> None:
        self._store = context.store
        self._config = context.config
        self._deadlines = context.deadlines
        self._now = context.now
        self._validate = context.validate
        self._log = context.log
        self.runtime: dict[str, NodeRuntime] = {}
        # model -> ready prefill and decode nodes, until a node's state changes
        self._routes: dict[str, Routes[NodeRuntime]] = {}

    # ----------------------------------------------------------------- reads

    async def node(self, node_id: str) -> Node:
        node = await self._store.get_node(self._validate.id(node_id, "node_id"))
        if node is None:
            raise NodeNotRegistered(f"node {node_id!r} is not registered")
        return node

    async def session(self, node_id: str, incarnation: str) -> Node:
        """The node, if ``incarnation`` is its live session; the caller speaks for the node."""
        node = await self.node(node_id)
        self._validate.id(incarnation, "incarnation")
        if node.spec.incarnation != incarnation:
            raise SessionLost(
                f"node {node_id!r} is now incarnation {node.spec.incarnation!r}, "
                f"not {incarnation!r}; register again"
            )
        if node.state == DOWN:
            raise SessionLost(
                f"node {node_id!r} lost its session (missed heartbeats); register again"
            )
        return node

    def view(self, node: Node) -> NodeAnswer:
        """The node as an answer, with its live figures."""
        answer = answering(node, NodeAnswer)
        runtime = self.runtime.get(node.node_id)
        if runtime is not None:
            answer.live_leases = self._store.live_lease_count(node.node_id)
            answer.retained_blocks = runtime.retained_blocks
            answer.drained = self.drained(runtime)
            answer.cost_correction = runtime.correction
        return answer

    def drained(self, runtime: NodeRuntime) -> bool:
        """A DRAINING node is drained, its engine free to stop, when it holds no live lease
        (claimed reads have finished, the rest were ended) and a heartbeat that arrived at
        least ``drain_quiet_s`` after the drain began and after its last lease ended reported
        no running or waiting request: a decode leg that follows a read just finished has
        reached the engine by then."""
        return (
            runtime.state == DRAINING
            and self._store.live_lease_count(runtime.node_id) == 0
            and runtime.queued == 0
            and runtime.load_at >= runtime.busy_at + self._config.drain_quiet_s
        )

    def draining(self, node_id: str) -> bool:
        runtime = self.runtime.get(node_id)
        return runtime is not None and runtime.state == DRAINING

    async def list_nodes(self, role: int = 0, model: str = "") -> list[NodeAnswer]:
        return [
            self.view(n)
            for n in await self._store.list_nodes()
            if (not role or n.spec.role == role) and (not model or n.spec.model == model)
        ]

    def figures(self) -> list[NodeFigures]:
        return [
            NodeFigures(
                node_id=r.node_id,
                state=label(node_pb2.NodeState, r.state),
                live_leases=self._store.live_lease_count(r.node_id),
                retained_blocks=r.retained_blocks,
                retained_bytes=r.retained_blocks * r.spec.bytes_per_block,
                retained_fraction=r.retained_fraction,
                prefill_correction=r.correction.prefill,
                read_correction=r.correction.read,
                awaiting_replay=not r.synced and r.state != DOWN,
            )
            for r in list(self.runtime.values())
        ]

    def routes(self, model: str) -> Routes[NodeRuntime]:
        """Ready nodes for ``model`` (cached until a node's state changes); raises routing's
        ``NoReadyNode``."""
        routes = self._routes.get(model)
        if routes is None:
            routes = self._routes[model] = candidates(self.runtime.values(), model)
        return routes

    @staticmethod
    def require_holder_role(node: Node) -> None:
        if node.spec.role not in DECODE_ROLES:
            raise NotADecodeNode(
                f"node {node.spec.node_id!r} is a prefill node; only decode nodes retain KV "
                "under leases"
            )

    def turn_finished(self, node_id: str) -> None:
        """A turn finished on the node (its retention was reported): one request fewer than
        its last heartbeat said."""
        runtime = self.runtime.get(node_id)
        if runtime is not None:
            runtime.finished_since_heartbeat += 1

    def prefill_finished(self, node_id: str, heartbeats: int) -> None:
        """A turn sent to prefill node ``node_id`` when it had had ``heartbeats`` heartbeats
        ended: it no longer counts as that node's load, unless a heartbeat since reported the
        node's load afresh (and so counted the turn, or its end, already)."""
        runtime = self.runtime.get(node_id)
        if runtime is not None and runtime.heartbeats == heartbeats:
            runtime.assigned_since_heartbeat = max(runtime.assigned_since_heartbeat - 1, 0)

    def account(self, node_id: str, blocks: int, sign: int) -> None:
        """Counts a lease of ``blocks`` in (+1) or out (-1) of its holder's retained blocks."""
        runtime = self.runtime.get(node_id)
        if runtime is not None:
            runtime.retained_blocks += sign * blocks
            if sign < 0:
                runtime.busy_at = self._now()

    # ----------------------------------------------------------------- transitions

    def refuse_rival(self, spec: node_pb2.NodeSpec, old: Node | None) -> None:
        """Raises ``NodeInUse`` while another incarnation's session of the node is live (not
        yet DOWN: it heartbeats within the session TTL, or has not been deregistered). One
        node id is one engine: two sidecars with it would withdraw each other's leases at
        every registration. A sidecar that replaces its own session ends it first (it
        deregisters); one started after a crash waits for the old session to lapse."""
        if old is None or old.spec.incarnation == spec.incarnation or old.state == DOWN:
            return
        started = old.registered_time or 0.0
        heard = old.last_heartbeat_time or started
        raise NodeInUse(
            f"node {spec.node_id!r} is already registered by a live session (another "
            f"incarnation, started at "
            f"{datetime.fromtimestamp(started, UTC).isoformat(timespec='seconds')}, last heard "
            f"{max(0.0, self._now() - heard):.1f} s ago); stop the other sidecar or wait for "
            f"its session to end (it ends {self._ttl():g} s after its last heartbeat, or when "
            "it deregisters)"
        )

    async def register(self, spec: node_pb2.NodeSpec, old: Node | None) -> Node:
        """Starts the session of ``spec`` (``old``: the node's record before, if any); the same
        incarnation registering again keeps its session's start and its draining."""
        now = self._now()
        node = Node(
            spec=codec.spec_of(spec),
            state=READY,
            registered_time=now,
            last_heartbeat_time=now,
        )
        same_incarnation = old is not None and old.spec.incarnation == spec.incarnation
        if old is not None and old.spec.engine_id == spec.engine_id:
            node.cost = old.cost  # the same engine: its calibration stands
        if old is not None and same_incarnation:
            node.registered_time = old.registered_time
            node.state = DRAINING if old.state == DRAINING else READY
        runtime = await self._put(node, fresh=not same_incarnation)
        runtime.calibrate(_costs(node))
        self._extend_session(spec.node_id, now)
        self._deadlines.cancel((DeadlineKind.FORGET_NODE, spec.node_id))
        self._log.info(
            "node_registered",
            node=spec.node_id,
            role=label(node_pb2.NodeRole, spec.role),
            incarnation=spec.incarnation,
        )
        return node

    async def heard(self, beat: Heartbeat) -> None:
        """A heartbeat has arrived, and may wait for the registry's lock behind a long report
        (a fleet's replays): its live session's deadline moves now, as if the heartbeat were
        applied, so the wait ends no session. Everything else waits for ``heartbeat`` under the
        lock. Unlocked and harmless if a mutation marks the node down meanwhile: a session
        deadline finds a node that is down and does nothing."""
        try:
            await self.session(beat.node_id, beat.incarnation)
        except (NodeNotRegistered, SessionLost):
            return  # refused as it should be once it has the lock
        self._extend_session(beat.node_id, self._now())

    async def heartbeat(self, beat: Heartbeat) -> Node:
        node_id = beat.node_id
        node = await self.session(node_id, beat.incarnation)
        now = self._now()
        node.last_heartbeat_time = now
        node.load = beat.load
        changed = False
        if node.state != DRAINING:
            new_state = READY if beat.engine_ready else NOT_READY
            if new_state != node.state:
                self._log.info(
                    "node_readiness", node=node_id, state=label(node_pb2.NodeState, new_state)
                )
                changed = True
            node.state = new_state
        # Load and heartbeat times are soft state; only a change of readiness is written.
        runtime = await self._put(node, durable=changed)
        runtime.note_load(beat.load)
        runtime.load_at = now
        runtime.heartbeats += 1
        runtime.assigned_since_heartbeat = runtime.finished_since_heartbeat = 0
        if beat.work is not None:
            runtime.observe(beat.work)
        self._extend_session(node_id, now)
        return node

    def _extend_session(self, node_id: str, now: float) -> None:
        self._deadlines.schedule((DeadlineKind.NODE_SESSION, node_id), now + self._ttl())

    async def drain(self, node_id: str) -> Node:
        """Marks the node DRAINING (its leases are the caller's to end); draining a draining
        node again changes nothing."""
        node = await self.node(node_id)
        if node.state == DOWN:
            raise NodeDown(f"node {node_id!r} is down; there is nothing to drain")
        if node.state == DRAINING and node_id in self.runtime:
            return node
        node.state = DRAINING
        runtime = await self._put(node)
        runtime.busy_at = self._now()
        self._log.info("node_draining", node=node_id)
        return node

    async def set_costs(self, node_id: str, cost: CostProfile | None) -> Node:
        """Stores a node's measured costs (``kvbroker calibrate``); the planner uses them from
        the next hint on, the live correction starting again from 1."""
        node = await self.node(node_id)
        node.cost = cost
        await self._store.put_node(node)
        runtime = self.runtime.get(node_id)
        if runtime is not None:
            runtime.keep(node)
            runtime.calibrate(_costs(node))
        self._log.info("node_costs", node=node_id)
        return node

    async def mark_down(self, node: Node, why: str) -> None:
        """Ends the node's session (its leases are withdrawn by the caller)."""
        node.state = DOWN
        self._deadlines.cancel((DeadlineKind.NODE_SESSION, node.node_id))
        self._schedule_forget(node.node_id, self._now())
        await self._put(node)
        self._log.warning("node_down", node=node.node_id, why=why)

    async def forget(self, node_id: str) -> bool:
        """Forgets a node that is still DOWN (its record, its runtime, and so its metric
        series); False if it came back meanwhile."""
        node = await self._store.get_node(node_id)
        if node is None or node.state != DOWN:
            return False
        await self._store.delete_node(node_id)
        if self.runtime.pop(node_id, None) is not None:
            self._routes.clear()
        self._log.info("node_forgotten", node=node_id)
        return True

    def _schedule_forget(self, node_id: str, since: float) -> None:
        key = (DeadlineKind.FORGET_NODE, node_id)
        self._deadlines.schedule(key, since + self._config.forget_down_nodes_after_s)

    def restore(self, nodes: list[Node]) -> None:
        """Runtimes for the nodes in the store (a takeover): not synced until they replay, and
        their sessions restart, as heartbeats could not reach a leader during the election."""
        now = self._now()
        for node in nodes:
            runtime = NodeRuntime.of_record(node)
            runtime.synced = False
            runtime.calibrate(_costs(node))
            self.runtime[node.node_id] = runtime
            if node.state != DOWN:
                self._extend_session(node.node_id, now)
            else:  # when it went down is not kept: a full retention from now
                self._schedule_forget(node.node_id, now)
        self._routes.clear()

    def retention_hard_cap_s(self, node_id: str) -> float | None:
        """The longest the node's engine keeps retained blocks after a lease command (None:
        not reported)."""
        runtime = self.runtime.get(node_id)
        cap = from_duration(runtime.spec.retention_hard_cap) if runtime is not None else 0.0
        return cap or None

    def current(self, node: Node) -> NodeRuntime:
        """The runtime of a node with a live session."""
        runtime = self.runtime.get(node.node_id)
        return runtime if runtime is not None else self._runtime_of(node)

    def _ttl(self) -> float:
        return self._config.session_ttl_s

    async def _put(self, node: Node, durable: bool = True, fresh: bool = False) -> NodeRuntime:
        """Stores the node's record and points its runtime at it (a new one for a new
        incarnation): the record is the one truth of the node's state."""
        await self._store.put_node(node, durable)
        return self._runtime_of(node, fresh)

    def _runtime_of(self, node: Node, fresh: bool = False) -> NodeRuntime:
        """The node's runtime over ``node``. Any change of who can be routed to drops the
        cached candidate lists."""
        runtime = None if fresh else self.runtime.get(node.node_id)
        if runtime is None:
            runtime = self.runtime[node.node_id] = NodeRuntime(node)
            self._routes.clear()
        else:
            if runtime.state != node.state:
                self._routes.clear()
            runtime.keep(node)
        return runtime


def _costs(node: Node) -> Costs | None:
    return node.cost.costs if node.cost is not None else None
