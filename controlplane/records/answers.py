"""What the registry's calls answer: its records as of now, with what only an answer has.

A stored record says what was written; an answer adds what is read off the live registry when
it is given: a lease's time left, a node's live figures. The leader builds these, a follower
rebuilds them from the leader's answer, and the gRPC face turns either into the same response
(``controlplane.api.convert``), so the domain never builds a protobuf answer. Two answers are
the measured exceptions and stay protobuf: a batch of hints and a retention report's acks are
written straight into their responses (``Registry.routing_hints``, ``report_retention``).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, TypeVar

from kvbroker.controlplane.records.model import Lease, Node

# An answer type: a record's dataclass extended with fields only an answer has.
AnswerT = TypeVar("AnswerT")


def answering(record: Lease | Node, answer_type: type[AnswerT], **figures: Any) -> AnswerT:
    """``record`` as its answer type, every stored field carried over by name, plus the
    answer's own ``figures``: one copy of a record into its answer, whatever fields the record
    gains."""
    stored = {field.name: getattr(record, field.name) for field in fields(record)}
    return answer_type(**stored, **figures)


@dataclass(slots=True)
class LeaseAnswer(Lease):
    """A lease as answered: ``time_to_live`` is the time left as of the answer, for a live
    lease (None: it has ended); ``pin_time_to_live`` the time left on its read pins (None:
    unpinned)."""

    time_to_live: float | None = None
    pin_time_to_live: float | None = None


def lease_answer(
    lease: Lease, time_to_live: float | None, pin_time_to_live: float | None = None
) -> LeaseAnswer:
    return answering(
        lease, LeaseAnswer, time_to_live=time_to_live, pin_time_to_live=pin_time_to_live
    )


@dataclass(frozen=True, slots=True)
class Correction:
    """A node's live cost correction as of the answer: factors on its prefill and read
    figures (1: as calibrated) and the heartbeats that moved each."""

    prefill: float = 1.0
    read: float = 1.0
    prefill_samples: int = 0
    read_samples: int = 0


@dataclass(slots=True)
class NodeAnswer(Node):
    """A node as answered, with its live figures: the leases it holds live and their blocks,
    whether its drain is done, and its cost correction (None: the registry keeps no live
    state for it, as for a node just restored)."""

    live_leases: int = 0
    retained_blocks: int = 0
    drained: bool = False
    cost_correction: Correction | None = None


@dataclass(frozen=True, slots=True)
class Registration:
    """A node's new session and the pace its sidecar keeps: heartbeats every
    ``heartbeat_interval_s``, and the session ends after ``session_ttl_s`` without one. The
    pace is the leader's settings, which a follower passes on as the leader said them."""

    node: NodeAnswer
    heartbeat_interval_s: float
    session_ttl_s: float
