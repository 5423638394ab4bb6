"""Forks reuse by content (issue 41): the registry's prefix index finds the live lease a
prompt's prefix shares, scoped by tenant, model and block size, longest first, at about
log2(blocks) entries a lease; a fork's read pin protects the parent's blocks as a claim does
without taking the lease from its conversation, whose next turn is still REUSE."""

from __future__ import annotations

import random

import pytest

from kvbroker.common.rules.checkpoints import Checkpoints, probe_blocks
from kvbroker.common.rules.clock import from_duration
from kvbroker.common.rules.routing import pinned, read_refusal
from kvbroker.common.rules.tenants import tenant_of
from kvbroker.controlplane.api import convert
from kvbroker.controlplane.lessor.prefix_index import (
    KEEP_PER_KEY,
    KEY_BYTES,
    PrefixIndex,
    Scope,
    indexed_hashes,
)
from kvbroker.controlplane.placement.prefix_match import PrefixMatch
from kvbroker.controlplane.records import codec
from kvbroker.controlplane.records.answers import LeaseAnswer
from kvbroker.controlplane.records.requests import LeaseGrant, PrefixProbe, RetentionReport
from kvbroker.controlplane.registry import Registry
from kvbroker.engine_ext.prefix import prefix_hashes
from kvbroker.v1 import lease_pb2, registry_pb2
from kvbroker_tools.harness.factories import handle, replayed
from tests.test_checkpoints import sixteen_byte_hashes
from tests.test_registry_unit import CONFIG, Harness

BLOCK = 16
ACTIVE = lease_pb2.LEASE_STATE_ACTIVE
CLAIMED = lease_pb2.LEASE_STATE_CLAIMED


def tokens(n: int, seed: int = 0) -> list[int]:
    return [(7 * i + 3 + seed * 101) % 4000 + 5 for i in range(n)]


