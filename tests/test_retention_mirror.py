"""The retention mirror in isolation: what a replay carries and which queued events it
supersedes."""

from __future__ import annotations

from kvbroker.common.rules.retention_mirror import RetentionMirror
from kvbroker.v1 import lease_pb2, registry_pb2


def retained(request_id: str, tokens: int = 32) -> registry_pb2.RetentionEvent:
    return registry_pb2.RetentionEvent(
        retained=registry_pb2.RetainedBlocks(
            conversation_id=f"conv-{request_id}",
            handle=lease_pb2.KvHandle(remote_request_id=request_id),
            token_count=tokens,
        )
    )


def released(request_id: str) -> registry_pb2.RetentionEvent:
    return registry_pb2.RetentionEvent(
        released=registry_pb2.ReleasedBlocks(remote_request_id=request_id)
    )


def reclaim(request_id: str) -> registry_pb2.RetentionEvent:
    return registry_pb2.RetentionEvent(
        reclaim=registry_pb2.ReclaimRequest(
            remote_request_id=request_id, cause=lease_pb2.LEASE_END_CAUSE_PRESSURE
        )
    )


def ids(snapshot: list[registry_pb2.RetainedBlocks]) -> list[str]:
    return [blocks.handle.remote_request_id for blocks in snapshot]


def test_events_are_numbered_in_order_and_a_release_of_nothing_is_not_sent() -> None:
    mirror = RetentionMirror()
    assert mirror.record(retained("a")) == 1
    assert mirror.record(reclaim("a")) == 2  # sent, but changes nothing retained
    assert mirror.record(released("b")) is None
    assert mirror.record(released("a")) == 3
    assert mirror.record(released("a")) is None
    assert len(mirror) == 0


def test_a_replay_supersedes_what_was_recorded_before_it_and_nothing_after() -> None:
    mirror = RetentionMirror()
    before = [mirror.record(event) for event in (retained("a"), retained("b"), released("a"))]
    assert ids(mirror.replay()) == ["b"]
    assert before == [1, 2, 3] and mirror.record(retained("c")) == 4
    assert [mirror.superseded(position) for position in (1, 2, 3, 4)] == [True] * 3 + [False]
    # The next replay carries the later event and supersedes it in turn.
    assert ids(mirror.replay()) == ["b", "c"]
    assert mirror.superseded(4)


def test_a_noted_lease_is_replayed_without_changing_what_was_sent_or_snapshotted() -> None:
    mirror = RetentionMirror()
    event = retained("a")
    mirror.record(event)
    [first] = mirror.replay()
    mirror.note_lease("a", "lease-1", 7)
    mirror.note_lease("unknown", "lease-2", 1)  # not retained: nothing to note
    [noted] = mirror.replay()
    assert (noted.lease_id, noted.epoch, noted.token_count) == ("lease-1", 7, 32)
    # The event queued for sending and the earlier snapshot still carry no lease.
    assert (event.retained.lease_id, first.lease_id) == ("", "")
    # Retaining the request again replaces the entry, lease and all.
    mirror.record(retained("a", tokens=64))
    [again] = mirror.replay()
    assert (again.lease_id, again.token_count) == ("", 64)


def test_replace_makes_the_engines_snapshot_the_whole_truth() -> None:
    mirror = RetentionMirror()
    mirror.record(retained("a"))
    mirror.record(retained("b"))
    mirror.replace([retained("c").retained, retained("b", tokens=48).retained])
    snapshot = mirror.replay()
    assert ids(snapshot) == ["c", "b"] and snapshot[1].token_count == 48
    assert mirror.record(released("a")) is None


def test_a_replay_carries_each_deadline_and_leaves_out_ended_leases() -> None:
    mirror = RetentionMirror()
    for request_id in ("live", "ended", "unknown"):
        mirror.record(retained(request_id))

    def command(
        request_id: str, state: lease_pb2.LeaseState, ttl_s: float
    ) -> registry_pb2.LeaseCommand:
        command = registry_pb2.LeaseCommand(remote_request_id=request_id, state=state)
        command.time_to_live.FromMilliseconds(int(ttl_s * 1000))
        return command

    mirror.note_command(command("live", lease_pb2.LEASE_STATE_ACTIVE, 40))
    mirror.note_command(command("ended", lease_pb2.LEASE_STATE_REVOKED, 2))
    mirror.note_command(command("never-retained", lease_pb2.LEASE_STATE_ACTIVE, 9))
    snapshot = {blocks.handle.remote_request_id: blocks for blocks in mirror.replay()}
    assert set(snapshot) == {"live", "unknown"}
    assert 39 < snapshot["live"].time_to_live.ToTimedelta().total_seconds() <= 40
    assert not snapshot["unknown"].HasField("time_to_live")  # no command yet: the registry's
    # The engine freed the ended one at its deadline: gone, and its deadline forgotten.
    mirror.record(released("ended"))
    mirror.record(retained("ended"))
    assert "ended" in ids(mirror.replay())
