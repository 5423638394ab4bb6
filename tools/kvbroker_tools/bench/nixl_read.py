"""`kvbroker bench nixl-read`: what one NIXL READ of a conversation's KV costs, by how the
descriptors are built.

The planner's READ cost (``kvbroker/common/rules/costs.py``: fixed + runs x per-run + blocks x
per-block) comes from it on GPUs: there a READ is dominated by NIXL's per-descriptor work, not
by bytes (an H200 pair
read 24k tokens of a 32B-class model in 767 ms with per-block descriptors and in 24 ms with one
descriptor per layer, issue 27). vLLM 0.33 changed both the cache layout and the way the
descriptor lists are built, so this measures the forms side by side on the same bytes:

* two processes, the reader P and the owner D (as in P/D serving, P pulls), each with a
  vLLM-shaped paged KV cache (one tensor per layer) registered with NIXL's UCX backend;
* two layouts of the same bytes: ``split``, vLLM 0.32's FlashAttention cache per layer
  ``[2, num_blocks, block_size, heads, head_dim]``, which the connector registers as a K and a
  V region (two descriptors per block and layer), and ``packed``, vLLM 0.33's
  ``[num_blocks, heads, block_size, 2 * head_dim]``, one region per layer;
* four descriptor forms: per-block descriptors prepared once as an Nx3 list (vLLM 0.32's
  form) read for scattered block ids and for adjacent ids (NIXL merges abutting
  descriptors), the same blocks prepared from NIXL 1.5's strided Nx5 list (vLLM 0.33's
  ``_block_strided_descs``: one row per region) read for scattered ids, and one descriptor per
  region over all N blocks, the floor.

``--loopback`` measures the same cells with one NIXL agent in one process READing from its own
registered memory (a source and a destination cache, both registered with it), the UCX backend
created with ``ucx_error_handling_mode=none`` and ``UCX_TLS=cuda_copy,cuda_ipc,self,sm``,
``UCX_CUDA_IPC_ENABLE_SAME_PROCESS=y`` (set by the bench unless already set): on one GPU whose
UCX has no ``cuda_ipc`` between processes, the two-process mode measures TCP emulation, and
this one UCX's real GPU path (issue 35). ``--shapes`` adds READs whose ids come in a given
number of runs on both sides (form ``runs``), shaped like the READs the workloads measured
(``kvbroker_read_runs``): what a READ costs is its runs, not its bytes.

A READ is timed from ``make_prepped_xfer`` to NIXL's DONE, as the connector issues it. The
last repeat of every cell poisons its destination and checks the bytes that arrived against
D's checksums, so a fast wrong transfer cannot pass. Only ``torch`` and ``nixl`` are needed,
never vLLM; ``--device cpu`` runs the same code on DRAM (the test does, at tiny sizes).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import platform
from collections.abc import Callable, Sequence
from dataclasses import asdict
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

from kvbroker_tools.bench.nixl_agents import (
    LOOPBACK_ENV,
    LOOPBACK_UCX_PARAMS,
    Cache,
    Reader,
    loopback_reader,
    receive,
    serve_owner,
)
from kvbroker_tools.bench.nixl_layout import RUNS, VLLM_033, ReadConfig
from kvbroker_tools.bench.plotting import ready_plotting, save_figure


def fit(cells: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Least squares of the median READ time on blocks read: the planner's read_fixed_ms and
    read_us_per_block (``Costs.read_ms``), and, where descriptors are per block, the same
    slope per descriptor."""
    blocks = np.array([c["blocks"] for c in cells], dtype=float)
    ms = np.array([c["median_ms"] for c in cells], dtype=float)
    if len(set(blocks.tolist())) < 2:
        raise ValueError("a fit needs reads of at least two sizes")
    slope, intercept = np.polyfit(blocks, ms, 1)
    line = {"read_fixed_ms": float(intercept), "read_us_per_block": float(slope * 1e3)}
    if cells[0]["form"] != "contiguous":  # its descriptors do not grow with the blocks
        line["us_per_descriptor"] = (
            line["read_us_per_block"] * cells[0]["blocks"] / cells[0]["descriptors"]
        )
    return line


# -- the two processes ----------------------------------------------------------------------