def probes(prompt: list[int]) -> list[bytes]:
    """What a prefill engine sends: its prompt's hashes at blocks 2^k - 1, full blocks."""
    hashes = prefix_hashes(prompt, BLOCK, len(prompt))
    return [hashes[b] for b in probe_blocks(len(prompt) // BLOCK)]


async def retain(h: Harness, conversation: str, request_id: str, kept: list[int]) -> LeaseAnswer:
    """D retained ``kept`` tokens for ``conversation``, with the hashes its engine reports."""
    checkpoints = Checkpoints.of(prefix_hashes(kept, BLOCK, len(kept)))
    return await h.registry.grant_lease(
        LeaseGrant(
            conversation,
            h.decode.node_id,
            h.decode.incarnation,
            handle(request_id, len(kept), h.decode),
            checkpoints.hashes,
            len(kept),
            600,
            checkpoints.stride,
        )
    )


async def ask(h: Harness, conversation: str, prompt: list[int]) -> PrefixMatch:
    return await h.registry.match_prefix(
        PrefixProbe(h.prefill.node_id, conversation, h.prefill.model, BLOCK, probes(prompt))
    )


def test_tenants_are_the_prefix_of_scoped_ids() -> None:
    assert tenant_of("acme/session-1") == "acme"
    assert tenant_of("session-1") == ""
    assert tenant_of("acme/a/b") == "acme"


def test_the_index_finds_the_longest_share_first_and_forgets_a_removed_lease() -> None:
    index = PrefixIndex()
    scope = Scope("acme", "m", BLOCK)
    history = tokens(64 * BLOCK)
    short = Checkpoints.of(prefix_hashes(history[: 16 * BLOCK], BLOCK, 16 * BLOCK))
    long = Checkpoints.of(prefix_hashes(history, BLOCK, len(history)))
    short_keys = indexed_hashes(codec_blob(short), 1, 16 * BLOCK, BLOCK)
    long_keys = indexed_hashes(codec_blob(long), 1, len(history), BLOCK)
    index.add("short", scope, short_keys)
    index.add("long", scope, long_keys)
    prompt = probes(history + tokens(40, seed=3))
    hits = list(index.hits(scope, prompt))
    assert [(hit.blocks, hit.lease_ids) for hit in hits[:2]] == [(64, ("long",)), (32, ("long",))]
    assert hits[2].lease_ids == ("long", "short")  # 16 blocks: both share them
    assert list(index.hits(Scope("other", "m", BLOCK), prompt)) == []
    assert list(index.hits(Scope("acme", "m", 32), prompt)) == []
    index.remove("long", long_keys)
    assert [hit.blocks for hit in index.hits(scope, prompt)] == [16, 8, 4, 2, 1]
    index.remove("short", short_keys)
    assert len(index) == 0 and index.entries() == 0


def codec_blob(checkpoints: Checkpoints) -> bytes:
    return codec.checkpoints(checkpoints.hashes)


def test_a_lease_of_an_older_version_s_16_byte_hashes_is_not_indexed() -> None:
    """Its block 0 hash cut to 8 bytes equals ours (nothing chains before it), so keyed it
    would be found by prompts that can never verify it."""
    count = 64 * BLOCK
    old = Checkpoints.of(sixteen_byte_hashes(tokens(count), BLOCK))
    assert old.hashes[0][:KEY_BYTES] == prefix_hashes(tokens(count), BLOCK, count)[0][:KEY_BYTES]
    assert indexed_hashes(codec_blob(old), old.stride, count, BLOCK) == []
    ours = Checkpoints.of(prefix_hashes(tokens(count), BLOCK, count))
    assert len(indexed_hashes(codec_blob(ours), ours.stride, count, BLOCK)) == 7


def test_a_lease_costs_about_log2_of_its_blocks_in_the_index() -> None:
    """128k tokens in 16-token blocks (8,192 blocks, stride 32): the probe blocks at or past
    the stride, 31 through 8,191: 9 entries, against 257 checkpoints and 8,192 hashes."""
    index = PrefixIndex()
    count = 131_072
    kept = Checkpoints.of(prefix_hashes(tokens(count), BLOCK, count))
    assert kept.stride == 32
    hashes = indexed_hashes(codec_blob(kept), kept.stride, count, BLOCK)
    assert [block for block, _ in hashes] == [31, 63, 127, 255, 511, 1023, 2047, 4095, 8191]
    for i in range(3):
        index.add(f"lease-{i}", Scope("", "m", BLOCK), hashes[i:])
    assert index.entries() == 9 + 8 + 7


def test_leases_sharing_a_prefix_keep_only_their_newest_under_it() -> None:
    """A thousand conversations under one system prompt: each key they share keeps its 8
    newest leases (any of them gives a prompt the same prefix), so a look-up reads at most 8
    a level and the index does not grow with the crowd; removing leases keeps it exact."""
    index = PrefixIndex()
    scope = Scope("", "m", BLOCK)
    system = tokens(8 * BLOCK)
    keys = []
    for i in range(1000):
        own = system + tokens(8 * BLOCK, seed=10 + i)
        kept = Checkpoints.of(prefix_hashes(own, BLOCK, len(own)))
        keys.append(indexed_hashes(codec_blob(kept), 1, len(own), BLOCK))
        index.add(f"lease-{i}", Scope("", "m", BLOCK), keys[-1])
    # Blocks 0, 1, 3, 7 are the system prompt's (shared); block 15 is each lease's own.
    assert index.entries() == 4 * 8 + 1000
    newest = tuple(f"lease-{i}" for i in range(999, 991, -1))
    hits = list(index.hits(scope, probes(system + tokens(8 * BLOCK, seed=5))))
    assert [(hit.blocks, hit.lease_ids) for hit in hits] == [
        (8, newest), (4, newest), (2, newest), (1, newest)
    ]  # fmt: skip
    own = system + tokens(8 * BLOCK, seed=10 + 500)
    assert next(index.hits(scope, probes(own))).lease_ids == ("lease-500",)
    assert index.scope("lease-7") is index.scope("lease-8")  # one object per scope
    for i in range(1000):
        index.remove(f"lease-{i}", keys[i])
    assert len(index) == 0 and index.entries() == 0
    # A partial last block is not indexed: no prompt's full block hashes like it.
    partial = Checkpoints.of(prefix_hashes(tokens(20), BLOCK, 20))
    assert [b for b, _ in indexed_hashes(codec_blob(partial), 1, 20, BLOCK)] == [0]


async def test_a_fork_matches_its_parent_s_lease_which_stays_the_parent_s() -> None:
    h = Harness()
    await h.fleet()
    history = tokens(64 * BLOCK)
    parent = await retain(h, "acme/parent", "req-1", history)
    match = await ask(h, "acme/fork", history + tokens(50, seed=1))
    assert match.lease is not None and match.lease.lease_id == parent.lease_id
    assert match.matched_blocks == 64
    assert match.lease.pin_time_to_live == pytest.approx(CONFIG.claim_timeout_s)
    record = await h.registry.get_lease(parent.lease_id)
    assert record.state == ACTIVE and record.pin_time_to_live is not None
    # The parent's own next turn is still REUSE, and claims its lease as before.
    hint = await h.registry.routing_hint("acme/parent", "")
    assert hint.decision == registry_pb2.HINT_DECISION_REUSE
    assert hint.lease.lease_id == parent.lease_id
    assert (await h.registry.get_lease(parent.lease_id)).state == CLAIMED


async def test_no_match_across_tenants_nor_with_the_own_conversation_s_lease() -> None:
    h = Harness()
    await h.fleet()
    history = tokens(64 * BLOCK)
    await retain(h, "acme/parent", "req-1", history)
    prompt = history + tokens(50, seed=1)
    other = await ask(h, "evil/fork", prompt)
    assert other.lease is None and other.no_reuse == registry_pb2.NO_REUSE_REASON_NO_PREFIX_MATCH
    unscoped = await ask(h, "fork", prompt)
    assert unscoped.lease is None
    own = await ask(h, "acme/parent", prompt)
    assert own.lease is None and own.no_reuse == registry_pb2.NO_REUSE_REASON_OWN_CONVERSATION
    different = await ask(h, "acme/other", tokens(64 * BLOCK, seed=5))
    assert different.no_reuse == registry_pb2.NO_REUSE_REASON_NO_PREFIX_MATCH


async def test_the_longest_share_wins_and_an_ended_lease_is_never_matched() -> None:
    h = Harness()
    await h.fleet()
    history = tokens(64 * BLOCK)
    short = await retain(h, "acme/a", "req-1", history[: 16 * BLOCK])
    long = await retain(h, "acme/b", "req-2", history)
    match = await ask(h, "acme/fork", history + tokens(50, seed=1))
    assert match.lease is not None and match.lease.lease_id == long.lease_id
    await h.registry.revoke_lease(long.lease_id, reason="closed")
    assert long.lease_id not in h.registry.leases.prefix_index
    after = await ask(h, "acme/fork-2", history + tokens(50, seed=1))
    assert after.lease is not None and after.lease.lease_id == short.lease_id
    assert after.matched_blocks == 16


async def test_a_claimed_lease_is_not_pinned() -> None:
    """A claimed read frees the blocks when it completes: a fork must not race it."""
    h = Harness()
    await h.fleet()
    history = tokens(64 * BLOCK)
    await retain(h, "acme/parent", "req-1", history)
    await h.registry.routing_hint("acme/parent", "")  # claimed for the parent's READ
    match = await ask(h, "acme/fork", history + tokens(50, seed=1))
    assert match.lease is None and match.no_reuse == registry_pb2.NO_REUSE_REASON_LEASE_NOT_LIVE


async def test_n_pins_keep_the_blocks_from_a_reclaim_until_the_last_ends() -> None:
    h = Harness()
    await h.fleet()
    history = tokens(64 * BLOCK)
    parent = await retain(h, "acme/parent", "req-1", history)
    for i in range(4):
        match = await ask(h, f"acme/fork-{i}", history + tokens(50, seed=i))
        assert match.lease is not None and match.lease.lease_id == parent.lease_id
        await h.advance(2)
    assert h.registry.leases.pins.count(parent.lease_id, h.clock.t) == 4
    # The holder's engine wants the blocks back: kept while pinned, as while claimed.
    await reclaim(h, "req-1", 1)
    assert (await h.registry.get_lease(parent.lease_id)).state == ACTIVE
    # The first pin has ended, three have not: still kept.
    await h.advance(CONFIG.claim_timeout_s - 8 + 0.5)
    assert h.registry.leases.pins.count(parent.lease_id, h.clock.t) == 3
    await reclaim(h, "req-1", 2)
    assert (await h.registry.get_lease(parent.lease_id)).state == ACTIVE
    # The last pin ends a claim's time after it was made; then the reclaim is granted.
    await h.advance(6)
    unpinned = await h.registry.get_lease(parent.lease_id)
    assert unpinned.state == ACTIVE and unpinned.pin_time_to_live is None
    await reclaim(h, "req-1", 3)
    ended = await h.registry.get_lease(parent.lease_id)
    assert ended.state == lease_pb2.LEASE_STATE_RELEASED


async def test_superseding_a_pinned_lease_keeps_its_blocks_for_the_pins() -> None:
    h = Harness()
    await h.fleet()
    history = tokens(64 * BLOCK)
    parent = await retain(h, "acme/parent", "req-1", history)
    await ask(h, "acme/fork", history + tokens(50, seed=1))
    await h.advance(4)
    await retain(h, "acme/parent", "req-2", history + tokens(30, seed=2))
    commands = []
    while True:
        command = await h.next_command()
        if command.lease_id == parent.lease_id and command.cause:
            commands.append(command)
            break
    assert commands[0].cause == lease_pb2.LEASE_END_CAUSE_SUPERSEDED
    assert from_duration(commands[0].time_to_live) == pytest.approx(
        CONFIG.claim_timeout_s - 4, abs=0.01
    )


async def test_only_a_claimed_or_pinned_lease_at_the_handle_s_epoch_may_be_read() -> None:
    h = Harness()
    await h.fleet()
    history = tokens(64 * BLOCK)
    parent = await retain(h, "acme/parent", "req-1", history)
    unpinned = convert.lease_message(await h.registry.get_lease(parent.lease_id))
    assert read_refusal(unpinned, parent.epoch) is not None and not pinned(unpinned)
    await ask(h, "acme/fork", history + tokens(50, seed=1))
    message = convert.lease_message(await h.registry.get_lease(parent.lease_id))
    assert pinned(message) and read_refusal(message, parent.epoch) is None
    assert read_refusal(message, parent.epoch + 1) is not None
    assert not convert.match_message(PrefixMatch(None, 0)).HasField("lease")


async def reclaim(h: Harness, request_id: str, sequence: int) -> None:
    event = registry_pb2.RetentionEvent(
        sequence=sequence,
        reclaim=registry_pb2.ReclaimRequest(
            remote_request_id=request_id, cause=lease_pb2.LEASE_END_CAUSE_PRESSURE
        ),
    )
    await h.registry.report_retention(
        RetentionReport(h.decode.node_id, h.decode.incarnation, [event], False)
    )


async def test_a_pin_ends_when_its_reader_says_its_read_has() -> None:
    """The fork's prefill finished (EndReadPin): its pin ends then, not at its timeout, and
    only its own reader can end it."""
    h = Harness()
    await h.fleet()
    history = tokens(64 * BLOCK)
    parent = await retain(h, "acme/parent", "req-1", history)
    first = await ask(h, "acme/fork-1", history + tokens(50, seed=1))
    second = await ask(h, "acme/fork-2", history + tokens(50, seed=2))
    assert first.pin_id and second.pin_id and first.pin_id != second.pin_id
    await h.registry.end_read_pin("decode-0", parent.lease_id, first.pin_id)  # not its reader
    assert h.registry.leases.pins.count(parent.lease_id, h.clock.t) == 2
    await h.registry.end_read_pin(h.prefill.node_id, parent.lease_id, first.pin_id)
    await reclaim(h, "req-1", 1)
    assert (await h.registry.get_lease(parent.lease_id)).state == ACTIVE  # one pin left
    await h.registry.end_read_pin(h.prefill.node_id, parent.lease_id, second.pin_id)
    await h.registry.end_read_pin(h.prefill.node_id, parent.lease_id, second.pin_id)  # again
    assert (await h.registry.get_lease(parent.lease_id)).pin_time_to_live is None
    await reclaim(h, "req-1", 2)
    assert (await h.registry.get_lease(parent.lease_id)).state == lease_pb2.LEASE_STATE_RELEASED


async def test_a_successor_indexes_what_it_restores_and_matches_once_the_holder_replayed() -> None:
    """A takeover rebuilds the index with the leases (``Leases.restore``); a holder's leases
    are matched, as they are offered, only once it has replayed to the new leader."""
    h = Harness()
    await h.fleet()
    history = tokens(64 * BLOCK)
    parent = await retain(h, "acme/parent", "req-1", history)
    successor = Registry(h.store, CONFIG, clock=h.clock)
    await successor.restore()
    assert parent.lease_id in successor.leases.prefix_index
    probes_ = probes(history + tokens(50, seed=1))
    before = await successor.match_prefix(
        PrefixProbe(h.prefill.node_id, "acme/fork", h.prefill.model, BLOCK, probes_)
    )
    assert before.no_reuse == registry_pb2.NO_REUSE_REASON_HOLDER_UNAVAILABLE
    replay = replayed(convert.lease_message(parent))
    await successor.report_retention(
        RetentionReport(h.decode.node_id, h.decode.incarnation, [replay], full_snapshot=True)
    )
    after = await successor.match_prefix(
        PrefixProbe(h.prefill.node_id, "acme/fork", h.prefill.model, BLOCK, probes_)
    )
    assert after.lease is not None and after.lease.lease_id == parent.lease_id


@pytest.mark.parametrize("reserved", [0, 20_000])
def test_the_index_table_answers_as_a_dictionary_would_through_growth_and_removals(
    reserved: int,
) -> None:
    """The open-addressing table against a plain model of the same rules: thousands of
    leases in two scopes, many sharing keys (more than ``KEEP_PER_KEY``), keys equal across
    scopes, half removed in random order (so runs are shifted back and rows reused), the table
    grown several times, or sized up front and again half-full (``reserve``, as a replay does);
    every look-up must find exactly the model's newest leases."""
    rng = random.Random(7)
    index = PrefixIndex()
    index.reserve(reserved)
    scopes = [Scope("a", "m", BLOCK), Scope("b", "m", BLOCK)]
    shared = [rng.randbytes(16) for _ in range(40)]
    model: dict[tuple[Scope, bytes], list[str]] = {}
    added: dict[str, tuple[Scope, list[tuple[int, bytes]]]] = {}
    for i in range(6000):
        scope = scopes[i % 2]
        hashes = [(0, rng.choice(shared)), (1, rng.choice(shared)), (3, rng.randbytes(16))]
        lease_id = f"lease-{i}"
        if i == 3000:
            index.reserve(reserved)
        index.add(lease_id, scope, hashes)
        added[lease_id] = (scope, hashes)
        for _, digest in hashes:
            held = model.setdefault((scope, digest[:KEY_BYTES]), [])
            held.append(lease_id)
            del held[:-KEEP_PER_KEY]
        if i % 3 == 0:
            gone = rng.choice(sorted(added))
            gone_scope, gone_hashes = added.pop(gone)
            index.remove(gone, gone_hashes)
            for _, digest in gone_hashes:
                held = model[(gone_scope, digest[:KEY_BYTES])]
                if gone in held:
                    held.remove(gone)
    assert len(index) == len(added)
    assert index.entries() == sum(len(held) for held in model.values())
    for (scope, key), held in model.items():
        probe = key + bytes(16 - KEY_BYTES)
        hits = list(index.hits(scope, [probe]))
        assert [hit.lease_ids for hit in hits] == ([tuple(reversed(held))] if held else [])
    for lease_id, (scope, hashes) in added.items():
        assert index.scope(lease_id) == scope
        assert lease_id in index.sharing_all(scope, hashes)
    for lease_id, (_, hashes) in added.items():
        index.remove(lease_id, hashes)
    assert len(index) == 0 and index.entries() == 0


async def test_a_snapshot_s_replay_sizes_the_index_once_and_indexes_every_lease(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A restart's replay (a full snapshot into an empty registry) sizes the prefix index for
    its leases before adding them, instead of doubling it as they come; what it indexes is
    what the per-lease path would: each lease is matched by a fork of its conversation."""
    h = Harness()
    await h.fleet()
    histories = [tokens(40 * BLOCK, seed=i) for i in range(600)]
    held = [await retain(h, f"acme/c-{i}", f"req-{i}", kept) for i, kept in enumerate(histories)]
    fresh = Harness()
    await fresh.registry.register_node(h.decode)
    await fresh.registry.register_node(h.prefill)

    def no_growth(index: PrefixIndex) -> None:
        raise AssertionError("the index grew during the replay")

    monkeypatch.setattr(PrefixIndex, "_grow", no_growth)
    events = [
        replayed(convert.lease_message(lease), sequence) for sequence, lease in enumerate(held, 1)
    ]
    answer = await fresh.registry.report_retention(
        RetentionReport(h.decode.node_id, h.decode.incarnation, events, full_snapshot=True)
    )
    assert len(answer.leases) == len(held) and not answer.refused
    for i in (0, 299, 599):
        prompt = probes(histories[i] + tokens(20, seed=900))
        match = await fresh.registry.match_prefix(
            PrefixProbe(h.prefill.node_id, f"acme/fork-{i}", h.prefill.model, BLOCK, prompt)
        )
        assert match.lease is not None and match.lease.lease_id == held[i].lease_id
