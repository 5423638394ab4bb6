"""What ``kvbroker bench nixl-read`` reads: the run's settings, vLLM's two KV cache layouts as
NIXL regions, and the descriptor lists each form builds over them (``bench/nixl_read.py``
says why the forms are compared)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

DEVICES = ("cuda", "cpu")
LAYOUTS = ("split", "packed")
FORMS = ("scattered", "adjacent", "strided", "contiguous")
# The form of ``ReadConfig.shapes``: per-block descriptors for blocks in a given number of runs.
RUNS = "runs"
# The form vLLM 0.33's connector issues: the planner's GPU READ cost is fitted on it.
VLLM_033 = ("packed", "strided")
# Regions a layer registers, by layout.
REGIONS_PER_LAYER = {"split": 2, "packed": 1}
# A poisoned destination word: no random fill is made of it.
POISON = 0x5A5A5A5A
# Weights of a chunk's checksum: with 32-bit words and chunks of at most 8192 words the
# weighted sum stays inside int64, and the weights catch words moved within a chunk.
CHECKSUM_MODULUS = 65521


@dataclass(frozen=True)
class ReadConfig:
    """One run: the cache shape (a 32B-class model by default, Qwen2.5-32B's 64 layers, 8 KV
    heads of 128, bf16, vLLM's 16-token blocks) and what is measured on it."""

    device: str = "cuda"
    tokens: tuple[int, ...] = (2048, 4096, 8192, 16384, 24576)
    layouts: tuple[str, ...] = LAYOUTS
    forms: tuple[str, ...] = FORMS
    layers: int = 64
    kv_heads: int = 8
    head_dim: int = 128
    block_size: int = 16
    element_bytes: int = 2
    warmup: int = 2
    repeats: int = 7
    seed: int = 0
    # One READ (or the owner's start) taking longer than this is a failure, not a figure.
    timeout_s: float = 120.0
    # One NIXL agent READing from its own registered memory (source and destination caches in
    # one process), instead of a reader and an owner process.
    loopback: bool = False
    # (tokens, runs): READs of per-block descriptors whose ids come in that many runs on both
    # sides (form ``runs``), shaped like the READs the workloads measured.
    shapes: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise ValueError(f"device {self.device!r} is not one of {', '.join(DEVICES)}")
        for name, given, known in (
            ("layout", self.layouts, LAYOUTS),
            ("form", self.forms, FORMS),
        ):
            unknown = [value for value in given if value not in known]
            if unknown or not given:
                raise ValueError(
                    f"{name}s {', '.join(given) or '(none)'}: choose from {', '.join(known)}"
                )
        if not self.tokens or min(self.tokens) < 1:
            raise ValueError("token counts must be whole numbers of at least 1")
        for tokens, runs in self.shapes:
            if tokens < 1 or not 1 <= runs <= self.blocks(tokens):
                raise ValueError(
                    f"shape {tokens}:{runs}: a READ of {tokens} tokens has between 1 and "
                    f"{max(self.blocks(tokens), 1)} runs"
                )
        for name in ("layers", "kv_heads", "head_dim", "block_size", "element_bytes", "repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        if self.warmup < 0:
            raise ValueError("warmup must not be negative")
        if self.chunk_bytes % 4:
            raise ValueError("a block's K (block_size x kv_heads x head_dim) must be whole words")

    @property
    def chunk_bytes(self) -> int:
        """One block's K (or V) of one layer: the unit that both layouts are made of."""
        return self.block_size * self.kv_heads * self.head_dim * self.element_bytes

    @property
    def num_blocks(self) -> int:
        """Blocks in each cache: twice the largest read, so scattered ids can scatter."""
        return 2 * self.blocks(max((*self.tokens, *(t for t, _ in self.shapes))))

    @property
    def cache_bytes(self) -> int:
        """One process's KV cache."""
        return self.layers * self.num_blocks * 2 * self.chunk_bytes

    def blocks(self, tokens: int) -> int:
        return -(-tokens // self.block_size)


def parse_shapes(value: str) -> tuple[tuple[int, int], ...]:
    """``--shapes``: comma-separated ``tokens:runs`` (``24k:120``; a ``k`` means 1024)."""
    out = []
    for part in (p.strip().lower() for p in value.split(",") if p.strip()):
        tokens, _, runs = part.partition(":")
        number = tokens.removesuffix("k")
        if not (number.isdigit() and runs.isdigit()):
            raise ValueError(f"shape {part!r} is not tokens:runs (like 24k:120)")
        out.append((int(number) * (1024 if tokens.endswith("k") else 1), int(runs)))
    return tuple(out)


def run_ids(rng: Any, num_blocks: int, blocks: int, runs: int) -> tuple[Any, Any]:
    """Source and destination ids of a READ of ``blocks`` in exactly ``runs`` runs on both
    sides (``kvbroker.common.rules.fragmentation.paired_runs``): the same random cut into
    runs on both sides, each side's runs placed at random in its cache, never abutting (a gap
    of at least one block between any two), in random order."""
    cuts = np.sort(rng.choice(np.arange(1, blocks), runs - 1, replace=False))
    lengths = np.diff(np.concatenate([[0], cuts, [blocks]])).astype(np.int64)

    def side() -> Any:
        order = rng.permutation(runs)  # where each run sits in the cache, left to right
        spare = num_blocks - blocks - (runs - 1)  # blocks left after the one-block gaps
        extra = np.diff(np.sort(rng.integers(0, spare + 1, size=runs)), prepend=0)
        starts = np.empty(runs, dtype=np.int64)
        position = 0
        for slot, run in enumerate(order):
            position += int(extra[slot]) + (1 if slot else 0)
            starts[run] = position
            position += int(lengths[run])
        return np.concatenate([np.arange(s, s + n) for s, n in zip(starts, lengths, strict=True)])

    return side(), side()


# -- descriptors: address arithmetic only, no NIXL ------------------------------------------


def regions(config: ReadConfig, layout: str, bases: Sequence[int]) -> list[tuple[int, int]]:
    """(start address, block length) of each NIXL region the connector registers for the
    per-layer tensors at ``bases``, in its order (layer-major). A region's blocks abut."""
    if layout == "split":
        half = config.num_blocks * config.chunk_bytes
        return [(base + kv * half, config.chunk_bytes) for base in bases for kv in (0, 1)]
    return [(base, 2 * config.chunk_bytes) for base in bases]


def per_block_descs(spans: Sequence[tuple[int, int]], num_blocks: int, device_id: int) -> Any:
    """Nx3 (address, length, device) with one row per region and block: descriptor
    ``r * num_blocks + b`` is block b of region r."""
    rows = np.empty((len(spans) * num_blocks, 3), dtype=np.uint64)
    offsets = np.arange(num_blocks, dtype=np.uint64)
    for index, (base, length) in enumerate(spans):
        part = rows[index * num_blocks : (index + 1) * num_blocks]
        part[:, 0] = base + offsets * np.uint64(length)
        part[:, 1] = length
        part[:, 2] = device_id
    return rows


def strided_descs(spans: Sequence[tuple[int, int]], num_blocks: int, device_id: int) -> Any:
    """NIXL 1.5's Nx5 (address, length, device, stride, count): one row per region, as vLLM
    0.33's ``_block_strided_descs`` builds it; NIXL numbers its blocks as
    :func:`per_block_descs` does."""
    return np.array(
        [(base, length, device_id, length, num_blocks) for base, length in spans],
        dtype=np.uint64,
    ).reshape(-1, 5)


def span_descs(spans: Sequence[tuple[int, int]], first: int, count: int, device_id: int) -> Any:
    """Nx3 with one descriptor per region over ``count`` blocks from ``first``: the floor."""
    return np.array(
        [(base + first * length, count * length, device_id) for base, length in spans],
        dtype=np.uint64,
    ).reshape(-1, 3)


def desc_ids(num_regions: int, num_blocks: int, block_ids: Any) -> Any:
    """Descriptor indices of ``block_ids`` in every region, region-major as vLLM's
    ``_compute_desc_ids`` orders them."""
    ids = np.arange(num_regions, dtype=np.int64)[:, None] * num_blocks + block_ids[None, :]
    return ids.ravel().astype(np.int32)


def chunk_ids(layout: str, num_blocks: int, block_ids: Any) -> Any:
    """The chunks (one block's K or V, see ``ReadConfig.chunk_bytes``) of one layer's tensor
    that ``block_ids`` cover; the same order for source and destination ids, so the i-th source
    chunk lands in the i-th destination chunk."""
    if layout == "split":
        return np.concatenate([block_ids, num_blocks + block_ids])
    return np.stack([2 * block_ids, 2 * block_ids + 1], axis=1).ravel()
