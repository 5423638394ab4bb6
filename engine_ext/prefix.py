"""Chained block hashes of token ids: what lets a prefill node prove that a decode node's
retained KV belongs to a prefix of its own prompt before reading it.

vLLM's own block hashes are seeded per process (and off when prefix caching is off), so P and
D cannot compare them; these are sha256 over the token ids, chained, cut to
``BLOCK_HASH_BYTES``, so equal hashes at block i mean equal tokens in blocks 0..i. The last
block may be partial: its hash covers the tokens up to ``num_tokens``.

Engines of two versions whose hash lengths differ never verify each other's KV: bytes of
different lengths never compare equal, and from block 1 on each hash chains the previous one
at its own length, so even a cut to the shorter length differs.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from kvbroker.common.rules.checkpoints import BLOCK_HASH_BYTES, Checkpoints, checkpoint_blocks


def prefix_hashes(tokens: Sequence[int], block_size: int, num_tokens: int) -> list[bytes]:
    """Hashes of blocks covering ``tokens[:num_tokens]`` (the last one possibly partial)."""
    hashes: list[bytes] = []
    previous = b""
    for start in range(0, min(num_tokens, len(tokens)), block_size):
        end = min(start + block_size, num_tokens)
        digest = hashlib.sha256(previous)
        digest.update(b"".join(t.to_bytes(4, "little") for t in tokens[start:end]))
        previous = digest.digest()[:BLOCK_HASH_BYTES]
        hashes.append(previous)
    return hashes


def verified_prefix_tokens(
    remote: Checkpoints,
    prompt: Sequence[int],
    block_size: int,
    remote_num_tokens: int,
) -> int:
    """How many leading tokens of the remote KV equal the prompt's: through the last
    checkpoint whose hash is the prompt's (hashes chain, so every block before it matches
    too); a partial last block counts only if it matches."""
    local = prefix_hashes(prompt, block_size, min(remote_num_tokens, len(prompt)))
    positions = checkpoint_blocks(-(-remote_num_tokens // block_size), remote.stride)
    matched = 0
    for position, theirs in zip(positions, remote.hashes, strict=False):
        if position >= len(local) or local[position] != theirs:
            break
        matched = position + 1
    return min(matched * block_size, remote_num_tokens, len(prompt))
