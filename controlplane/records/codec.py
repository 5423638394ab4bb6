"""Protobuf at the registry's edges, here and nowhere else: records (``controlplane.records.model``)
to and from wire messages (a call's input, an answer) and stored bytes (``Change.raw``, what a
backend writes, loads and watches).

The stored format is the wire record (``lease_pb2.Lease``, ``lease_pb2.Conversation``,
``node_pb2.Node``), so what etcd holds reads the same before and after the registry kept
records as objects. Fields that exist only in answers (a lease's ``time_to_live``, a node's
live figures) are the views' to fill, and are not part of a record.

Two things a lease carries pass through the registry unread, so they are kept as one bytes
object each: its checkpoint hashes (``Lease.block_hashes``: a lease's 32 hashes cost one
object instead of 32) and its handle less the request id (protobuf's own encoding: the engine
id, side channel, sizes, and the block ids as packed varints; going out is one
``MergeFromString`` in C). The hashes are kept end to end after one byte that gives their
length (``checkpoints``), not framed each by protobuf's two bytes: every hash of a lease has
one length (``BLOCK_HASH_BYTES``, the only one validation lets in), and at 8 bytes a hash the
framing would be a fifth of a lease's hashes. The length byte lets a record stored by an older
version, with 16-byte hashes, read back as it was; one whose hashes differ in length is kept
in protobuf's encoding behind a 0. Times are the registry's float seconds
inside and ``Timestamp`` outside (``kvbroker.common.rules.clock``): a round trip keeps them to float
precision.
"""

from __future__ import annotations

import functools
import struct
import sys
from collections.abc import Sequence

from google.protobuf.timestamp_pb2 import Timestamp

from kvbroker.common.rules.clock import from_timestamp, stamp_time
from kvbroker.common.rules.costs import Costs
from kvbroker.controlplane.records.model import (
    Conversation,
    CostProfile,
    EngineWork,
    KvHandle,
    Lease,
    Node,
    NodeLoad,
    Record,
)
from kvbroker.v1 import lease_pb2, node_pb2

intern = sys.intern


def block_count(handle: lease_pb2.KvHandle) -> int:
    return sum(len(group.block_ids) for group in handle.remote_block_groups)


# ---------------------------------------------------------------- leases


# A checkpoints blob's first byte when its hashes differ in length: protobuf's encoding follows.
_FRAMED = 0


def checkpoints(hashes: Sequence[bytes]) -> bytes:
    """Checkpoint hashes as one blob: empty for none, else their length as one byte and the
    hashes end to end (``_FRAMED`` and protobuf's encoding when their lengths differ)."""
    if not hashes:
        return b""
    width = len(hashes[0])
    if 0 < width < 256 and len(set(map(len, hashes))) == 1:
        return bytes((width,)) + b"".join(hashes)
    return bytes((_FRAMED,)) + lease_pb2.Lease(block_hashes=hashes).SerializeToString()


def checkpoints_of_width(blob: bytes, width: int) -> int:
    """How many hashes of ``width`` bytes ``blob`` holds end to end after its first byte, where
    the hash at place ``i`` starts at byte ``1 + i * width``; 0 when it holds none, or hashes of
    any other length (``checkpoint_hashes`` reads those)."""
    if not blob or blob[0] != width:
        return 0
    return (len(blob) - 1) // width


def checkpoint_hashes(blob: bytes) -> list[bytes]:
    """The hashes a ``checkpoints`` blob holds, in order."""
    return list(_cut(blob))


