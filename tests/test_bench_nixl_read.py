"""`kvbroker bench nixl-read` on DRAM at tiny sizes (the real CLI, two processes and NIXL's UCX
backend: every cell's last READ is checked against the owner's bytes), its descriptor
arithmetic, and the GPU READ defaults it informs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvbroker.common.rules.costs import DEFAULT_COSTS, GPU_COSTS, KvDevice, default_costs
from kvbroker.common.rules.fragmentation import paired_runs, runs
from kvbroker_tools.bench.nixl_layout import (
    ReadConfig,
    chunk_ids,
    desc_ids,
    parse_shapes,
    per_block_descs,
    regions,
    run_ids,
    strided_descs,
)
from kvbroker_tools.stack import KVBROKER

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


def test_one_agent_reads_from_itself_in_loopback_with_reads_shaped_by_runs(
    tmp_path: Path,
) -> None:
    """The loopback mode, without the kvbroker CLI (as on a GPU machine with only torch and
    nixl): one agent, both caches registered with it, every cell checked byte for byte."""
    ran = subprocess.run(
        [
            sys.executable, "-m", "kvbroker_tools.bench.nixl_read", "--loopback", "--device", "cpu",
            "--tokens", "32,64", *TINY, "--warmup", "0", "--repeats", "2",
            "--forms", "scattered,adjacent,contiguous", "--shapes", "128:3,64:1",
            "--output", str(tmp_path),
        ],
        check=False, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert ran.returncode == 0, ran.stderr + ran.stdout
    report = json.loads((tmp_path / "nixl_read.json").read_text())
    assert (tmp_path / "nixl_read.png").stat().st_size > 0
    assert "loopback" in report["meta"]["processes"]
    assert report["meta"]["ucx_backend_params"] == {"ucx_error_handling_mode": "none"}
    assert report["meta"]["ucx_env"]["UCX_CUDA_IPC_ENABLE_SAME_PROCESS"] == "y"
    cells = {(c["layout"], c["form"], c["tokens"]): c for c in report["cells"]}
    assert len(cells) == 2 * 3 * 2 + 2 * 2
    assert cells["packed", "runs", 128]["runs"] == 3
    assert cells["split", "runs", 64]["runs"] == 1
    assert cells["packed", "adjacent", 64]["runs"] == 1
    assert cells["split", "runs", 128]["descriptors"] == 8 * 4  # per-block: 8 blocks, 4 regions
    assert set(report["fits"]) == {f"{lay}/{f}" for lay in ("split", "packed")
                                   for f in ("scattered", "adjacent", "contiguous")}  # fmt: skip


def test_reads_in_runs_have_exactly_their_runs_on_both_sides() -> None:
    rng = np.random.default_rng(3)
    for blocks, wanted in ((1, 1), (10, 1), (10, 10), (1536, 120), (129, 69)):
        src, dst = run_ids(rng, 3072, blocks, wanted)
        assert len(set(src.tolist())) == len(set(dst.tolist())) == blocks
        assert max(src.max(), dst.max()) < 3072
        assert runs(src.tolist()) == runs(dst.tolist()) == wanted
        assert paired_runs(src.tolist(), dst.tolist()) == wanted
    assert parse_shapes("24k:120, 2048:3") == ((24576, 120), (2048, 3))
    with pytest.raises(ValueError, match="tokens:runs"):
        parse_shapes("24k")
    with pytest.raises(ValueError, match="between 1 and 2"):
        ReadConfig(tokens=(64,), shapes=((32, 3),))


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
    # The H200 loopback run, 0.33's packed cache: 24k tokens in 1,445 runs 719.7 ms; in one
    # run the bytes and one run's 64 descriptors (5.5 to 6.8 ms measured).
    assert GPU_COSTS.read_ms(1536, 1445) == pytest.approx(719.7, rel=0.05)
    assert GPU_COSTS.read_ms(1536) > GPU_COSTS.read_ms(1536, 1445)  # unknown ids: scattered
    assert 5 < GPU_COSTS.read_ms(1536, 1) < 6
    # Only the READ figures differ.
    assert GPU_COSTS.prefill_ms(1000, 1000) == DEFAULT_COSTS.prefill_ms(1000, 1000)
