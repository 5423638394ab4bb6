"""Which retained blocks' prefix hashes travel: checkpoints, so that a hint stays small at any
context length.

Prefix hashes chain (equal hashes at block i mean equal tokens in blocks 0..i), so a prefill
node that finds the hash at block i equal to its own knows every block before it matches
without seeing their hashes. A lease therefore keeps the hashes of blocks ``stride - 1``,
``2 * stride - 1``, … and of its last block, with the stride chosen so that at most
``MAX_CHECKPOINTS`` + 1 hashes are kept: up to 256 blocks every hash (exact reuse), and for a
128k-token conversation in 16-token blocks every 32nd (about 2 KiB instead of 64 KiB). The
cost is granularity: when a prompt diverges from the retained tokens (an earlier turn edited),
reuse stops at the last checkpoint before the divergence instead of the last block.

The stride is a power of two, so every block index ``2**k - 1`` with ``2**k >= stride`` is a
checkpoint of every lease long enough to have it. Those are the hashes the registry's prefix
index keys a lease by (``probe_blocks``): a prompt's hashes at the same indexes find the leases
that share its prefix, whatever their conversation, in about log2(blocks) look-ups
(``docs/design.md``, "Forks: reuse by content").

Every prefix hash is ``BLOCK_HASH_BYTES`` long: the engine computes them so, the registry
refuses any other length and keeps a lease's hashes end to end without framing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

MAX_CHECKPOINTS = 256
# A prefix hash's length: 64 bits, as Dynamo's KV router and llm-d's kvblock index key blocks.
# A collision needs two prompts whose chained hashes agree at a checkpoint, one in 2^64 a
# compare; the registry keeps 32 of them a lease, so each byte here is ~32 bytes a lease.
BLOCK_HASH_BYTES = 8


def stride_for(block_count: int) -> int:
    """The smallest power of two that, as a stride, keeps ``block_count`` blocks within
    ``MAX_CHECKPOINTS`` (a power of two, so that ``probe_blocks`` are checkpoints)."""
    needed = max(1, -(-block_count // MAX_CHECKPOINTS))
    return 1 << (needed - 1).bit_length()


def probe_blocks(block_count: int) -> list[int]:
    """The block indexes ``2**k - 1`` (0, 1, 3, 7, ...) below ``block_count``: where the prefix
    index keys a lease and where a prompt is looked up by, about log2(blocks) of them."""
    blocks: list[int] = []
    size = 1
    while size - 1 < block_count:
        blocks.append(size - 1)
        size <<= 1
    return blocks


def checkpoint_blocks(block_count: int, stride: int) -> list[int]:
    """The block indexes whose hashes a lease of ``block_count`` blocks keeps at ``stride``."""
    if block_count <= 0:
        return []
    return [*range(stride - 1, block_count - 1, stride), block_count - 1]


def thin(hashes: Sequence[bytes], stride: int) -> tuple[list[bytes], int]:
    """Checkpoints at ``stride`` (1: every block's hash) thinned to at most
    ``MAX_CHECKPOINTS`` + 1 hashes; returns them and their stride. Needs no block count: all
    but the last hash sit at multiples of the stride, and thinning by k keeps every k-th."""
    stride = max(stride, 1)
    # Read once: each read of a protobuf's repeated bytes makes a new object.
    kept = list(hashes)
    regular = len(kept) - 1  # all but the last
    factor = stride_for(regular)
    if factor == 1:
        return kept, stride
    return [*kept[factor - 1 : regular : factor], kept[-1]], stride * factor


@dataclass(frozen=True, slots=True)
class Checkpoints:
    """A lease's prefix hashes as it keeps them: at most ``MAX_CHECKPOINTS`` + 1."""

    hashes: list[bytes]
    stride: int

    @classmethod
    def of(cls, hashes: Sequence[bytes], stride: int = 1) -> Checkpoints:
        """From hashes at ``stride`` as reported (0 and 1: every block's), thinned."""
        return cls(*thin(hashes, stride))
