"""The registry's wide calls, each as one request record: their parameter lists, once.

A grant, a heartbeat, a retention report, a prefix match and a lease listing carry four to
eight values from the gRPC face (``api.convert``) through
the ``Registry`` to the check of their content (``records.validation``) and the part that
applies them. Spelled as positional parameters, each list was copied at every step and a new
field meant editing each copy; as one frozen record a field is added here and where it is
read. Protobuf stays where the record keeps a message (a grant's KV handle, stored as the
engine wrote it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvbroker.controlplane.records.model import EngineWork, NodeLoad
from kvbroker.v1 import lease_pb2, registry_pb2


@dataclass(frozen=True, slots=True)
class LeaseGrant:
    """A decode node's ask for a lease on the KV it retained for a conversation's turn."""

    conversation_id: str
    node_id: str
    incarnation: str
    handle: lease_pb2.KvHandle
    block_hashes: Sequence[bytes]
    token_count: int
    # The asked time to live in seconds (None: the registry's choice).
    ttl: float | None = None
    # Every how many blocks ``block_hashes`` holds a prefix hash (``Checkpoints``).
    block_hash_stride: int = 1


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """A node's heartbeat: its engine's readiness and load, and the work it did since the
    last one (None: it said none)."""

    node_id: str
    incarnation: str
    engine_ready: bool
    load: NodeLoad
    work: EngineWork | None = None


@dataclass(frozen=True, slots=True)
class RetentionReport:
    """A decode node's report of what its engine retained, let go of or was asked to give
    back; a full snapshot (after a restart of either side) is everything it retains."""

    node_id: str
    incarnation: str
    events: Sequence[registry_pb2.RetentionEvent]
    full_snapshot: bool = False


@dataclass(frozen=True, slots=True)
class PrefixProbe:
    """A prefill node's question: which live lease its prompt (hashed at checkpoints, in
    ``probes``) shares the longest prefix with, for its conversation (or none)."""

    node_id: str
    conversation_id: str
    model: str
    block_size: int
    probes: Sequence[bytes]


@dataclass(frozen=True, slots=True)
class LeaseListing:
    """Which leases to list, one page at a time (empty fields: no filter; no states: the
    live ones)."""

    node_id: str = ""
    conversation_id: str = ""
    states: Sequence[int] = ()
    page_size: int = 0
    page_token: str = ""


# The first page of every live lease (a frozen record: one default for every caller).
LIVE_LEASES = LeaseListing()