def run_reads(
    config: ReadConfig, progress: Callable[[str], None], output: Path | None = None
) -> dict[str, Any]:
    """Starts D, reads from it as P, stops it: the report (meta, cells, fits). With ``output``,
    each cell is also appended to its ``nixl_read.cells.jsonl`` as it is measured, so a run
    cut short (a device lease ends) still leaves what it measured."""
    if config.loopback:
        for name, value in LOOPBACK_ENV.items():
            os.environ.setdefault(name, value)  # before UCX starts in this process
    import torch

    if config.device == "cuda":
        free, _ = torch.cuda.mem_get_info(0)
        if 2 * config.cache_bytes > free:
            raise ValueError(
                f"two caches of {config.cache_bytes / 2**30:.1f} GiB do not fit in the "
                f"{free / 2**30:.1f} GiB free on GPU 0: read fewer tokens or layers"
            )
    if config.loopback:
        reader = loopback_reader(config)
        progress(f"loopback agent ready: two caches of {config.cache_bytes / 2**30:.2f} GiB")
        cells = _cells(config, reader, progress, output)
    else:
        cells, reader = _two_processes(config, progress, output)
    fits = {}
    if len(set(config.tokens)) > 1:
        for layout in config.layouts:
            for form in config.forms:
                key = f"{layout}/{form}"
                fits[key] = fit([c for c in cells if f"{c['layout']}/{c['form']}" == key])
    return {"meta": _meta(config, torch), "prep_ms": reader.prep_ms, "cells": cells, "fits": fits}


def _two_processes(
    config: ReadConfig, progress: Callable[[str], None], output: Path | None
) -> tuple[list[dict[str, Any]], Reader]:
    """The cells read by this process (P) from an owner process (D)."""
    context = mp.get_context("spawn")  # CUDA cannot be used in a forked child
    ours, theirs = context.Pipe()
    owner = context.Process(target=serve_owner, args=(config, theirs), daemon=True)
    owner.start()
    try:
        hello = receive(ours, owner, config.timeout_s)
        progress(f"owner ready: {config.cache_bytes / 2**30:.2f} GiB of KV in each process")
        reader = Reader(config, Cache(config, "reader", config.seed + 2), hello)
        return _cells(config, reader, progress, output), reader
    finally:
        if owner.is_alive():
            ours.send("stop")
            owner.join(config.timeout_s)
        if owner.is_alive():
            owner.kill()


def _cells(
    config: ReadConfig, reader: Reader, progress: Callable[[str], None], output: Path | None
) -> list[dict[str, Any]]:
    """Every layout x form x size, then every layout x shape (form ``runs``)."""
    points: list[tuple[str, str, int, int | None]] = [
        (layout, form, tokens, None)
        for layout in config.layouts
        for form in config.forms
        for tokens in config.tokens
    ]
    points += [(layout, RUNS, t, runs) for layout in config.layouts for t, runs in config.shapes]
    partial = None
    if output is not None:
        output.mkdir(parents=True, exist_ok=True)
        partial = output / "nixl_read.cells.jsonl"
        partial.write_text("")
    cells = []
    for layout, form, tokens, runs in points:
        cell = reader.cell(layout, form, tokens, runs)
        progress(
            f"{layout}/{form} {tokens} tokens: {cell['median_ms']:.2f} ms "
            f"({cell['descriptors']} descriptors, {cell['runs']} runs)"
        )
        cells.append(cell)
        if partial is not None:
            with partial.open("a") as lines:
                lines.write(json.dumps(cell) + "\n")
    return cells


def _meta(config: ReadConfig, torch: Any) -> dict[str, Any]:
    cuda = config.device == "cuda"
    return {
        "config": asdict(config),
        "num_blocks": config.num_blocks,
        "chunk_bytes": config.chunk_bytes,
        "device_name": torch.cuda.get_device_name(0) if cuda else platform.processor() or "cpu",
        "processes": _processes(config),
        "ucx_env": {k: v for k, v in os.environ.items() if k.startswith("UCX_")},
        "ucx_backend_params": LOOPBACK_UCX_PARAMS if config.loopback else {},
        "torch": torch.__version__,
        "cuda": torch.version.cuda if cuda else None,
        "nixl": _version("nixl"),
        "python": platform.python_version(),
        "vllm_033_form": "/".join(VLLM_033),
    }


def _processes(config: ReadConfig) -> str:
    where = "one device" if config.device == "cuda" else "DRAM"
    if config.loopback:
        return f"one NIXL agent in one process READing from itself (loopback), on {where}"
    return f"reader and owner, two processes on {where}"


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


# -- report ---------------------------------------------------------------------------------


def print_table(report: dict[str, Any], console: Any) -> None:
    from rich.table import Table

    table = Table(title=f"NIXL READ, {report['meta']['device_name']}", title_justify="left")
    columns = ("layout/form", "tokens", "descs", "runs", "median ms", "p90 ms", "GB/s", "us/desc")
    for column in columns:
        table.add_column(column, justify="left" if column == "layout/form" else "right")
    for c in report["cells"]:
        table.add_row(
            f"{c['layout']}/{c['form']}", str(c["tokens"]), str(c["descriptors"]), str(c["runs"]),
            f"{c['median_ms']:.2f}", f"{c['p90_ms']:.2f}", f"{c['gb_per_s']:.1f}",
            f"{c['us_per_descriptor']:.3f}",
        )  # fmt: skip
    console.print(table)
    for key, line in report["fits"].items():
        each = line.get("us_per_descriptor")
        console.print(
            f"fit {key}: {line['read_fixed_ms']:.2f} ms + {line['read_us_per_block']:.2f} us "
            f"per block" + ("" if each is None else f" ({each:.3f} us per descriptor)")
        )


