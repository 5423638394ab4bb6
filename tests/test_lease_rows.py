"""The state cache's lease rows against a plain dictionary of leases: any sequence of puts
(new leases, rewrites whose blobs grow or shrink) and deletes reads back the same records,
through row reuse and arena compaction."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvbroker.controlplane.records.model import KvHandle, Lease
from kvbroker.controlplane.storage import lease_rows
from kvbroker.controlplane.storage.lease_rows import LeaseRows
from kvbroker.v1 import lease_pb2

_times = st.one_of(st.none(), st.floats(allow_nan=False, allow_infinity=False))
_blobs = st.binary(max_size=64)
_names = st.sampled_from(["", "node-a", "node-b", "incarnation-1"])

_leases = st.builds(
    Lease,
    lease_id=st.sampled_from([f"lease-{i}" for i in range(8)]),
    conversation_id=st.text(max_size=4),
    node_id=_names,
    node_incarnation=_names,
    epoch=st.integers(0, 2**40),
    handle=st.builds(
        KvHandle,
        remote_request_id=st.text(max_size=4),
        block_count=st.integers(0, 4096),
        packed=_blobs,
        registration_generation=st.integers(0, 2**40),
    ),
    checkpoints=_blobs,
    block_hash_stride=st.integers(0, 64),
    token_count=st.integers(0, 2**40),
    state=st.sampled_from(lease_pb2.LeaseState.values()),
    end_cause=st.sampled_from(lease_pb2.LeaseEndCause.values()),
    end_reason=st.text(max_size=4),
    grant_time=_times,
    renew_time=_times,
    expire_time=_times,
    end_time=_times,
    claim_expire_time=_times,
)

# a put, or a delete of one id
_steps = st.lists(
    st.one_of(_leases, st.sampled_from([f"lease-{i}" for i in range(8)])), max_size=60
)


def _check(rows: LeaseRows, model: dict[str, Lease]) -> None:
    assert len(rows) == len(model)
    assert sorted(rows.keys()) == sorted(model)
    assert dict(rows) == model
    for lease_id, lease in model.items():
        assert rows.get(lease_id) == lease
        assert rows[lease_id] == lease
        assert rows.node_id(lease_id) == lease.node_id
        assert rows.conversation_id(lease_id) == lease.conversation_id
        assert rows.request_id(lease_id) == lease.handle.remote_request_id


@settings(max_examples=300, deadline=None)
@given(steps=_steps, compact_at=st.sampled_from([0, 1 << 20]))
def test_rows_read_back_what_a_dictionary_holds(steps: list[Lease | str], compact_at: int) -> None:
    original = lease_rows._MIN_COMPACT
    lease_rows._MIN_COMPACT = compact_at  # 0: compacts whenever half the arena is dead
    try:
        rows = LeaseRows()
        model: dict[str, Lease] = {}
        for step in steps:
            if isinstance(step, Lease):
                rows.put(step.copy())
                model[step.lease_id] = step
            else:
                assert rows.pop(step) == model.pop(step, None)
            _check(rows, model)
    finally:
        lease_rows._MIN_COMPACT = original


def _lease(lease_id: str, checkpoints: bytes, packed: bytes = b"h") -> Lease:
    return Lease(
        lease_id,
        "conversation",
        "node",
        handle=KvHandle("request", 2, packed),
        checkpoints=checkpoints,
        grant_time=1.0,
    )


def test_a_freed_row_is_reused_and_an_update_keeps_the_first_id_string() -> None:
    rows = LeaseRows()
    first = "".join(["lease", "-1"])
    assert rows.put(_lease(first, b"x" * 10)) is first
    rows.put(_lease("lease-2", b"y" * 10))
    rows.pop(first)
    rows.put(_lease("lease-3", b"z" * 4))
    assert len(rows._lease_id) == 2  # lease-3 took lease-1's row
    again = "".join(["lease", "-3"])
    assert rows.put(_lease(again, b"w" * 4)) is not again  # kept the first string
    assert rows["lease-3"].checkpoints == b"w" * 4
    assert rows["lease-2"].checkpoints == b"y" * 10


def test_a_rewrite_that_fits_stays_in_place_and_one_that_grows_moves() -> None:
    rows = LeaseRows()
    rows.put(_lease("a", b"x" * 100))
    rows.put(_lease("b", b"y" * 100))
    size = len(rows._arena)
    rows.put(_lease("a", b"s" * 10, packed=b""))  # smaller: in place
    assert len(rows._arena) == size
    assert rows["a"].checkpoints == b"s" * 10
    assert rows["a"].handle.packed == b""
    rows.put(_lease("a", b"g" * 300))  # larger: to the end, the old slot dead
    assert len(rows._arena) == size + 301
    assert rows["a"].checkpoints == b"g" * 300
    assert rows["b"].checkpoints == b"y" * 100


def test_the_arena_is_compacted_once_most_of_it_is_dead() -> None:
    rows = LeaseRows()
    hashes = b"h" * 4096
    for i in range(600):  # ~2.4 MB, then all but the last 100 deleted
        rows.put(_lease(f"l{i:04}", hashes))
    for i in range(500):
        rows.pop(f"l{i:04}")
    assert len(rows._arena) < 300 * len(hashes)
    assert all(rows[f"l{i:04}"].checkpoints == hashes for i in range(500, 600))


def test_missing_ids_read_none_and_none_times_stay_none() -> None:
    rows = LeaseRows()
    assert rows.get("nope") is None
    assert rows.pop("nope") is None
    rows.put(Lease("l", "c", "n"))
    lease = rows["l"]
    assert lease.grant_time is None and lease.expire_time is None and lease.end_time is None
    assert lease.checkpoints == b"" and lease.handle == KvHandle()
