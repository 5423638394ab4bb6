"""What a READ of KV blocks costs NIXL: not its bytes, its runs of consecutive block ids.

vLLM's NIXL connector issues a READ as one descriptor per (region, block) pair, the i-th
source block landing in the i-th destination block. NIXL merges descriptors that abut on both
sides, so what a READ really posts is one descriptor per region for each *run*: a stretch of
pairs in which the source id and the destination id are each the previous one plus one. On a
GPU each descriptor costs about 8 µs whatever its bytes (``docs/gpu-transfer.md``), so a READ
of 1,536 scattered blocks costs two orders of magnitude more than the same blocks in one run.

The engine counts both sides for every READ it issues (``engine_ext.fragmentation``); the
planner knows only the source side before it decides (the lease's block ids: the destination
is allocated on the prefill node after the decision), and prices the READ by
:func:`runs` of the source, a lower bound of the paired count (:func:`paired_runs`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


def runs(block_ids: Sequence[int]) -> int:
    """Runs of consecutive ids in one list, in its order (each id the previous plus one): the
    descriptors a READ from or into these blocks needs at least, per region. 0 when empty."""
    return sum(1 for i, b in enumerate(block_ids) if i == 0 or b != block_ids[i - 1] + 1)


def paired_runs(source: Sequence[int], destination: Sequence[int]) -> int:
    """Runs of a READ that takes ``source[i]`` into ``destination[i]``: a run goes on while
    both ids are each the previous plus one, so it is never fewer than either side's
    :func:`runs`. The lists must be as long as each other."""
    if len(source) != len(destination):
        raise ValueError(
            f"a READ pairs blocks one to one: {len(source)} source and "
            f"{len(destination)} destination ids"
        )
    return sum(
        1
        for i in range(len(source))
        if i == 0 or source[i] != source[i - 1] + 1 or destination[i] != destination[i - 1] + 1
    )


@dataclass(frozen=True, slots=True)
class ReadShape:
    """One READ's blocks and runs: ``runs`` is what NIXL posts per region; ``source_runs`` and
    ``destination_runs`` say which side broke them up."""

    blocks: int
    runs: int
    source_runs: int
    destination_runs: int


def read_shape(source: Sequence[int], destination: Sequence[int]) -> ReadShape:
    """The shape of a READ of ``source[i]`` into ``destination[i]``."""
    return ReadShape(
        blocks=len(source),
        runs=paired_runs(source, destination),
        source_runs=runs(source),
        destination_runs=runs(destination),
    )
