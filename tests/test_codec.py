"""The codec: records survive the trip to stored bytes and back, and a stored record (what
etcd holds) survives the trip through a record, so stored contents stay compatible."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from kvbroker.common.rules.checkpoints import BLOCK_HASH_BYTES
from kvbroker.common.rules.costs import Costs
from kvbroker.controlplane.records import codec
from kvbroker.controlplane.records.model import (
    ACTIVE,
    BUDGET,
    CLAIMED,
    DOWN,
    DRAINED,
    DRAINING,
    ENGINE,
    EXPIRED,
    FENCED,
    IDLE,
    NO_CAUSE,
    NODE_LOST,
    NOT_READY,
    PRESSURE,
    READY,
    RELEASED,
    REVOKED,
    REVOKED_BY_CALLER,
    SUPERSEDED,
    Conversation,
    CostProfile,
    KvHandle,
    Lease,
    Node,
    NodeLoad,
)
from kvbroker.controlplane.storage.state_cache import RecordKind, decode
from kvbroker.v1 import lease_pb2, node_pb2
from kvbroker_tools.harness.factories import node_spec

ids = st.text(min_size=1, max_size=24)
texts = st.text(max_size=40)
u32 = st.integers(0, 2**32 - 1)
u64 = st.integers(0, 2**64 - 1)
# Registry clock readings: whole microseconds, within float precision of a Timestamp.
times = st.none() | st.integers(0, 4 * 10**15).map(lambda us: us / 1e6)
block_groups = st.lists(st.lists(u32, max_size=40), max_size=3)
hashes = st.lists(st.binary(min_size=1, max_size=64), max_size=40)
lease_states = st.sampled_from([ACTIVE, CLAIMED, RELEASED, EXPIRED, REVOKED])
causes = [
    NO_CAUSE,
    PRESSURE,
    BUDGET,
    IDLE,
    SUPERSEDED,
    REVOKED_BY_CALLER,
    NODE_LOST,
    ENGINE,
    FENCED,
    DRAINED,
]
end_causes = st.sampled_from(causes)
node_states = st.sampled_from([READY, NOT_READY, DRAINING, DOWN])


@st.composite
def handles(draw: st.DrawFn) -> lease_pb2.KvHandle:
    return lease_pb2.KvHandle(
        remote_engine_id=draw(texts),
        remote_request_id=draw(ids),
        remote_block_groups=[lease_pb2.BlockIdGroup(block_ids=g) for g in draw(block_groups)],
        remote_host=draw(texts),
        remote_port=draw(st.integers(0, 65535)),
        remote_num_tokens=draw(u32),
        tp_size=draw(u32),
        dcp_size=draw(u32),
        pp_size=draw(u32),
    )


@st.composite
def leases(draw: st.DrawFn) -> Lease:
    return Lease(
        lease_id=draw(ids),
        conversation_id=draw(ids),
        node_id=draw(ids),
        node_incarnation=draw(texts),
        epoch=draw(u64),
        handle=codec.handle_of(draw(handles())),
        checkpoints=codec.checkpoints(draw(hashes)),
        block_hash_stride=draw(u32),
        token_count=draw(u32),
        state=draw(lease_states),
        end_cause=draw(end_causes),
        end_reason=draw(texts),
        grant_time=draw(times),
        renew_time=draw(times),
        expire_time=draw(times),
        end_time=draw(times),
        claim_expire_time=draw(times),
    )


@st.composite
def conversations(draw: st.DrawFn) -> Conversation:
    return Conversation(draw(ids), draw(u64), draw(texts), draw(texts), draw(times))


@st.composite
def nodes(draw: st.DrawFn) -> Node:
    spec = node_spec(draw(ids))
    costs = st.floats(0, 1e6, allow_nan=False)
    cost = draw(
        st.none()
        | st.builds(
            CostProfile,
            st.builds(Costs, costs, costs, costs, costs, costs),
            st.integers(0, 4 * 10**15).map(lambda us: us / 1e6),
        )
    )
    load = NodeLoad(draw(u32), draw(u32), draw(st.floats(0, 1)))
    state = draw(node_states)
    return Node(spec, state, load, draw(times), draw(times), cost)


def assert_close(a: float | None, b: float | None) -> None:
    assert (a is None) == (b is None)
    if a is not None and b is not None:
        assert math.isclose(a, b, rel_tol=0, abs_tol=1e-6)


def same_lease(a: Lease, b: Lease) -> None:
    for name in ("grant_time", "renew_time", "expire_time", "end_time", "claim_expire_time"):
        assert_close(getattr(a, name), getattr(b, name))
        setattr(b, name, getattr(a, name))
    assert a == b


@given(leases())
def test_a_lease_round_trips_through_stored_bytes(lease: Lease) -> None:
    same_lease(lease, codec.lease_of_bytes(codec.lease_bytes(lease)))


@given(conversations())
def test_a_conversation_round_trips_through_stored_bytes(conversation: Conversation) -> None:
    back = codec.conversation_of_bytes(codec.conversation_bytes(conversation))
    assert_close(conversation.last_active_time, back.last_active_time)
    back.last_active_time = conversation.last_active_time
    assert back == conversation


@given(nodes())
def test_a_node_round_trips_through_stored_bytes(node: Node) -> None:
    back = decode(RecordKind.NODE, codec.record_bytes(node))
    assert isinstance(back, Node)
    for name in ("registered_time", "last_heartbeat_time"):
        assert_close(getattr(node, name), getattr(back, name))
        setattr(back, name, getattr(node, name))
    if node.cost is not None:
        assert back.cost is not None
        assert_close(node.cost.calibrated_time, back.cost.calibrated_time)
        back.cost = node.cost
    assert back == node


@given(handles(), hashes)
def test_a_stored_lease_reads_back_as_it_was_written(
    handle: lease_pb2.KvHandle, block_hashes: list[bytes]
) -> None:
    """What etcd holds: the wire record, its handle's groups and hashes exactly as given."""
    stored = lease_pb2.Lease(
        lease_id="l",
        conversation_id="c",
        node_id="d",
        epoch=3,
        handle=handle,
        block_hashes=block_hashes,
        state=lease_pb2.LEASE_STATE_ACTIVE,
    )
    stored.expire_time.FromSeconds(1_700_000_000)
    again = lease_pb2.Lease.FromString(codec.lease_bytes(codec.lease_of(stored)))
    assert again == stored
    assert codec.checkpoint_hashes(codec.checkpoints(block_hashes)) == block_hashes


