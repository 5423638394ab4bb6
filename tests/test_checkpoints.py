"""Prefix hashes at checkpoints (``kvbroker.common.rules.checkpoints``): what a hint carries stays
small at any context length, and the prefix check on them is sound (never more than the
tokens that really match) and loses at most one stride of blocks."""

from __future__ import annotations

import hashlib

from hypothesis import given, settings
from hypothesis import strategies as st

from kvbroker.common.rules.checkpoints import (
    BLOCK_HASH_BYTES,
    MAX_CHECKPOINTS,
    Checkpoints,
    checkpoint_blocks,
    probe_blocks,
    stride_for,
    thin,
)
from kvbroker.engine_ext.prefix import prefix_hashes, verified_prefix_tokens

BLOCK = 16


def tokens(n: int, seed: int = 0) -> list[int]:
    return [(7 * i + 3 + seed) % 4000 + 5 for i in range(n)]


def test_a_128k_token_conversation_keeps_256_hashes() -> None:
    full = prefix_hashes(tokens(131_072), BLOCK, 131_072)
    kept = Checkpoints.of(full)
    assert len(full) == 8192
    assert kept.stride == 32 and len(kept.hashes) == MAX_CHECKPOINTS  # 31, 63, …, 8191
    assert kept.hashes == [full[p] for p in checkpoint_blocks(8192, 32)]
    assert sum(map(len, kept.hashes)) <= 2100  # bytes, against 64 KiB for every block


def test_short_conversations_keep_every_hash() -> None:
    full = prefix_hashes(tokens(4000), BLOCK, 4000)
    assert Checkpoints.of(full) == Checkpoints(full, 1)


@given(st.integers(1, 20_000))
def test_thinning_keeps_the_checkpoint_blocks_and_is_idempotent(block_count: int) -> None:
    full = [i.to_bytes(4, "little") for i in range(block_count)]
    hashes, stride = thin(full, 1)
    assert len(hashes) <= MAX_CHECKPOINTS + 1
    assert hashes == [full[p] for p in checkpoint_blocks(block_count, stride)]
    assert thin(hashes, stride) == (hashes, stride)  # a registry thinning again changes nothing


@settings(max_examples=60, deadline=None)
@given(
    remote_tokens=st.integers(1, 9000),
    common=st.integers(0, 9000),
    extra=st.integers(0, 200),
)
def test_the_prefix_check_is_sound_and_loses_at_most_one_stride(
    remote_tokens: int, common: int, extra: int
) -> None:
    """D retained ``remote_tokens``; the prompt equals them for ``common`` tokens, then
    differs, and runs ``extra`` tokens past them."""
    common = min(common, remote_tokens)
    retained = tokens(remote_tokens)
    prompt = retained[:common] + tokens(remote_tokens - common + extra, seed=1)
    kept = Checkpoints.of(prefix_hashes(retained, BLOCK, remote_tokens))
    verified = verified_prefix_tokens(kept, prompt, BLOCK, remote_tokens)
    exact = verified_prefix_tokens(
        Checkpoints(prefix_hashes(retained, BLOCK, remote_tokens), 1), prompt, BLOCK, remote_tokens
    )
    matching = common if common < remote_tokens else remote_tokens
    assert verified <= exact <= matching
    assert exact - verified <= kept.stride * BLOCK
    if common == remote_tokens:
        assert verified == remote_tokens  # the conversation went on: everything is reused


def sixteen_byte_hashes(prompt: list[int], block_size: int) -> list[bytes]:
    """``prefix_hashes`` as kvbroker computed them before ``BLOCK_HASH_BYTES`` was 8."""
    hashes: list[bytes] = []
    previous = b""
    for start in range(0, len(prompt), block_size):
        digest = hashlib.sha256(previous)
        digest.update(b"".join(t.to_bytes(4, "little") for t in prompt[start : start + block_size]))
        previous = digest.digest()[:16]
        hashes.append(previous)
    return hashes


def test_an_older_engine_s_16_byte_hashes_never_verify_against_ours() -> None:
    """Mid-rollout a lease of an engine of the previous version may reach a prefill engine of
    this one: its KV is never read, whatever the tokens (lengths differ, and from block 1 on
    each hash chains the previous one at its own length)."""
    prompt = tokens(64 * BLOCK)
    ours = prefix_hashes(prompt, BLOCK, len(prompt))
    theirs = sixteen_byte_hashes(prompt, BLOCK)
    assert {len(h) for h in ours} == {BLOCK_HASH_BYTES} and {len(h) for h in theirs} == {16}
    assert verified_prefix_tokens(Checkpoints.of(theirs), prompt, BLOCK, len(prompt)) == 0
    cut = [h[:BLOCK_HASH_BYTES] for h in theirs]
    assert cut[0] == ours[0]  # nothing chains before block 0
    assert all(a != b for a, b in zip(cut[1:], ours[1:], strict=True))


@given(st.integers(1, 200_000))
def test_the_stride_is_a_power_of_two_and_keeps_the_bound(block_count: int) -> None:
    stride = stride_for(block_count)
    assert stride & (stride - 1) == 0
    assert len(checkpoint_blocks(block_count, stride)) <= MAX_CHECKPOINTS + 1
    assert stride < 2 * -(-block_count // MAX_CHECKPOINTS)  # at most twice the least stride


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 200_000))
def test_every_probe_block_at_or_past_the_stride_is_a_checkpoint(block_count: int) -> None:
    """The prefix index keys a lease by its hashes at 2**k - 1: they must be among what it
    keeps, for every 2**k at or past its stride."""
    full = [i.to_bytes(4, "little") for i in range(block_count)]
    kept = Checkpoints.of(full)
    positions = set(checkpoint_blocks(block_count, kept.stride))
    probes = probe_blocks(block_count)
    assert probes == [(1 << k) - 1 for k in range(len(probes))]
    assert len(probes) <= block_count.bit_length()
    for block in probes:
        if block + 1 >= kept.stride:
            assert block in positions
