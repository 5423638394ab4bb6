"""Request validation, on the registry itself (memory store, fake clock): what used to be
stored and then crash a listing, poison a counter or be half-applied is refused up front with
INVALID_ARGUMENT, a refused call changes nothing, and a retention report is answered per
event. The last tests fuzz the requests with hypothesis."""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbroker.common.rules.checkpoints import BLOCK_HASH_BYTES
from kvbroker.controlplane.config import RegistryConfig
from kvbroker.controlplane.deadlines import DeadlineQueue
from kvbroker.controlplane.errors import InvalidArgument, RegistryError
from kvbroker.controlplane.records.model import NodeLoad
from kvbroker.controlplane.records.requests import (
    Heartbeat,
    LeaseGrant,
    LeaseListing,
    RetentionReport,
)
from kvbroker.v1 import lease_pb2, node_pb2, registry_pb2
from kvbroker_tools.harness.factories import block_hashes, handle, node_spec
from tests import test_registry_unit as registry_unit

CONFIG = RegistryConfig(learn_idle_ttl=False)
U64_MAX = (1 << 64) - 1


class Harness(registry_unit.Harness):
    """The registry-unit harness, on this module's config, with retention reports and a
    snapshot of everything a refused call must leave as it was."""

    def __init__(self, config: RegistryConfig = CONFIG) -> None:
        super().__init__(config=config)

    def retained(
        self, seq: int, conversation: str, request_id: str, **fields: Any
    ) -> registry_pb2.RetentionEvent:
        blocks = registry_pb2.RetainedBlocks(
            conversation_id=conversation,
            handle=handle(request_id, 64, self.decode),
            block_hashes=block_hashes(64),
            token_count=64,
        )
        for name, value in fields.items():
            setattr(blocks, name, value)
        return registry_pb2.RetentionEvent(sequence=seq, retained=blocks)

    async def report(
        self, *events: registry_pb2.RetentionEvent, full_snapshot: bool = False
    ) -> registry_pb2.ReportRetentionResponse:
        return await self.registry.report_retention(
            RetentionReport(self.decode.node_id, self.decode.incarnation, events, full_snapshot)
        )

    def state(self) -> tuple[object, ...]:
        """Everything a call could change: records, deadlines, runtimes, queued commands."""
        cache = self.store.cache
        registry = self.registry
        runtimes = {
            node_id: (
                r.state,
                self.store.live_lease_count(node_id),
                r.retained_blocks,
                r.applied_sequence,
                r.synced,
            )
            for node_id, r in registry.nodes.runtime.items()
        }
        return (
            dict(cache._nodes),
            dict(cache._conversations),
            dict(cache._leases),
            _deadlines(registry._deadlines),
            runtimes,
            {k: len(q.pending) for k, q in registry.outbox._queues.items()},
        )


def _deadlines(queue: DeadlineQueue) -> dict[tuple[int, str], float]:
    """Every current deadline, by key (the queue's entries; a free one has kind 0)."""
    entries = zip(queue._kinds, queue._ids, queue._whens, strict=True)
    return {(kind, ident): when for kind, ident, when in entries if kind}


async def refused(h: Harness, call: Any) -> InvalidArgument:
    """Awaits ``call``, which must be refused with INVALID_ARGUMENT and change nothing."""
    before = h.state()
    with pytest.raises(InvalidArgument) as error:
        await call
    assert error.value.reason == registry_pb2.ERROR_REASON_INVALID_ARGUMENT
    assert h.state() == before
    return error.value


async def test_an_unknown_role_is_refused_and_listings_still_work() -> None:
    h = Harness()
    await h.fleet()
    spec = node_spec("odd-0")
    spec.role = 7  # type: ignore[assignment]
    await refused(h, h.registry.register_node(spec))
    assert len(await h.registry.list_nodes()) == 2
    await refused(h, h.registry.list_nodes(role=42))


async def test_nan_and_out_of_range_loads_are_refused() -> None:
    h = Harness()
    await h.fleet()
    for usage in (math.nan, math.inf, -0.5, 1.5):
        load = NodeLoad(kv_cache_usage=usage)
        await refused(
            h, h.registry.heartbeat(Heartbeat(h.decode.node_id, h.decode.incarnation, True, load))
        )


