"""The registry's records as plain objects: nodes, conversations, leases and their KV handles.

Protobuf is the wire format and the stored format, and only that: ``controlplane.records.codec``
turns messages into these records where a call or a backend's bytes come in and back where an
answer or a write goes out. Inside, the parts read and change plain attributes (reading a
proto field costs ~10x a Python attribute, and a parsed lease costs ~3 KB of upb objects).

States and causes are the proto enums' own values (one truth for numbers and labels,
``kvbroker.common.rules.labels`` names them). What a lease carries for its reader without the
registry looking into it is kept packed, as the codec describes: its checkpoint hashes are one
bytes blob, its handle's engine id, side channel and block ids one more, and what the registry
does read (the request id, the block count) is kept beside them. Node ids and incarnations are
interned by the codec and the lessor, so a million leases share one string per node.

Copies: the store never shares a record with a caller. It keeps a copy of what is put and
hands out a copy on every read (``copy()``, which copies only the record's own object: every
field is immutable, and the handle, load and cost profile are frozen), so a change exists once
it is put back and nothing else sees it before.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypeAlias

from kvbroker.common.rules.costs import Costs
from kvbroker.v1 import lease_pb2, node_pb2

LeaseState: TypeAlias = lease_pb2.LeaseState
LeaseEndCause: TypeAlias = lease_pb2.LeaseEndCause
NodeState: TypeAlias = node_pb2.NodeState

ACTIVE = lease_pb2.LEASE_STATE_ACTIVE
CLAIMED = lease_pb2.LEASE_STATE_CLAIMED
RELEASED = lease_pb2.LEASE_STATE_RELEASED
EXPIRED = lease_pb2.LEASE_STATE_EXPIRED
REVOKED = lease_pb2.LEASE_STATE_REVOKED

# Why leases end (the cause is what code decides on; the reason is the sentence for people).
NO_CAUSE = lease_pb2.LEASE_END_CAUSE_UNSPECIFIED
PRESSURE = lease_pb2.LEASE_END_CAUSE_PRESSURE
BUDGET = lease_pb2.LEASE_END_CAUSE_BUDGET
IDLE = lease_pb2.LEASE_END_CAUSE_IDLE
SUPERSEDED = lease_pb2.LEASE_END_CAUSE_SUPERSEDED
REVOKED_BY_CALLER = lease_pb2.LEASE_END_CAUSE_REVOKED
NODE_LOST = lease_pb2.LEASE_END_CAUSE_NODE_LOST
ENGINE = lease_pb2.LEASE_END_CAUSE_ENGINE
FENCED = lease_pb2.LEASE_END_CAUSE_FENCED
DRAINED = lease_pb2.LEASE_END_CAUSE_DRAINED
RECLAIM_CAUSES = frozenset({PRESSURE, BUDGET})

READY = node_pb2.NODE_STATE_READY
NOT_READY = node_pb2.NODE_STATE_NOT_READY
DRAINING = node_pb2.NODE_STATE_DRAINING
DOWN = node_pb2.NODE_STATE_DOWN


@dataclass(frozen=True, slots=True)
class KvHandle:
    """What a prefill node needs to read a lease's blocks (``lease_pb2.KvHandle``). The
    registry reads two things in it, the engine request it names and how many blocks it
    holds; the rest (engine id, side channel, block ids, sizes) only passes through to
    readers, so it stays packed as one blob (``codec.handle_of``)."""

    remote_request_id: str = ""
    block_count: int = 0
    packed: bytes = b""
    # vLLM 0.33+: the holder's KV registration generation when it retained the blocks (0:
    # vLLM 0.32); the reuse rule compares it with the holder's current one.
    registration_generation: int = 0


_new = object.__new__
# the slots' own descriptors (``vars``: the class attribute, which mypy types as the field)
_set_request_id = vars(KvHandle)["remote_request_id"].__set__
_set_block_count = vars(KvHandle)["block_count"].__set__
_set_packed = vars(KvHandle)["packed"].__set__
_set_generation = vars(KvHandle)["registration_generation"].__set__


def kv_handle(
    remote_request_id: str, block_count: int, packed: bytes, registration_generation: int
) -> KvHandle:
    """``KvHandle(...)`` in ~0.4 us, not ~1.2: sets the slots directly, not through the
    frozen dataclass's guarded ``__setattr__``. For the state cache, which builds a handle
    on every read of a lease (``storage.lease_rows``)."""
    handle: KvHandle = _new(KvHandle)
    _set_request_id(handle, remote_request_id)
    _set_block_count(handle, block_count)
    _set_packed(handle, packed)
    _set_generation(handle, registration_generation)
    return handle


@dataclass(slots=True)
class Lease:
    """Retained KV of one conversation turn on one decode node. Times are the registry's clock
    (seconds; None: not set); ``expire_time`` is the one record of when the lease expires,
    and the lessor derives its deadlines from it."""

    lease_id: str
    conversation_id: str
    node_id: str
    node_incarnation: str = ""
    epoch: int = 0
    handle: KvHandle = field(default_factory=KvHandle)
    # The prefix hashes at checkpoints, end to end after their length (``codec.checkpoints``).
    checkpoints: bytes = b""
    block_hash_stride: int = 0
    token_count: int = 0
    state: LeaseState = lease_pb2.LEASE_STATE_UNSPECIFIED
    end_cause: LeaseEndCause = NO_CAUSE
    end_reason: str = ""
    grant_time: float | None = None
    renew_time: float | None = None
    expire_time: float | None = None
    end_time: float | None = None
    # While CLAIMED: when the claim ends.
    claim_expire_time: float | None = None

    def copy(self) -> Lease:
        return Lease(
            self.lease_id,
            self.conversation_id,
            self.node_id,
            self.node_incarnation,
            self.epoch,
            self.handle,
            self.checkpoints,
            self.block_hash_stride,
            self.token_count,
            self.state,
            self.end_cause,
            self.end_reason,
            self.grant_time,
            self.renew_time,
            self.expire_time,
            self.end_time,
            self.claim_expire_time,
        )


@dataclass(slots=True)
class Conversation:
    """A multi-turn conversation: its epoch, newest lease and last decode node."""

    conversation_id: str
    epoch: int = 0
    lease_id: str = ""
    decode_node_id: str = ""
    last_active_time: float | None = None

    def copy(self) -> Conversation:
        return Conversation(
            self.conversation_id,
            self.epoch,
            self.lease_id,
            self.decode_node_id,
            self.last_active_time,
        )


@dataclass(frozen=True, slots=True)
class NodeLoad:
    running_requests: int = 0
    waiting_requests: int = 0
    kv_cache_usage: float = 0.0


@dataclass(frozen=True, slots=True)
class EngineWork:
    """What a node's engine did since its last heartbeat (``node_pb2.EngineWork``): finished
    prefills, the tokens they computed and found cached, and their seconds; and the KV reads
    into it, their blocks and seconds."""

    prefills: int = 0
    prefill_computed_tokens: int = 0
    prefill_cached_tokens: int = 0
    prefill_seconds: float = 0.0
    reads: int = 0
    read_blocks: float = 0.0
    read_seconds: float = 0.0


@dataclass(frozen=True, slots=True)
class CostProfile:
    """A node's measured costs and when they were measured."""

    costs: Costs
    calibrated_time: float


@dataclass(slots=True)
class Node:
    """A node's session as stored. Its spec stays the message its sidecar registered with:
    the registry never changes one, and every hint copies two of them out as they are."""

    spec: node_pb2.NodeSpec
    state: NodeState = node_pb2.NODE_STATE_UNSPECIFIED
    load: NodeLoad = NodeLoad()
    registered_time: float | None = None
    last_heartbeat_time: float | None = None
    # None until calibrated: the registry's defaults apply.
    cost: CostProfile | None = None

    @property
    def node_id(self) -> str:
        return self.spec.node_id

    def copy(self) -> Node:
        return Node(
            self.spec,
            self.state,
            self.load,
            self.registered_time,
            self.last_heartbeat_time,
            self.cost,
        )


Record = Node | Conversation | Lease