def test_a_lease_s_hashes_cost_their_bytes_and_one() -> None:
    """Hashes of one length are kept end to end after it: 32 of 8 bytes take 257 bytes (with
    protobuf's framing 320); any other length reads back the same (a store of an older
    version's 16-byte hashes), and so do hashes of mixed lengths, framed."""
    ours = [bytes([i]) * BLOCK_HASH_BYTES for i in range(32)]
    assert len(codec.checkpoints(ours)) == 1 + 32 * BLOCK_HASH_BYTES
    older = [bytes([i]) * 16 for i in range(32)]
    mixed = [b"\x01" * 8, b"\x02" * 16]
    for hashes in (ours, older, mixed, []):
        assert codec.checkpoint_hashes(codec.checkpoints(hashes)) == hashes


def test_a_handle_keeps_its_block_count_and_groups() -> None:
    message = lease_pb2.KvHandle(
        remote_request_id="r",
        remote_block_groups=[lease_pb2.BlockIdGroup(block_ids=[1, 2, 3]), lease_pb2.BlockIdGroup()],
    )
    handle = codec.handle_of(message)
    assert handle.block_count == 3
    wire = lease_pb2.KvHandle()
    codec.handle_into(handle, wire)
    assert wire == message
    assert isinstance(handle, KvHandle)


def test_reads_and_views_leave_view_only_fields_out_of_the_record() -> None:
    """A lease's time to live and a node's live figures belong to answers, not records."""
    view = lease_pb2.Lease(lease_id="l", conversation_id="c", node_id="d")
    view.time_to_live.FromSeconds(5)
    assert not lease_pb2.Lease.FromString(codec.lease_bytes(codec.lease_of(view))).HasField(
        "time_to_live"
    )
    listed = node_pb2.Node(spec=node_spec("d"), live_leases=4, retained_blocks=9, drained=True)
    stored = node_pb2.Node.FromString(codec.node_bytes(codec.node_of(listed)))
    assert (stored.live_leases, stored.retained_blocks, stored.drained) == (0, 0, False)