def write(report: dict[str, Any], output: Path) -> list[Path]:
    output.mkdir(parents=True, exist_ok=True)
    data = output / "nixl_read.json"
    data.write_text(json.dumps(report, indent=2))
    ready_plotting()
    import matplotlib.pyplot as plt

    fig, (ax, by_runs) = plt.subplots(1, 2, figsize=(13, 4.8))
    for layout in report["meta"]["config"]["layouts"]:
        for form in report["meta"]["config"]["forms"]:
            rows = [c for c in report["cells"] if (c["layout"], c["form"]) == (layout, form)]
            ax.errorbar(
                [c["tokens"] for c in rows],
                [c["median_ms"] for c in rows],
                yerr=[[0.0] * len(rows), [c["p90_ms"] - c["median_ms"] for c in rows]],
                marker="o", linestyle="-" if layout == "packed" else "--", capsize=3,
                label=f"{layout}/{form}",
            )  # fmt: skip
    ax.set_xlabel("tokens read")
    ax.set_ylabel("READ time, ms (median, bar to p90; log)")
    ax.set_yscale("log")
    ax.set_title(f"NIXL READ, {report['meta']['device_name']}", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    # What a READ costs is its runs: every cell, by its runs of consecutive ids.
    for layout in report["meta"]["config"]["layouts"]:
        rows = [c for c in report["cells"] if c["layout"] == layout]
        by_runs.scatter(
            [c["runs"] for c in rows], [c["median_ms"] for c in rows], label=layout,
            marker="o" if layout == "packed" else "s", alpha=0.8,
        )  # fmt: skip
    by_runs.set_xscale("log")
    by_runs.set_yscale("log")
    by_runs.set_xlabel("runs of consecutive block ids (both sides)")
    by_runs.set_ylabel("READ time, ms (median; log)")
    by_runs.set_title(report["meta"]["processes"], fontsize=9)
    by_runs.grid(alpha=0.3)
    by_runs.legend(fontsize=8)
    return [data, save_figure(fig, output / "nixl_read.png")]


def tokens_list(value: str) -> tuple[int, ...]:
    """``--tokens``: comma-separated whole numbers, a ``k`` suffix meaning 1024."""
    out = []
    for part in (p.strip().lower() for p in value.split(",") if p.strip()):
        scale = 1024 if part.endswith("k") else 1
        number = part.removesuffix("k")
        if not number.isdigit():
            raise ValueError(f"token count {part!r} is not a whole number (like 2048 or 2k)")
        out.append(int(number) * scale)
    return tuple(out)


# -- without the kvbroker CLI ---------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m kvbroker_tools.bench.nixl_read``: the same bench where only torch, nixl, numpy,
    rich and matplotlib are installed (a GPU machine without kvbroker's other dependencies);
    ``kvbroker bench nixl-read --help`` says what each option means."""
    import argparse
    import sys

    from rich.console import Console

    from kvbroker_tools.bench.nixl_layout import parse_shapes

    defaults = ReadConfig()
    parser = argparse.ArgumentParser(prog="python -m kvbroker_tools.bench.nixl_read")
    parser.add_argument("--output", type=Path, default=Path("results/nixl-read"))
    parser.add_argument("--device", default=defaults.device)
    parser.add_argument("--tokens", default="2k,4k,8k,16k,24k")
    parser.add_argument("--layouts", default=",".join(defaults.layouts))
    parser.add_argument("--forms", default=",".join(defaults.forms))
    for name in ("layers", "kv_heads", "head_dim", "block_size", "warmup", "repeats", "seed"):
        parser.add_argument(
            f"--{name.replace('_', '-')}", type=int, default=getattr(defaults, name)
        )
    parser.add_argument("--loopback", action="store_true")
    parser.add_argument("--shapes", default="")
    args = parser.parse_args(argv)
    console = Console()
    try:
        config = ReadConfig(
            device=args.device,
            tokens=tokens_list(args.tokens),
            layouts=tuple(n.strip() for n in args.layouts.split(",") if n.strip()),
            forms=tuple(n.strip() for n in args.forms.split(",") if n.strip()),
            layers=args.layers,
            kv_heads=args.kv_heads,
            head_dim=args.head_dim,
            block_size=args.block_size,
            warmup=args.warmup,
            repeats=args.repeats,
            seed=args.seed,
            loopback=args.loopback,
            shapes=parse_shapes(args.shapes),
        )
    except ValueError as error:
        console.print(f"error: {error}", style="red", markup=False)
        return 2
    try:
        report = run_reads(
            config, lambda line: console.print(f"· {line}", markup=False), args.output
        )
    except (ValueError, RuntimeError, TimeoutError) as error:
        console.print(f"error: {error}", style="red", markup=False)
        return 1
    print_table(report, console)
    console.print(f"written: {', '.join(str(p) for p in write(report, args.output))}", markup=False)
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
