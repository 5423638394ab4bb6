"""Hints from a copy of the leader's state: the rule a registry follower and a router's local
cache both answer dry-run hints by (``fed_hint``), which of them they may answer
(``served_locally``), how far behind the leader a copy is (``FeedClock``), and the pieces of
the leader's own hint they share with it (``reuse``, ``unpaired``, ``answer``).

One rule for every copy: the follower holds the registry's records (``controlplane.records``),
a router the stored messages themselves, so a copy says through ``HintState`` how to read a
lease's expiry and KV registration generation and how to write it into a hint. Safe however
late the copy: a dry run claims nothing, and a prefill node reads only what the leader
confirms is claimed at the handle's epoch (docs/design.md, "Hints on every replica").
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Generic, Protocol, TypeVar

from kvbroker.common.rules import routing
from kvbroker.common.rules.clock import stamp_duration
from kvbroker.common.rules.routing import LIVE_LEASE_STATES
from kvbroker.v1 import lease_pb2, registry_pb2

EXACT = registry_pb2.HINT_CONSISTENCY_EXACT
DEGRADED = registry_pb2.HINT_CONSISTENCY_DEGRADED
READ = registry_pb2.TURN_PATH_READ
RECOMPUTE = registry_pb2.TURN_PATH_RECOMPUTE
DECODE_LOCAL = registry_pb2.TURN_PATH_DECODE_LOCAL

N = TypeVar("N", bound=routing.NodeRecord)
L = TypeVar("L", bound=routing.LeaseRecord)
L_contra = TypeVar("L_contra", bound=routing.LeaseRecord, contravariant=True)


def served_locally(request: registry_pb2.GetRoutingHintRequest) -> bool:
    """Whether a copy of the leader's state may answer a hint (``fed_hint``): one that writes
    nothing (a dry run: no claim, no turn counted), and that the routing rule alone answers
    (nothing said of the prompt, no path asked for, no node placed on), as the leader's
    planner then has nothing to weigh either."""
    return request.dry_run and not (
        request.prompt_tokens or request.new_tokens or request.path or request.on_node_id
    )


class ConversationRecord(Protocol):
    @property
    def lease_id(self) -> str: ...
    @property
    def decode_node_id(self) -> str: ...


class HintState(Protocol, Generic[N, L_contra]):
    """A copy of the leader's hint state: its nodes, conversations and leases, and the
    leader's clock as far as the copy can tell."""

    def routes(self, model: str) -> routing.Routes[routing.RoutedNode[N]]: ...

    def node(self, node_id: str) -> routing.RoutedNode[N] | None: ...

    def conversation(self, conversation_id: str) -> ConversationRecord | None: ...

    def lease(self, lease_id: str) -> Any: ...

    def leader_now(self) -> float: ...

    def expire_time(self, lease: L_contra) -> float:
        """When the lease expires, on the leader's clock (0: not set)."""
        ...

    def generation(self, lease: L_contra) -> int:
        """The holder's KV registration generation when it retained the lease's blocks."""
        ...

    def lease_into(self, lease: L_contra, into: lease_pb2.Lease) -> None:
        """Writes the lease into a hint's (empty) lease, but for its time to live."""
        ...


def fed_hint(
    view: HintState[Any, Any], conversation_id: str, model: str, turn: int
) -> registry_pb2.RoutingHint:
    """A dry-run hint (``served_locally``) from a copy of the leader's state: the leader's own
    answer to it, but for the load it weighs (as of the last heartbeat the leader passed on,
    without the turns routed since) and a lease's read pins (the leader's alone). Raises
    ``routing.NoReadyNode`` when no ready node serves ``model``."""
    routes = view.routes(model)
    conversation = view.conversation(conversation_id) if conversation_id else None
    lease = (
        view.lease(conversation.lease_id)
        if conversation is not None and conversation.lease_id
        else None
    )
    holder = view.node(lease.node_id) if lease is not None else None
    time_left = view.expire_time(lease) - view.leader_now() if lease is not None else 0.0
    if lease is not None and lease.state in LIVE_LEASE_STATES and time_left <= 0:
        decided = routing.Reuse(
            registry_pb2.HINT_DECISION_RECOMPUTE,
            f"lease {lease.lease_id} was not renewed in time",
            registry_pb2.NO_REUSE_REASON_LEASE_NOT_LIVE,
        )
    else:
        # The leader holds a lease only once its holder replayed or reported to it.
        generation = view.generation(lease) if lease is not None else 0
        decided = reuse(conversation_id, conversation, lease, generation, holder, True)
    holder_id = conversation.decode_node_id if conversation is not None else ""
    prefill, decode = routing.choose(
        routes, turn, holder=holder_id, conversation=bool(conversation_id)
    )
    usable = lease if decided.reuses else None
    if routing.pairs(prefill, decode):
        path = READ if usable is not None else RECOMPUTE
    else:
        path, decided = DECODE_LOCAL, unpaired(decided, usable, decode)
    hint = registry_pb2.RoutingHint()
    answer(hint, decided, path, prefill, decode)
    if decided.reuses and lease is not None:
        view.lease_into(lease, hint.lease)
        stamp_duration(hint.lease.time_to_live, time_left)
    return hint