def _cut(blob: bytes) -> Sequence[bytes]:
    if not blob:
        return ()
    width = blob[0]
    if width == _FRAMED:
        return lease_pb2.Lease.FromString(blob[1:]).block_hashes
    return _layout(width, (len(blob) - 1) // width).unpack_from(blob, 1)


@functools.cache
def _layout(width: int, count: int) -> struct.Struct:
    """Cuts ``count`` hashes of ``width`` bytes in C: a hint copies a lease's hashes, and a
    comprehension of slices took 2.2 times as long (at most 257 counts a width)."""
    return struct.Struct(f"{width}s" * count)


def handle_of(message: lease_pb2.KvHandle, blocks: int | None = None) -> KvHandle:
    """``blocks``: the handle's block count, when the caller has counted it."""
    rest = lease_pb2.KvHandle()
    rest.CopyFrom(message)
    rest.ClearField("remote_request_id")
    return KvHandle(
        remote_request_id=message.remote_request_id,
        block_count=block_count(message) if blocks is None else blocks,
        packed=rest.SerializeToString(),
        registration_generation=message.remote_registration_generation,
    )


def handle_into(handle: KvHandle, into: lease_pb2.KvHandle) -> None:
    into.MergeFromString(handle.packed)
    into.remote_request_id = handle.remote_request_id


def lease_of(message: lease_pb2.Lease) -> Lease:
    return Lease(
        lease_id=message.lease_id,
        conversation_id=message.conversation_id,
        node_id=intern(message.node_id),
        node_incarnation=intern(message.node_incarnation),
        epoch=message.epoch,
        handle=handle_of(message.handle),
        checkpoints=checkpoints(message.block_hashes) if message.block_hashes else b"",
        block_hash_stride=message.block_hash_stride,
        token_count=message.token_count,
        state=message.state,
        end_cause=message.end_cause,
        end_reason=message.end_reason,
        grant_time=_time(message, "grant_time"),
        renew_time=_time(message, "renew_time"),
        expire_time=_time(message, "expire_time"),
        end_time=_time(message, "end_time"),
        claim_expire_time=_time(message, "claim_expire_time"),
    )


def retained_block_ids(lease: Lease | None) -> tuple[int, ...]:
    """A lease's retained block ids (its handle's first KV cache group), for the planner's
    ``Turn``: the registry keeps them packed (``handle_of``), unpacked only here."""
    if lease is None or not lease.handle.packed:
        return ()
    groups = lease_pb2.KvHandle.FromString(lease.handle.packed).remote_block_groups
    return tuple(groups[0].block_ids) if groups else ()


def lease_into(lease: Lease, into: lease_pb2.Lease) -> None:
    """Writes the record into ``into`` (an empty message): every field but ``time_to_live``,
    which only a view has."""
    into.block_hashes.extend(_cut(lease.checkpoints))
    into.lease_id = lease.lease_id
    into.conversation_id = lease.conversation_id
    into.node_id = lease.node_id
    into.node_incarnation = lease.node_incarnation
    into.epoch = lease.epoch
    handle_into(lease.handle, into.handle)
    into.block_hash_stride = lease.block_hash_stride
    into.token_count = lease.token_count
    into.state = lease.state
    into.end_cause = lease.end_cause
    into.end_reason = lease.end_reason
    _stamp(into.grant_time, lease.grant_time)
    _stamp(into.renew_time, lease.renew_time)
    _stamp(into.expire_time, lease.expire_time)
    _stamp(into.end_time, lease.end_time)
    _stamp(into.claim_expire_time, lease.claim_expire_time)


def lease_ack(lease: Lease, into: lease_pb2.Lease) -> None:
    """A retention report's answer for one lease: what the reporter lacks, no more (it has
    the handle and hashes; a replay of 100k leases would otherwise echo them all back)."""
    into.lease_id = lease.lease_id
    into.conversation_id = lease.conversation_id
    into.node_id = lease.node_id
    into.epoch = lease.epoch
    into.state = lease.state
    into.end_reason = lease.end_reason
    into.handle.remote_request_id = lease.handle.remote_request_id


def lease_bytes(lease: Lease) -> bytes:
    message = lease_pb2.Lease()
    lease_into(lease, message)
    return message.SerializeToString()


def lease_of_bytes(raw: bytes) -> Lease:
    return lease_of(lease_pb2.Lease.FromString(raw))


# ---------------------------------------------------------------- conversations


def conversation_of(message: lease_pb2.Conversation) -> Conversation:
    return Conversation(
        conversation_id=message.conversation_id,
        epoch=message.epoch,
        lease_id=message.lease_id,
        decode_node_id=intern(message.decode_node_id),
        last_active_time=_time(message, "last_active_time"),
    )


def conversation_into(conversation: Conversation, into: lease_pb2.Conversation) -> None:
    into.conversation_id = conversation.conversation_id
    into.epoch = conversation.epoch
    into.lease_id = conversation.lease_id
    into.decode_node_id = conversation.decode_node_id
    _stamp(into.last_active_time, conversation.last_active_time)


def conversation_bytes(conversation: Conversation) -> bytes:
    message = lease_pb2.Conversation()
    conversation_into(conversation, message)
    return message.SerializeToString()


def conversation_of_bytes(raw: bytes) -> Conversation:
    return conversation_of(lease_pb2.Conversation.FromString(raw))


# ---------------------------------------------------------------- nodes


def spec_of(message: node_pb2.NodeSpec) -> node_pb2.NodeSpec:
    """The registry's own copy of a spec it was sent (the sender's message may change)."""
    spec = node_pb2.NodeSpec()
    spec.CopyFrom(message)
    return spec


def load_of(message: node_pb2.NodeLoad) -> NodeLoad:
    return NodeLoad(message.running_requests, message.waiting_requests, message.kv_cache_usage)


def load_into(load: NodeLoad, into: node_pb2.NodeLoad) -> None:
    into.running_requests = load.running_requests
    into.waiting_requests = load.waiting_requests
    into.kv_cache_usage = load.kv_cache_usage


def work_of(message: node_pb2.EngineWork) -> EngineWork:
    return EngineWork(
        message.prefills,
        message.prefill_computed_tokens,
        message.prefill_cached_tokens,
        message.prefill_seconds,
        message.reads,
        message.read_blocks,
        message.read_seconds,
    )


def work_into(work: EngineWork, into: node_pb2.EngineWork) -> None:
    into.prefills = work.prefills
    into.prefill_computed_tokens = work.prefill_computed_tokens
    into.prefill_cached_tokens = work.prefill_cached_tokens
    into.prefill_seconds = work.prefill_seconds
    into.reads = work.reads
    into.read_blocks = work.read_blocks
    into.read_seconds = work.read_seconds


def cost_of(message: node_pb2.CostProfile) -> CostProfile | None:
    """A measured cost profile; None when it says no measurement."""
    if not message.HasField("calibrated_time"):
        return None
    return CostProfile(Costs.of(message), from_timestamp(message.calibrated_time))


def cost_into(cost: CostProfile, into: node_pb2.CostProfile) -> None:
    cost.costs.to_proto(into)
    stamp_time(into.calibrated_time, cost.calibrated_time)


def node_of(message: node_pb2.Node) -> Node:
    return Node(
        spec=message.spec,
        state=message.state,
        load=load_of(message.load),
        registered_time=_time(message, "registered_time"),
        last_heartbeat_time=_time(message, "last_heartbeat_time"),
        cost=cost_of(message.cost),
    )


def node_into(node: Node, into: node_pb2.Node) -> None:
    """Writes the record into ``into``; a node's live figures are its view's to add."""
    into.spec.CopyFrom(node.spec)
    into.state = node.state
    if node.load != NodeLoad():
        load_into(node.load, into.load)
    _stamp(into.registered_time, node.registered_time)
    _stamp(into.last_heartbeat_time, node.last_heartbeat_time)
    if node.cost is not None:
        cost_into(node.cost, into.cost)


def node_bytes(node: Node) -> bytes:
    message = node_pb2.Node()
    node_into(node, message)
    return message.SerializeToString()


def node_of_bytes(raw: bytes) -> Node:
    return node_of(node_pb2.Node.FromString(raw))


# ---------------------------------------------------------------- records


def record_bytes(record: Record) -> bytes:
    """A record's stored bytes."""
    if isinstance(record, Lease):
        return lease_bytes(record)
    if isinstance(record, Node):
        return node_bytes(record)
    return conversation_bytes(record)


# ---------------------------------------------------------------- times


def _time(
    message: lease_pb2.Lease | lease_pb2.Conversation | node_pb2.Node, name: str
) -> float | None:
    if not message.HasField(name):
        return None
    stamp: Timestamp = getattr(message, name)
    return from_timestamp(stamp)


def _stamp(into: Timestamp, seconds: float | None) -> None:
    if seconds is not None:
        stamp_time(into, seconds)