async def test_megabyte_free_text_is_refused() -> None:
    h = Harness()
    await h.fleet()
    lease = await h.registry.grant_lease(
        LeaseGrant(
            "c",
            h.decode.node_id,
            h.decode.incarnation,
            handle("r", 64, h.decode),
            [],
            64,
        )
    )
    big = "x" * (1 << 20)
    await refused(h, h.registry.revoke_lease(lease.lease_id, reason=big))
    await refused(
        h, h.registry.release_lease(lease.lease_id, h.decode.node_id, h.decode.incarnation, big)
    )
    spec = node_spec("decode-1", port=5601)
    spec.http_base_url = big
    await refused(h, h.registry.register_node(spec))


async def test_a_lease_over_the_record_bound_is_refused_by_bytes_not_count() -> None:
    h = Harness(RegistryConfig(learn_idle_ttl=False, max_record_bytes=10_000))
    await h.fleet()
    # 2,000 hashes is far under the count limit, but they make a 20 KB record.
    hashes = [bytes([i % 256]) * BLOCK_HASH_BYTES for i in range(2000)]
    error = await refused(
        h,
        h.registry.grant_lease(
            LeaseGrant(
                "c",
                h.decode.node_id,
                h.decode.incarnation,
                handle("r", 64, h.decode),
                hashes,
                64,
            )
        ),
    )
    assert "the limit is 10000" in error.message


async def test_hashes_of_another_length_than_this_version_s_are_refused_clearly() -> None:
    """An engine of a version with 16-byte hashes: its grant and probes are refused, saying
    why, rather than kept where they could never verify."""
    h = Harness()
    await h.fleet()
    old = [bytes([i]) * 16 for i in range(4)]
    grant = LeaseGrant(
        "c", h.decode.node_id, h.decode.incarnation, handle("r", 64, h.decode), old, 64
    )
    error = await refused(h, h.registry.grant_lease(grant))
    assert error.message == (
        "a block hash of 16 bytes: prefix hashes are 8 bytes (an engine of another kvbroker"
        " version?)"
    )


async def test_one_engine_request_cannot_back_two_live_leases() -> None:
    h = Harness()
    await h.fleet()
    first = await h.report(h.retained(1, "c1", "r"))
    assert len(first.leases) == 1 and not first.refused
    before = h.state()
    answer = await h.report(h.retained(2, "c2", "r"))
    assert [item.sequence for item in answer.refused] == [2]
    assert answer.refused[0].error.reason == registry_pb2.ERROR_REASON_INVALID_ARGUMENT
    after = h.state()
    assert after[:3] == before[:3]  # only the applied sequence moved
    with pytest.raises(InvalidArgument):
        await h.registry.grant_lease(
            LeaseGrant(
                "c3",
                h.decode.node_id,
                h.decode.incarnation,
                handle("r", 64, h.decode),
                [],
                64,
            )
        )


async def test_counters_at_the_end_of_uint64_are_refused_and_poison_nothing() -> None:
    h = Harness()
    await h.fleet()
    granted = (await h.report(h.retained(1, "c", "r1"))).leases[0]
    answer = await h.report(
        h.retained(2, "c", "r2", lease_id=granted.lease_id[:-1] + "f", epoch=U64_MAX),
        registry_pb2.RetentionEvent(
            sequence=U64_MAX,
            released=registry_pb2.ReleasedBlocks(remote_request_id="r1"),
        ),
    )
    assert {item.sequence for item in answer.refused} == {2, U64_MAX}
    assert answer.applied_sequence == 2  # the huge sequence did not stick
    # Later grants and releases still work.
    turn = await h.report(h.retained(3, "c", "r3"))
    assert turn.leases[0].epoch == 2 and not turn.refused


async def test_replayed_lease_ids_are_checked() -> None:
    h = Harness()
    await h.fleet()
    granted = (await h.report(h.retained(1, "c", "r1"))).leases[0]
    other = (await h.report(h.retained(2, "d", "r2"))).leases[0]
    answer = await h.report(
        # not an id this registry grants
        h.retained(3, "c", "r1", lease_id="../../leader", epoch=1),
        # another conversation's lease
        h.retained(4, "c", "r1", lease_id=other.lease_id, epoch=1),
        # the right lease, a wrong epoch
        h.retained(5, "c", "r1", lease_id=granted.lease_id, epoch=9),
        # the right one
        h.retained(6, "c", "r1", lease_id=granted.lease_id, epoch=1),
    )
    assert [item.sequence for item in answer.refused] == [3, 4, 5]
    assert [lease.lease_id for lease in answer.leases] == [granted.lease_id]