def reuse(
    conversation_id: str,
    conversation: object | None,
    lease: routing.LeaseRecord | None,
    generation: int,
    holder: routing.RoutedNode[Any] | None,
    holder_replayed: bool,
) -> routing.Reuse:
    """Whether the turn reuses ``lease`` (the conversation's current one, as of now, retained
    under KV registration ``generation``): the routing rule's decision, fenced by the holder's
    KV registration generation."""
    decided = routing.reuse_decision(conversation_id, conversation, lease, holder, holder_replayed)
    if decided.reuses and lease is not None and holder is not None:
        decided = routing.registered_anew(lease.lease_id, generation, holder.spec) or decided
    return decided


def unpaired(
    decided: routing.Reuse, usable: routing.LeaseRecord | None, decode: routing.RoutedNode[Any]
) -> routing.Reuse:
    """The decision when no prefill node can hand KV to ``decode`` (the turn is DECODE_LOCAL):
    a usable lease elsewhere is not reused."""
    if usable is None or usable.node_id == decode.node_id:
        return decided
    return routing.Reuse(
        registry_pb2.HINT_DECISION_RECOMPUTE,
        f"no prefill node can hand KV to {decode.node_id!r} (vLLM "
        f"{decode.spec.vllm_version or 'unreported'}): it computes the turn itself",
        registry_pb2.NO_REUSE_REASON_VERSION_MISMATCH,
    )


def answer(
    hint: registry_pb2.RoutingHint,
    decided: routing.Reuse,
    path: registry_pb2.TurnPath,
    prefill: routing.RoutedNode[Any],
    decode: routing.RoutedNode[Any] | None,
) -> None:
    """Writes a hint's decision, path and nodes (its lease and estimates are the caller's)."""
    hint.decision = decided.decision
    hint.reason = decided.reason
    hint.no_reuse = decided.no_reuse
    hint.consistency = EXACT if decided.exact else DEGRADED
    hint.prefill.CopyFrom(prefill.spec)
    if decode is not None:
        hint.decode.CopyFrom(decode.spec)
    hint.path = path


class FeedClock:
    """How far behind the leader a copy fed by ``WatchHintState`` is: the time since the last
    message, plus how much later than the least delayed message so far that message arrived
    (leader and copy clocks may differ by any constant: only differences of one side's times
    are used, as the clock rules say). A backlog anywhere on the way shows as delay; a copy
    re-served by a follower carries the leader's times, so its own lag counts too."""

    def __init__(self, now: Callable[[], float]) -> None:
        self._now = now
        # Whole once the snapshot has arrived.
        self.complete = False
        self.leader_time = 0.0
        self._received = -math.inf
        # The least (arrival - leader_time) seen: the clocks' offset plus the least delay.
        self._offset = math.inf
        self._delay = 0.0

    def heard(self, leader_time: float, snapshot_complete: bool) -> None:
        """A message stamped ``leader_time`` arrived now."""
        self.complete = self.complete or snapshot_complete
        received = self._now()
        self.leader_time = leader_time
        gap = received - leader_time
        self._offset = min(self._offset, gap)
        self._delay = gap - self._offset
        self._received = received

    def behind_s(self) -> float:
        """How long ago the leader's state was last known to be as the copy has it (infinite
        until the snapshot is whole)."""
        if not self.complete:
            return math.inf
        return self._delay + (self._now() - self._received)

    def leader_now(self) -> float:
        """The leader's clock now, as far as the copy can tell (for leases' time left)."""
        return self.leader_time + (self._now() - self._received)
