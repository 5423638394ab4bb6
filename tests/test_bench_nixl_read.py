"""`kvbroker bench nixl-read` on DRAM at tiny sizes (the real CLI, two processes and NIXL's UCX
backend: every cell's last READ is checked against the owner's bytes), its descriptor
arithmetic, and the GPU READ defaults it informs."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest

from kvbroker.bench.nixl_layout import (
    ReadConfig,
    chunk_ids,
    desc_ids,
    per_block_descs,
    regions,
    strided_descs,
)
from kvbroker.common.rules.costs import DEFAULT_COSTS, GPU_COSTS, KvDevice, default_costs
from kvbroker.stack import KVBROKER

TINY = ("--layers", "2", "--kv-heads", "1", "--head-dim", "8", "--block-size", "16")


def bench(*args: str) -> subprocess.CompletedProcess[str]:
    # Two Python processes importing torch: slow on a loaded machine, so a generous bound.
    return subprocess.run(
        [KVBROKER, "bench", "nixl-read", *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=240,
    )


def test_reads_every_layout_and_form_on_dram(tmp_path: Path) -> None:
    ran = bench(
        "--device", "cpu", "--tokens", "32,64", *TINY, "--warmup", "0", "--repeats", "2",
        "--output", str(tmp_path),
    )  # fmt: skip
    assert ran.returncode == 0, ran.stderr + ran.stdout
    report = json.loads((tmp_path / "nixl_read.json").read_text())
    assert (tmp_path / "nixl_read.png").stat().st_size > 0
    cells = {(c["layout"], c["form"], c["tokens"]): c for c in report["cells"]}
    assert len(cells) == 2 * 4 * 2
    # 64 tokens are 4 blocks; 2 layers: split K/V is 4 regions, packed 2.
    assert cells["split", "scattered", 64]["descriptors"] == 16
    assert cells["split", "strided", 64]["descriptors"] == 16
    assert cells["packed", "adjacent", 64]["descriptors"] == 8
    assert cells["split", "contiguous", 64]["descriptors"] == 4
    assert cells["packed", "contiguous", 32]["descriptors"] == 2
    for cell in cells.values():
        assert len(cell["times_ms"]) == 2 and cell["median_ms"] > 0
        assert cell["bytes"] == cell["blocks"] * 2 * 2 * 16 * 8 * 2
    assert set(report["fits"]) == {f"{lay}/{form}" for lay, form, _ in cells}
    assert "us_per_descriptor" not in report["fits"]["packed/contiguous"]
    assert report["meta"]["device_name"] and report["meta"]["nixl"] == "1.5.1"
    assert "packed/strided" in ran.stdout
    measured = (tmp_path / "nixl_read.cells.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in measured] == report["cells"]


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (("--forms", "scattered,bogus"), "forms scattered, bogus: choose from"),
        (("--tokens", "2x"), "token count '2x' is not a whole number"),
        (("--device", "tpu"), "device 'tpu' is not one of cuda, cpu"),
    ],
)
def test_bad_input_is_refused_in_a_sentence(flags: tuple[str, ...], said: str) -> None:
    ran = bench(*flags)
    assert ran.returncode == 2
    assert said in ran.stderr + ran.stdout
    assert "Traceback" not in ran.stderr


@pytest.mark.parametrize("layout", ["split", "packed"])
def test_descriptors_cover_the_chunks_they_name(layout: str) -> None:
    """Descriptor ``r * num_blocks + b`` (per-block and strided alike) spans exactly the bytes
    of the chunks ``chunk_ids`` names for block b in region r's layer: the check the bench
    makes after a READ compares the right bytes."""
    config = ReadConfig(tokens=(64,), layers=3, kv_heads=1, head_dim=8)
    layer_bytes = config.num_blocks * 2 * config.chunk_bytes
    # Layers apart, so that no descriptor abuts the next layer's.
    bases = [10_000 + layer * (layer_bytes + 4096) for layer in range(config.layers)]
    spans = regions(config, layout, bases)
    flat = per_block_descs(spans, config.num_blocks, 0)
    strided = strided_descs(spans, config.num_blocks, 0)
    assert len(strided) == len(spans)
    # NIXL expands a strided row into `count` blocks `stride` apart, in order.
    expanded = np.concatenate(
        [
            [(a + i * stride, length, dev) for i in range(count)]
            for a, length, dev, stride, count in strided
        ]
    )
    assert np.array_equal(expanded.astype(np.uint64), flat)
    blocks = np.array([5, 0, 7], dtype=np.int64)
    ids = desc_ids(len(spans), config.num_blocks, blocks)
    per_layer = len(spans) // config.layers
    covered = sorted((int(flat[i][0]), int(flat[i][0] + flat[i][1])) for i in ids)
    named = sorted(
        (base + c * config.chunk_bytes, base + (c + 1) * config.chunk_bytes)
        for base in bases
        for c in chunk_ids(layout, config.num_blocks, blocks)
    )
    assert per_layer == (2 if layout == "split" else 1)
    # A packed block's descriptor is its two chunks back to back.
    merged: list[tuple[int, int]] = []
    for start, end in named:
        if merged and merged[-1][1] == start and layout == "packed":
            merged[-1] = (merged[-1][0], end)
        else:
            merged.append((start, end))
    assert covered == merged


def test_gpu_nodes_default_to_the_gpu_read_cost() -> None:
    assert default_costs(KvDevice.CUDA) is GPU_COSTS
    assert default_costs(KvDevice.CPU) is DEFAULT_COSTS
    assert default_costs(None) is DEFAULT_COSTS
    # Issue 35's H200 table, 0.33's packed cache: 24k tokens scattered (every block its own
    # run) 787.7 ms, in one run the bytes and one run's 64 descriptors.
    assert GPU_COSTS.read_ms(1536) == pytest.approx(787.7)
    assert 5 < GPU_COSTS.read_ms(1536, 1) < 6
    # Only the READ figures differ.
    assert GPU_COSTS.prefill_ms(1000, 1000) == DEFAULT_COSTS.prefill_ms(1000, 1000)