async def test_a_report_is_answered_per_event() -> None:
    """A bad event (here a conversation id over the limit) is refused alone; the events
    around it are applied, and the report is not refused."""
    h = Harness()
    await h.fleet()
    answer = await h.report(
        h.retained(1, "c1", "r1"),
        h.retained(2, "x" * 1000, "r2"),
        registry_pb2.RetentionEvent(
            sequence=3,
            released=registry_pb2.ReleasedBlocks(remote_request_id="r1", cause=99),  # type: ignore[arg-type]
        ),
        h.retained(4, "c4", "r4"),
    )
    assert [item.sequence for item in answer.refused] == [2, 3]
    assert [lease.conversation_id for lease in answer.leases] == ["c1", "c4"]
    assert answer.applied_sequence == 4
    live, _ = await h.registry.list_leases()
    assert sorted(lease.conversation_id for lease in live) == ["c1", "c4"]


async def test_a_prefill_node_s_retention_is_refused_per_event() -> None:
    h = Harness()
    await h.fleet()
    answer = await h.registry.report_retention(
        RetentionReport(h.prefill.node_id, h.prefill.incarnation, [h.retained(1, "c", "r")], False)
    )
    assert answer.refused[0].error.reason == registry_pb2.ERROR_REASON_NOT_A_DECODE_NODE


async def test_a_bad_request_in_a_hint_batch_fails_alone() -> None:
    h = Harness()
    await h.fleet()
    await h.report(h.retained(1, "c", "r"))
    requests = [
        registry_pb2.GetRoutingHintRequest(conversation_id="c", model="tiny-qwen3"),
        registry_pb2.GetRoutingHintRequest(conversation_id="y" * 1000, model="tiny-qwen3"),
        registry_pb2.GetRoutingHintRequest(conversation_id="z", model="m" * 100_000),
    ]
    response = await h.registry.routing_hints(requests)
    assert response.results[0].hint.decision == registry_pb2.HINT_DECISION_REUSE
    for result in response.results[1:]:
        assert result.error.reason == registry_pb2.ERROR_REASON_INVALID_ARGUMENT


# ---------------------------------------------------------------- fuzzing

FUZZ = settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
texts = st.one_of(
    st.sampled_from(["", "decode-0", "c", "r1", "tiny-qwen3"]),
    st.text(max_size=40),
    st.text(min_size=250, max_size=300),
)
u32 = st.integers(min_value=0, max_value=(1 << 32) - 1)
u64 = st.one_of(st.integers(0, 10), st.integers(0, U64_MAX))
floats = st.floats(allow_nan=True, allow_infinity=True)
hashes = st.lists(st.binary(max_size=80), max_size=8)


@st.composite
def kv_handles(draw: st.DrawFn) -> lease_pb2.KvHandle:
    return lease_pb2.KvHandle(
        remote_engine_id=draw(texts),
        remote_request_id=draw(texts),
        remote_block_groups=[
            lease_pb2.BlockIdGroup(block_ids=draw(st.lists(u32, max_size=4)))
            for _ in range(draw(st.integers(0, 2)))
        ],
        remote_host=draw(texts),
        remote_port=draw(u32),
    )


@st.composite
def specs(draw: st.DrawFn) -> node_pb2.NodeSpec:
    spec = node_pb2.NodeSpec(
        node_id=draw(texts),
        role=draw(st.integers(-3, 9)),  # type: ignore[arg-type]
        engine_id=draw(texts),
        side_channel_host=draw(texts),
        side_channel_port=draw(u32),
        http_base_url=draw(texts),
        model=draw(texts),
        block_size=draw(u32),
        capacity_blocks=draw(u64),
        incarnation=draw(texts),
    )
    spec.retention_hard_cap.seconds = draw(st.integers(-(1 << 40), 1 << 40))
    spec.retention_hard_cap.nanos = draw(st.integers(-(10**9), 10**9))
    return spec


