"""Where a turn goes, and whether it reuses retained KV: the one routing rule.

The registry's leader, a follower answering from its cache while no leader can be reached,
and the router's own fallback while the registry is away all route with these functions, so
they can differ only in what they know, never in how they choose (as Dynamo keeps its KV
router's algorithm apart from its integration). Pure: nodes and records in, a choice out; no
store, no lock, no clock.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, Self, TypeVar

from kvbroker.common.rules.labels import label
from kvbroker.v1 import lease_pb2, node_pb2, registry_pb2

PREFILL_ROLES = frozenset({node_pb2.NODE_ROLE_PREFILL, node_pb2.NODE_ROLE_BOTH})
DECODE_ROLES = frozenset({node_pb2.NODE_ROLE_DECODE, node_pb2.NODE_ROLE_BOTH})
LIVE_LEASE_STATES = frozenset({lease_pb2.LEASE_STATE_ACTIVE, lease_pb2.LEASE_STATE_CLAIMED})


def read_refusal(lease: lease_pb2.Lease, epoch: int) -> str | None:
    """The fence a prefill node applies before it reads a lease's blocks (None: read). The
    lease must be CLAIMED, a hint handed it out and the claim still protects it, or live and
    held by a fork's read pin (``pinned``), at the handle's epoch; ACTIVE alone is not enough,
    its holder may be reclaiming the blocks for new work right now (docs/design.md, "The
    fencing argument")."""
    if lease.epoch != epoch:
        return f"stale epoch {epoch}: lease {lease.lease_id} is at epoch {lease.epoch}"
    if lease.state == lease_pb2.LEASE_STATE_CLAIMED or pinned(lease):
        return None
    why = f" ({lease.end_reason})" if lease.end_reason else ": its claim ended"
    return f"lease {lease.lease_id} is {label(lease_pb2.LeaseState, lease.state)}{why}"


def pinned(lease: lease_pb2.Lease) -> bool:
    """Whether read pins hold a live lease as of the message (forks read it by content): its
    blocks are kept for them as for a claim, and a reader must not free them
    (``CheckLeaseResponse.shared``)."""
    ttl = lease.pin_time_to_live
    return (
        lease.state in LIVE_LEASE_STATES
        and lease.HasField("pin_time_to_live")
        and (ttl.seconds > 0 or ttl.nanos > 0)
    )


# The drain rule, here and nowhere else. Only a READY node is routed to: a new conversation, a
# new turn's prefill or decode leg. A DRAINING node (its pod is going away) takes none of
# them, and its leases are not offered to new turns either: the registry ends the unclaimed
# ones when the drain starts (``LEASE_END_CAUSE_DRAINED``) and the conversation's next turn
# recomputes on another decode node. Reads it already handed out (CLAIMED leases) finish:
# ``read_refusal`` looks at the lease, not at its holder's state.
ROUTABLE_STATES = frozenset({node_pb2.NODE_STATE_READY})
# A holder in these states offers what it retains to a new turn.
SERVING_STATES = ROUTABLE_STATES

# Up to this many candidates the least loaded is found exactly; beyond, two random candidates
# are compared (power of two choices, as Envoy's least-request balancer does): O(1) per hint
# and within a small factor of the exact choice's balance.
EXACT_PICK_LIMIT = 8


class NodeLoad(Protocol):
    """A node's load as last reported (a ``node_pb2.NodeLoad``, or the registry's record)."""

    @property
    def running_requests(self) -> int: ...
    @property
    def waiting_requests(self) -> int: ...
    @property
    def kv_cache_usage(self) -> float: ...


class NodeRecord(Protocol):
    """A node as routing reads it: a listed ``node_pb2.Node``, or the registry's record."""

    @property
    def spec(self) -> node_pb2.NodeSpec: ...
    @property
    def state(self) -> node_pb2.NodeState: ...
    @property
    def load(self) -> NodeLoad: ...


R = TypeVar("R", bound=NodeRecord)


@dataclass(slots=True, eq=False)
class RoutedNode(Generic[R]):
    """What routing knows of a node: plain attributes, so a hint never walks proto fields
    (reading a proto field costs ~10x a Python attribute). Its spec and state are its
    record's, never copies of them."""

    node: R
    queued: int = 0
    kv_usage: float = 0.0
    # Hints that chose this node since its last heartbeat reported load.
    assigned_since_heartbeat: int = 0
    # Turns it finished since then (a decode node's retention report says so): the load its
    # last heartbeat reported is stale by these, just when a conversation's next turn comes.
    finished_since_heartbeat: int = 0
    # KV blocks retained there under live leases.
    retained_blocks: int = 0
    node_id: str = field(init=False)
    model: str = field(init=False)
    prefills: bool = field(init=False)
    decodes: bool = field(init=False)
    # A decode node that keeps finished turns' KV (unsaid by an older sidecar: it does).
    retains: bool = field(init=False)
    # What vLLM's NIXL handshake must find equal in a peer (``can_transfer``).
    handshake: Handshake = field(init=False)

    def __post_init__(self) -> None:
        self._read_spec()

    def _read_spec(self) -> None:
        spec = self.node.spec
        self.node_id = spec.node_id
        self.model = spec.model
        self.prefills = spec.role in PREFILL_ROLES
        self.decodes = spec.role in DECODE_ROLES
        self.retains = retains_kv(spec)
        self.handshake = handshake_of(spec)

    @property
    def spec(self) -> node_pb2.NodeSpec:
        return self.node.spec

    @property
    def state(self) -> node_pb2.NodeState:
        return self.node.state

    @classmethod
    def of_record(cls, node: R, retained_blocks: int = 0) -> Self:
        """A node as a listing or a replica's cache knows it."""
        routed = cls(node, retained_blocks=retained_blocks)
        routed.note_load(node.load)
        return routed

    @classmethod
    def of_node(cls, node: node_pb2.Node) -> RoutedNode[node_pb2.Node]:
        """A node as a listing says it."""
        return RoutedNode.of_record(node, node.retained_blocks)

    def note_load(self, load: NodeLoad) -> None:
        self.queued = load.running_requests + load.waiting_requests
        self.kv_usage = load.kv_cache_usage

    @property
    def pending(self) -> int:
        """Requests running or queued there as of now: the last report, plus the turns sent
        there since, less those it finished since."""
        return max(self.queued + self.assigned_since_heartbeat - self.finished_since_heartbeat, 0)

    @property
    def retained_fraction(self) -> float:
        capacity = self.spec.capacity_blocks
        return self.retained_blocks / capacity if capacity else 0.0


N = TypeVar("N", bound="RoutedNode[Any]")


class NoReadyNode(Exception):
    """No ready node of one role serves the model: there is nowhere to send the turn."""

    def __init__(self, role: str, model: str) -> None:
        served = f"model {model!r}" if model else "any model"
        super().__init__(f"no ready {role} node serves {served}")
        self.role = role
        self.model = model
        self.message = str(self)


@dataclass(frozen=True, slots=True)
class Routes(Generic[N]):
    """The ready prefill and decode nodes for one model, neither empty."""

    prefills: Sequence[N]
    decodes: Sequence[N]
    # Whether their NIXL connectors differ (a fleet mid-upgrade): then not every prefill node
    # can serve every decode node.
    mixed: bool = field(init=False)

    def __post_init__(self) -> None:
        reported = {n.handshake for n in (*self.prefills, *self.decodes) if any(n.handshake)}
        object.__setattr__(self, "mixed", len(reported) > 1)


def routable(node: RoutedNode[Any], model: str) -> bool:
    """Whether a new turn may go to ``node`` (never a DRAINING one, see ``ROUTABLE_STATES``)."""
    return node.state in ROUTABLE_STATES and (not model or node.model == model)


def retains_kv(spec: node_pb2.NodeSpec) -> bool:
    """Whether a decode node keeps finished turns' KV (unsaid by an older sidecar: it does)."""
    return spec.kv_retention != node_pb2.KV_RETENTION_OFF


def candidates(nodes: Iterable[N], model: str) -> Routes[N]:
    """Ready prefill and decode nodes for ``model``; raises ``NoReadyNode`` when a side is
    empty. A DRAINING node is never among them, so ``choose`` sends neither a new conversation
    nor a new turn's decode leg there, even the conversation it last served."""
    ready = [n for n in nodes if routable(n, model)]
    prefills = [n for n in ready if n.prefills]
    decodes = [n for n in ready if n.decodes]
    if not prefills:
        raise NoReadyNode("prefill", model)
    if not decodes:
        raise NoReadyNode("decode", model)
    return Routes(prefills, decodes)


def load(node: RoutedNode[Any]) -> tuple[int, float]:
    """Queued work first, then KV headroom: the cache in use as last reported, or what is known
    to be retained there now, whichever is more (new work goes where retention leaves room)."""
    return node.pending, max(node.kv_usage, node.retained_fraction)


# For a conversation's turn, a retaining decode node counts this many requests fewer than it
# has. The registry's count of a node's requests is off by a request or two between its
# heartbeats (a turn without a conversation leaves it only at the next heartbeat), and a turn
# sent to a node that keeps nothing loses the reuse of every later turn until it moves back.
RETAINING_PREFERENCE = 1


def conversation_load(node: RoutedNode[Any]) -> tuple[int, bool, float]:
    """``load`` for a conversation's turn: a retaining node ahead of one that does not retain
    unless it is busier by more than ``RETAINING_PREFERENCE`` requests, as only a retaining
    node keeps the turn's KV for the next one. What it retains is a cache that yields to new
    work, not a reason to send the conversation elsewhere: counted as usage here, it would push
    every new conversation of a fleet mid-rollout onto the nodes that keep nothing."""
    pending, usage = load(node)
    if node.retains:
        pending -= RETAINING_PREFERENCE
    return pending, not node.retains, usage


def pick(
    nodes: Sequence[N], turn: int, key: Callable[[RoutedNode[Any]], tuple[Any, ...]] = load
) -> N:
    """The least loaded of ``nodes`` by ``key`` (ties rotate with ``turn``)."""
    count = len(nodes)
    if count > EXACT_PICK_LIMIT:
        first = random.randrange(count)
        second = (first + 1 + random.randrange(count - 1)) % count
        return min(nodes[first], nodes[second], key=key)
    turn %= count
    return min([*nodes[turn:], *nodes[:turn]], key=key)


def choose(
    routes: Routes[N], turn: int, holder: str = "", conversation: bool = False
) -> tuple[N, N]:
    """The prefill and decode node for a turn.

    The decode node: the one that holds the conversation's KV (or last served it) while it is
    READY (not DRAINING) and retains KV, else the least loaded (``conversation_load`` for a
    turn of a ``conversation``, which prefers a retaining node; ``load`` for a turn without
    one). A holder that retains nothing keeps nothing for the conversation, so it is not kept:
    a conversation that once landed there moves to a retaining node as soon as one is as free.
    In a fleet mid-upgrade a new placement goes to a decode node that some prefill node can
    hand KV to, while there is one.

    The prefill node: the least loaded among those that can hand KV to the decode node. When
    none can (``pairs`` is False for the pair returned), the turn has no prefill leg: the
    decode node computes it (DECODE_LOCAL), as vLLM refuses a transfer across versions."""
    decodes = routes.decodes
    kept = next((d for d in decodes if d.node_id == holder and d.retains), None)
    if kept is not None:
        decode = kept
    else:
        if routes.mixed:
            decodes = [d for d in decodes if _pairable(routes.prefills, d)] or decodes
        decode = pick(decodes, turn, key=conversation_load if conversation else load)
    prefills = routes.prefills
    if routes.mixed:
        prefills = [p for p in prefills if pairs(p, decode)] or prefills
    return pick(prefills, turn), decode


def pairs(prefill: RoutedNode[Any], decode: RoutedNode[Any]) -> bool:
    """Whether ``prefill`` can hand a turn's KV to ``decode`` (P/D needs it: else the turn is
    the decode node's alone, DECODE_LOCAL)."""
    return _compatible(prefill.handshake, decode.handshake)


def _pairable(prefills: Sequence[RoutedNode[Any]], decode: RoutedNode[Any]) -> bool:
    return any(pairs(prefill, decode) for prefill in prefills)


Handshake = tuple[int, str]


def handshake_of(spec: node_pb2.NodeSpec) -> Handshake:
    """A node's NIXL connector version and vLLM version, as it reported them (0 and "": not
    reported, an older sidecar)."""
    return spec.nixl_connector_version, spec.vllm_version


def can_transfer(reader: node_pb2.NodeSpec, owner: node_pb2.NodeSpec) -> bool:
    """Whether ``reader``'s NIXL connector can read KV from ``owner``'s: vLLM's handshake
    compares a hash of the connector version (0.32's is 14, 0.33's 15, 0.34's 16) and the vLLM
    version, and refuses a peer whose hash differs."""
    return _compatible(handshake_of(reader), handshake_of(owner))


def _compatible(a: Handshake, b: Handshake) -> bool:
    """Equal where both reported (a field a node does not report matches anything)."""
    return all(not mine or not theirs or mine == theirs for mine, theirs in zip(a, b, strict=True))


@dataclass(frozen=True, slots=True)
class Reuse:
    """Whether a turn reuses retained KV, and why."""

    decision: registry_pb2.HintDecision
    reason: str
    # Why it does not reuse (UNSPECIFIED when it does): what code decides on.
    no_reuse: registry_pb2.NoReuseReason = registry_pb2.NO_REUSE_REASON_UNSPECIFIED
    # False when the answer rests on state the answering registry cannot vouch for.
    exact: bool = True

    @property
    def reuses(self) -> bool:
        return bool(self.decision == registry_pb2.HINT_DECISION_REUSE)


class LeaseRecord(Protocol):
    """A lease as the reuse rule reads it: a ``lease_pb2.Lease``, or the registry's record."""

    @property
    def lease_id(self) -> str: ...
    @property
    def node_id(self) -> str: ...
    @property
    def epoch(self) -> int: ...
    @property
    def token_count(self) -> int: ...
    @property
    def state(self) -> lease_pb2.LeaseState: ...
    @property
    def end_cause(self) -> lease_pb2.LeaseEndCause: ...
    @property
    def end_reason(self) -> str: ...


NO_CONVERSATION = registry_pb2.NO_REUSE_REASON_NO_CONVERSATION


def reuse_decision(
    conversation_id: str,
    conversation: object | None,
    lease: LeaseRecord | None,
    holder: RoutedNode[Any] | None,
    holder_replayed: bool,
) -> Reuse:
    """The leader's decision for a conversation's next turn, from its current ``lease`` (as of
    now: an expired one already ended) and that lease's ``holder``; ``holder_replayed`` is False
    while the holder has not replayed its retention to this leader since it took over."""
    if not conversation_id:
        return Reuse(
            registry_pb2.HINT_DECISION_MISS, "no conversation id: plain P/D", NO_CONVERSATION
        )
    if conversation is None:
        return Reuse(
            registry_pb2.HINT_DECISION_MISS, "first turn of this conversation", NO_CONVERSATION
        )
    if lease is None:
        return Reuse(
            registry_pb2.HINT_DECISION_MISS,
            "nothing retained for this conversation",
            registry_pb2.NO_REUSE_REASON_NOTHING_RETAINED,
        )
    recompute = registry_pb2.HINT_DECISION_RECOMPUTE
    not_live = registry_pb2.NO_REUSE_REASON_LEASE_NOT_LIVE
    unavailable = registry_pb2.NO_REUSE_REASON_HOLDER_UNAVAILABLE
    if lease.state not in LIVE_LEASE_STATES:
        cause = label(lease_pb2.LeaseEndCause, lease.end_cause)
        return Reuse(
            recompute, f"lease {lease.lease_id} ended ({cause}): {lease.end_reason}", not_live
        )
    if lease.state == lease_pb2.LEASE_STATE_CLAIMED:
        return Reuse(recompute, f"lease {lease.lease_id} is claimed by a read in flight", not_live)
    if holder is None or holder.state not in SERVING_STATES:
        state = label(node_pb2.NodeState, holder.state) if holder is not None else "gone"
        return Reuse(recompute, f"holder node {lease.node_id!r} is {state}", unavailable)
    if not holder_replayed:
        return Reuse(
            recompute,
            f"holder node {lease.node_id!r} has not replayed its retained blocks to this "
            "registry since it took over",
            unavailable,
            exact=False,
        )
    return Reuse(
        registry_pb2.HINT_DECISION_REUSE,
        f"lease {lease.lease_id} (epoch {lease.epoch}) on {lease.node_id} holds "
        f"{lease.token_count} tokens",
    )


def registered_anew(
    lease_id: str, handle_generation: int, holder: node_pb2.NodeSpec
) -> Reuse | None:
    """The fence on vLLM 0.33+'s KV registration generation: a lease whose blocks were
    retained under an older registration of the holder's KV cache than its current one is
    declined, as a stale epoch is (None: the generations agree, or either is not reported)."""
    current = holder.registration_generation
    if not handle_generation or not current or handle_generation >= current:
        return None
    return Reuse(
        registry_pb2.HINT_DECISION_RECOMPUTE,
        f"lease {lease_id} was retained under KV registration generation {handle_generation}; "
        f"the holder is at {current}",
        registry_pb2.NO_REUSE_REASON_LEASE_NOT_LIVE,
    )


def leaderless_decision(conversation_known: bool, why: str) -> Reuse:
    """A follower's decision while no leader can be reached: never reuse (only a leader may
    claim a lease)."""
    return Reuse(
        registry_pb2.HINT_DECISION_RECOMPUTE
        if conversation_known
        else registry_pb2.HINT_DECISION_MISS,
        f"no registry leader reachable ({why}): recompute, from a replica's cache",
        registry_pb2.NO_REUSE_REASON_NO_LEADER,
        exact=False,
    )
