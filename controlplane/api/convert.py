"""Protobuf to and from the registry's answers, at the gRPC face and nowhere else.

The servicer turns each answer (``records.answers``) into its response here, and a follower's
``Forwarder`` turns the leader's response back into the answer the leader's registry gave, so
a call answers alike on either replica. Stored fields go through the records' own codec
(``records.codec``); what only an answer has (a lease's time left, a node's live figures, a
registration's pace) is converted here.
"""

from __future__ import annotations

from dataclasses import asdict, fields
from typing import Any

from kvbroker.common.rules.clock import from_duration, stamp_duration, to_duration
from kvbroker.controlplane.placement.prefix_match import PrefixMatch
from kvbroker.controlplane.records import codec
from kvbroker.controlplane.records.answers import (
    Correction,
    LeaseAnswer,
    NodeAnswer,
    Registration,
    answering,
    lease_answer,
)
from kvbroker.controlplane.records.model import Conversation, EngineWork
from kvbroker.v1 import lease_pb2, node_pb2, registry_pb2


def ttl_of(request: Any) -> float | None:
    """A grant's or renewal's asked time to live (None: the registry's choice)."""
    return from_duration(request.time_to_live) if request.HasField("time_to_live") else None


def work_of(request: registry_pb2.HeartbeatRequest) -> EngineWork | None:
    """A heartbeat's work since the last one (None: it said none)."""
    return codec.work_of(request.work) if request.HasField("work") else None


# ---------------------------------------------------------------- leases


def lease_message(answer: LeaseAnswer) -> lease_pb2.Lease:
    message = lease_pb2.Lease()
    codec.lease_into(answer, message)
    if answer.time_to_live is not None:
        stamp_duration(message.time_to_live, answer.time_to_live)
    if answer.pin_time_to_live is not None:
        stamp_duration(message.pin_time_to_live, answer.pin_time_to_live)
    return message


def lease_of(message: lease_pb2.Lease) -> LeaseAnswer:
    time_to_live = from_duration(message.time_to_live) if message.HasField("time_to_live") else None
    pinned = (
        from_duration(message.pin_time_to_live) if message.HasField("pin_time_to_live") else None
    )
    return lease_answer(codec.lease_of(message), time_to_live, pinned)


def conversation_message(conversation: Conversation) -> lease_pb2.Conversation:
    message = lease_pb2.Conversation()
    codec.conversation_into(conversation, message)
    return message


# ---------------------------------------------------------------- nodes


def node_message(answer: NodeAnswer) -> node_pb2.Node:
    message = node_pb2.Node()
    codec.node_into(answer, message)
    message.live_leases = answer.live_leases
    message.retained_blocks = answer.retained_blocks
    message.drained = answer.drained
    if answer.cost_correction is not None:
        message.cost_correction.CopyFrom(node_pb2.CostCorrection(**asdict(answer.cost_correction)))
    return message


def node_of(message: node_pb2.Node) -> NodeAnswer:
    correction = None
    if message.HasField("cost_correction"):
        sent = message.cost_correction
        correction = Correction(
            **{field.name: getattr(sent, field.name) for field in fields(Correction)}
        )
    return answering(
        codec.node_of(message),
        NodeAnswer,
        live_leases=message.live_leases,
        retained_blocks=message.retained_blocks,
        drained=message.drained,
        cost_correction=correction,
    )


def registration_response(registration: Registration) -> registry_pb2.RegisterNodeResponse:
    return registry_pb2.RegisterNodeResponse(
        node=node_message(registration.node),
        heartbeat_interval=to_duration(registration.heartbeat_interval_s),
        session_ttl=to_duration(registration.session_ttl_s),
    )


def registration_of(response: registry_pb2.RegisterNodeResponse) -> Registration:
    return Registration(
        node_of(response.node),
        from_duration(response.heartbeat_interval),
        from_duration(response.session_ttl),
    )


# ---------------------------------------------------------------- prefix matches


def match_message(match: PrefixMatch) -> registry_pb2.MatchPrefixResponse:
    response = registry_pb2.MatchPrefixResponse(
        matched_blocks=match.matched_blocks,
        no_reuse=match.no_reuse,
        reason=match.reason,
        pin_id=match.pin_id,
    )
    if match.lease is not None:
        response.lease.CopyFrom(lease_message(match.lease))
    return response


def match_of(message: registry_pb2.MatchPrefixResponse) -> PrefixMatch:
    lease = lease_of(message.lease) if message.HasField("lease") else None
    return PrefixMatch(
        lease, message.matched_blocks, message.no_reuse, message.reason, message.pin_id
    )