@st.composite
def events(draw: st.DrawFn) -> registry_pb2.RetentionEvent:
    event = registry_pb2.RetentionEvent(sequence=draw(u64))
    kind = draw(st.sampled_from(["retained", "released", "reclaim", "none"]))
    if kind == "retained":
        event.retained.conversation_id = draw(texts)
        event.retained.handle.CopyFrom(draw(kv_handles()))
        event.retained.block_hashes.extend(draw(hashes))
        event.retained.token_count = draw(u32)
        event.retained.lease_id = draw(st.one_of(texts, st.just("0" * 21)))
        event.retained.epoch = draw(u64)
        event.retained.time_to_live.seconds = draw(st.integers(-100, 1 << 40))
    elif kind == "released":
        event.released.remote_request_id = draw(texts)
        event.released.cause = draw(st.integers(-2, 12))  # type: ignore[assignment]
        event.released.reason = draw(texts)
    elif kind == "reclaim":
        event.reclaim.remote_request_id = draw(texts)
        event.reclaim.cause = draw(st.integers(-2, 12))  # type: ignore[assignment]
    return event


async def _called(h: Harness, call: Any) -> None:
    """Accepted, or refused with a reason and nothing changed; anything else fails."""
    before = h.state()
    try:
        await call
    except RegistryError as error:
        assert error.reason != registry_pb2.ERROR_REASON_UNSPECIFIED, error
        assert h.state() == before, error
    # Every listing still renders (labels of the stored enums included).
    await h.registry.list_nodes()
    for figure in h.registry.nodes.figures():
        assert figure.state


@FUZZ
@given(spec=specs())
async def test_fuzz_register_node(spec: node_pb2.NodeSpec) -> None:
    h = Harness()
    await h.fleet()
    await _called(h, h.registry.register_node(spec))


@FUZZ
@given(node_id=texts, incarnation=texts, ready=st.booleans(), usage=floats, running=u32)
async def test_fuzz_heartbeat(
    node_id: str, incarnation: str, ready: bool, usage: float, running: int
) -> None:
    h = Harness()
    await h.fleet()
    load = NodeLoad(kv_cache_usage=usage, running_requests=running)
    await _called(h, h.registry.heartbeat(Heartbeat(node_id, incarnation, ready, load)))
    await _called(
        h, h.registry.heartbeat(Heartbeat(h.decode.node_id, h.decode.incarnation, ready, load))
    )


@FUZZ
@given(
    conversation=texts,
    kv=kv_handles(),
    digests=hashes,
    tokens=u32,
    ttl=st.one_of(st.none(), floats),
)
async def test_fuzz_grant_lease(
    conversation: str,
    kv: lease_pb2.KvHandle,
    digests: list[bytes],
    tokens: int,
    ttl: float | None,
) -> None:
    h = Harness()
    await h.fleet()
    await h.report(h.retained(1, "c", "r1"))
    await _called(
        h,
        h.registry.grant_lease(
            LeaseGrant(
                conversation,
                h.decode.node_id,
                h.decode.incarnation,
                kv,
                digests,
                tokens,
                ttl,
            )
        ),
    )


@FUZZ
@given(batch=st.lists(events(), max_size=4), full_snapshot=st.booleans())
async def test_fuzz_report_retention(
    batch: list[registry_pb2.RetentionEvent], full_snapshot: bool
) -> None:
    """Each event is applied or refused on its own; the report itself is never refused for
    an event's content."""
    h = Harness()
    await h.fleet()
    await h.report(h.retained(1, "c", "r1"))
    answer = await h.report(*batch, full_snapshot=full_snapshot)
    assert len(answer.refused) + len(answer.leases) >= sum(
        1 for e in batch if e.HasField("retained")
    )
    for item in answer.refused:
        assert item.error.reason != registry_pb2.ERROR_REASON_UNSPECIFIED
    assert answer.applied_sequence <= (1 << 63) - 1
    await h.registry.list_leases(LeaseListing(states=list(lease_pb2.LeaseState.values())[1:]))
    await _called(h, h.report(h.retained(answer.applied_sequence + 1, "c", "r9")))
