"""Protobuf to and from the registry's records, at the gRPC face and nowhere else.

On the leader the servicer turns a wide call's request into its request record
(``records.requests``) and each answer (``records.answers``) into its response here. Only the
leader converts: a follower relays the request and the leader's response whole
(``api.forwarder``), so nothing is converted back from a response. Stored fields go through
the records' own codec (``records.codec``); what only an answer has (a lease's time left, a
node's live figures, a registration's pace) is converted here.
"""

from __future__ import annotations

from dataclasses import asdict

from kvbroker.common.rules.clock import from_duration, stamp_duration, to_duration
from kvbroker.controlplane.placement.prefix_match import PrefixMatch
from kvbroker.controlplane.records import codec
from kvbroker.controlplane.records.answers import LeaseAnswer, NodeAnswer, Registration
from kvbroker.controlplane.records.model import Conversation
from kvbroker.controlplane.records.requests import (
    Heartbeat,
    LeaseGrant,
    LeaseListing,
    PrefixProbe,
    RetentionReport,
)
from kvbroker.v1 import lease_pb2, node_pb2, registry_pb2

# ---------------------------------------------------------------- requests


def ttl_of(
    request: registry_pb2.GrantLeaseRequest | registry_pb2.RenewLeaseRequest,
) -> float | None:
    """A grant's or renewal's asked time to live (None: the registry's choice)."""
    return from_duration(request.time_to_live) if request.HasField("time_to_live") else None


def grant_of(request: registry_pb2.GrantLeaseRequest) -> LeaseGrant:
    return LeaseGrant(
        request.conversation_id,
        request.node_id,
        request.node_incarnation,
        request.handle,
        request.block_hashes,
        request.token_count,
        ttl_of(request),
        request.block_hash_stride,
    )


def heartbeat_of(request: registry_pb2.HeartbeatRequest) -> Heartbeat:
    return Heartbeat(
        request.node_id,
        request.incarnation,
        request.engine_ready,
        codec.load_of(request.load),
        codec.work_of(request.work) if request.HasField("work") else None,
    )


def report_of(request: registry_pb2.ReportRetentionRequest) -> RetentionReport:
    return RetentionReport(
        request.node_id, request.incarnation, request.events, request.full_snapshot
    )


def probe_of(request: registry_pb2.MatchPrefixRequest) -> PrefixProbe:
    return PrefixProbe(
        request.node_id,
        request.conversation_id,
        request.model,
        request.block_size,
        request.probe_hashes,
    )


def listing_of(request: registry_pb2.ListLeasesRequest) -> LeaseListing:
    return LeaseListing(
        request.node_id,
        request.conversation_id,
        list(request.states),
        request.page_size,
        request.page_token,
    )


# ---------------------------------------------------------------- leases


def lease_message(answer: LeaseAnswer) -> lease_pb2.Lease:
    message = lease_pb2.Lease()
    codec.lease_into(answer, message)
    if answer.time_to_live is not None:
        stamp_duration(message.time_to_live, answer.time_to_live)
    if answer.pin_time_to_live is not None:
        stamp_duration(message.pin_time_to_live, answer.pin_time_to_live)
    return message


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


def registration_response(registration: Registration) -> registry_pb2.RegisterNodeResponse:
    return registry_pb2.RegisterNodeResponse(
        node=node_message(registration.node),
        heartbeat_interval=to_duration(registration.heartbeat_interval_s),
        session_ttl=to_duration(registration.session_ttl_s),
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
