"""Which retained blocks' prefix hashes travel: checkpoints, so that a hint stays small at any
context length.

Prefix hashes chain (equal hashes at block i mean equal tokens in blocks 0..i), so a prefill
node that finds the hash at block i equal to its own knows every block before it matches
without seeing their hashes. A lease therefore keeps the hashes of blocks ``stride - 1``,
``2 * stride - 1``, … and of its last block, with the stride chosen so that at most
``MAX_CHECKPOINTS`` + 1 hashes are kept: up to 256 blocks every hash (exact reuse), and for a
128k-token conversation in 16-token blocks every 32nd (about 4 KiB instead of 128 KiB). The
cost is granularity: when a prompt diverges from the retained tokens (an earlier turn edited),
reuse stops at the last checkpoint before the divergence instead of the last block.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

MAX_CHECKPOINTS = 256


def stride_for(block_count: int) -> int:
    """The smallest stride that keeps ``block_count`` blocks within ``MAX_CHECKPOINTS``."""
    return max(1, -(-block_count // MAX_CHECKPOINTS))


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
    regular, last = list(hashes[:-1]), list(hashes[-1:])
    factor = stride_for(len(regular))
    if factor == 1:
        return [*regular, *last], stride
    return [*regular[factor - 1 :: factor], *last], stride * factor


@dataclass(frozen=True, slots=True)
class Checkpoints:
    """A lease's prefix hashes as it keeps them: at most ``MAX_CHECKPOINTS`` + 1."""

    hashes: list[bytes]
    stride: int

    @classmethod
    def of(cls, hashes: Sequence[bytes], stride: int = 1) -> Checkpoints:
        """From hashes at ``stride`` as reported (0 and 1: every block's), thinned."""
        return cls(*thin(hashes, stride))
