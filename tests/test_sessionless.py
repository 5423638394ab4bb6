"""Sessionless turns (issue 41): the router names a turn that comes without a session id in a
namespace of kvbroker's own, and a sessionless turn's new lease supersedes the older
sessionless lease of its tenant whose whole readable content it holds, so that a sessionless
conversation keeps one lease, not a chain; a lease shared only in part (one system prompt,
rollouts of one prompt) and any explicit session's lease are left alone."""

from __future__ import annotations

from kvbroker.common.rules.checkpoints import Checkpoints
from kvbroker.common.rules.sessionless import (
    NAMESPACE,
    Retained,
    holds_all_of,
    is_sessionless,
    may_take_over,
    new_session_id,
)
from kvbroker.common.rules.tenants import Tenant, tenant_of
from kvbroker.controlplane.records.requests import LeaseListing
from kvbroker.engine_ext.prefix import prefix_hashes
from kvbroker.v1 import lease_pb2
from tests.test_prefix_match import BLOCK, ask, retain, tokens
from tests.test_registry_unit import Harness

ACTIVE = lease_pb2.LEASE_STATE_ACTIVE
REVOKED = lease_pb2.LEASE_STATE_REVOKED
SUPERSEDED = lease_pb2.LEASE_END_CAUSE_SUPERSEDED


def content(kept: list[int], block_size: int = BLOCK) -> Retained:
    """What a lease of ``kept`` tokens holds, with the checkpoints its engine reports."""
    checkpoints = Checkpoints.of(prefix_hashes(kept, block_size, len(kept)))
    return Retained(checkpoints.hashes, checkpoints.stride, len(kept))


def anon(tenant: str = "") -> str:
    return Tenant(tenant).conversation(new_session_id())


def test_named_ids_are_fresh_in_the_namespace_under_any_tenant() -> None:
    first, second = new_session_id(), new_session_id()
    assert first != second and first.startswith(NAMESPACE) and "/" not in first
    assert is_sessionless(first) and is_sessionless(f"acme/{first}")
    assert tenant_of(f"acme/{first}") == "acme"
    assert not is_sessionless("acme/parent") and not is_sessionless("parent")
    # The namespace is the session part's: a tenant's name in it is not enough.
    assert not is_sessionless(f"{NAMESPACE}x/parent")


def test_only_another_sessionless_conversation_of_the_tenant_may_be_taken_over() -> None:
    old, new = anon("acme"), anon("acme")
    assert may_take_over(old, new)
    assert not may_take_over(old, old)  # its own leases go by its epochs
    assert not may_take_over("acme/parent", new)  # an explicit session: never
    assert not may_take_over(old, "acme/sub-agent")  # only by a sessionless turn
    assert not may_take_over(old, anon("evil"))  # never across tenants


def test_a_lease_holds_all_of_another_only_through_its_last_full_block() -> None:
    history = tokens(40 * BLOCK + 5)  # a partial last block
    old = content(history)
    # The next turn: the whole history (answer included) and more.
    assert holds_all_of(content(history + tokens(70, seed=1)), old, BLOCK)
    # Only the partial last block differs (a re-rendered answer's end): still all of it.
    assert holds_all_of(content(history[:-3] + tokens(40, seed=2)), old, BLOCK)
    # A conversation sharing only the opening (a system prompt): not all of it.
    assert not holds_all_of(content(history[: 20 * BLOCK] + tokens(30 * BLOCK, 3)), old, BLOCK)
    # Shorter than the old one: not all of it.
    assert not holds_all_of(content(history[: 30 * BLOCK]), old, BLOCK)
    # Nothing of a lease without a full block can be read by content: nothing to hold.
    assert not holds_all_of(content(history), content(history[:5]), BLOCK)


def test_a_longer_lease_s_stride_may_skip_the_old_last_checkpoint() -> None:
    """Past 256 blocks a lease keeps every stride-th hash: where its stride skips the old
    lease's last full block the rule cannot prove the whole, and says no (the old lease stays
    a cache entry until it expires or is reclaimed)."""
    history = tokens(300 * BLOCK)
    old = content(history[: 255 * BLOCK])  # every block's hash; last full block 254
    longer = content(history)  # stride 2: blocks 1, 3, ..., 253, 255, ...
    assert longer.stride == 2
    assert not holds_all_of(longer, old, BLOCK)
    assert holds_all_of(longer, content(history[: 254 * BLOCK]), BLOCK)  # block 253: kept


async def test_a_sessionless_conversation_keeps_one_lease_turn_after_turn() -> None:
    h = Harness()
    await h.fleet()
    history = tokens(20 * BLOCK + 7)
    turn_ids: list[str] = []
    for turn in range(3):
        conversation = anon()
        # The client's next turn is the history with the answer and a new message.
        match = await ask(h, conversation, history)
        if turn:
            assert match.lease is not None and match.lease.lease_id == turn_ids[-1]
        history = history + tokens(2 * BLOCK + 3, seed=turn + 1)
        lease = await retain(h, conversation, f"req-{turn}", history)
        turn_ids.append(lease.lease_id)
        live, _ = await h.registry.list_leases(LeaseListing(states=[ACTIVE]))
        assert [leased.lease_id for leased in live] == [lease.lease_id]
    for superseded in turn_ids[:-1]:
        ended = await h.registry.get_lease(superseded)
        assert (ended.state, ended.end_cause) == (REVOKED, SUPERSEDED)


async def test_conversations_sharing_an_opening_keep_their_own_leases() -> None:
    """Two sessionless conversations of one system prompt, and rollouts of one prompt: each
    forks from the other's lease by content and takes nothing from it."""
    h = Harness()
    await h.fleet()
    system = tokens(16 * BLOCK)
    first = await retain(h, anon(), "req-a", system + tokens(8 * BLOCK, seed=1))
    second = await retain(h, anon(), "req-b", system + tokens(8 * BLOCK, seed=2))
    rollout = await retain(h, anon(), "req-c", system + tokens(3 * BLOCK + 9, seed=3))
    for lease in (first, second, rollout):
        assert (await h.registry.get_lease(lease.lease_id)).state == ACTIVE


async def test_an_explicit_session_s_lease_is_never_taken_over() -> None:
    h = Harness()
    await h.fleet()
    history = tokens(20 * BLOCK)
    parent = await retain(h, "parent", "req-1", history)
    # A sessionless turn holding all of it, and an explicit one holding all of a sessionless
    # lease: neither ends the other's.
    sessionless = await retain(h, anon(), "req-2", history + tokens(2 * BLOCK, seed=1))
    fork = await retain(h, "sub-agent", "req-3", history + tokens(4 * BLOCK, seed=1))
    for lease in (parent, sessionless, fork):
        assert (await h.registry.get_lease(lease.lease_id)).state == ACTIVE


async def test_no_lease_of_another_tenant_is_taken_over() -> None:
    h = Harness()
    await h.fleet()
    history = tokens(20 * BLOCK)
    theirs = await retain(h, anon("acme"), "req-1", history)
    await retain(h, anon("evil"), "req-2", history + tokens(2 * BLOCK, seed=1))
    assert (await h.registry.get_lease(theirs.lease_id)).state == ACTIVE
