"""The two processes of ``kvbroker bench nixl-read``: the owner D, whose KV cache the reader P
pulls from, each with its cache registered with a NIXL agent on UCX (``bench/nixl_read.py``
runs them and reports); or, in loopback mode, one agent holding both caches and READing from
itself (:func:`loopback_reader`)."""

from __future__ import annotations

import statistics
import time
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from kvbroker.common.rules.fragmentation import paired_runs
from kvbroker_tools.bench.nixl_layout import (
    CHECKSUM_MODULUS,
    POISON,
    REGIONS_PER_LAYER,
    RUNS,
    ReadConfig,
    chunk_ids,
    desc_ids,
    per_block_descs,
    regions,
    run_ids,
    span_descs,
    strided_descs,
)
from kvbroker_tools.bench.stats import quantile

# Loopback: UCX's GPU transports within one process (the recipe of issue 35: without them one
# GPU's UCX emulates the READ over TCP), set before the agent's UCX backend starts.
LOOPBACK_ENV = {"UCX_TLS": "cuda_copy,cuda_ipc,self,sm", "UCX_CUDA_IPC_ENABLE_SAME_PROCESS": "y"}
# And the backend's own option: no error handling endpoints, which cuda_copy lacks.
LOOPBACK_UCX_PARAMS = {"ucx_error_handling_mode": "none"}


def new_agent(name: str, loopback: bool) -> Any:
    """A NIXL agent with the UCX backend: as the connector makes it, or for loopback."""
    from nixl._api import nixl_agent, nixl_agent_config

    if not loopback:
        return nixl_agent(name, nixl_agent_config(backends=["UCX"]))
    agent = nixl_agent(name, nixl_agent_config(backends=[]))
    agent.create_backend("UCX", dict(LOOPBACK_UCX_PARAMS))
    return agent


class Cache:
    """One process's KV cache: a random-filled byte tensor per layer (never zeros: they would
    hide a transfer that moved nothing), registered with a NIXL agent on UCX."""

    def __init__(self, config: ReadConfig, name: str, seed: int, agent: Any = None) -> None:
        import torch

        self.torch = torch
        self.config = config
        cuda = config.device == "cuda"
        self.device = torch.device("cuda", 0) if cuda else torch.device("cpu")
        self.mem_type = "VRAM" if cuda else "DRAM"
        self.device_id = 0
        generator = torch.Generator(device=self.device)
        generator.manual_seed(seed)
        words = config.num_blocks * 2 * config.chunk_bytes // 4
        self.layers = [
            torch.randint(
                -(2**31),
                2**31 - 1,
                (words,),
                dtype=torch.int32,
                device=self.device,
                generator=generator,
            )
            for _ in range(config.layers)
        ]
        self.bases = [int(layer.data_ptr()) for layer in self.layers]
        self.agent = agent if agent is not None else new_agent(name, config.loopback)
        self.agent.register_memory([layer.view(torch.uint8) for layer in self.layers])
        weights = torch.arange(config.chunk_bytes // 4, dtype=torch.int64, device=self.device)
        self.weights = weights % CHECKSUM_MODULUS + 1

    def chunks(self, layer: int) -> Any:
        return self.layers[layer].view(-1, self.config.chunk_bytes // 4)

    def sums(self, layer: int, chunks: Any | None = None) -> Any:
        """Weighted checksums of a layer's chunks (all when ``chunks`` is None), as numpy."""
        words = self.chunks(layer)
        if chunks is not None:
            words = words[self.torch.as_tensor(chunks, device=self.device)]
        return (words.to(self.torch.int64) * self.weights).sum(dim=1).cpu().numpy()

    def poison(self, chunks: Any) -> None:
        index = self.torch.as_tensor(chunks, device=self.device)
        for layer in range(self.config.layers):
            self.chunks(layer)[index] = POISON
        self.sync()

    def sync(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize()


def serve_owner(config: ReadConfig, conn: Connection) -> None:
    """D: allocates and registers its cache, hands P what a handshake would (NIXL metadata,
    region addresses) plus its checksums, and keeps the cache alive until told to stop."""
    try:
        cache = Cache(config, "owner", config.seed + 1)
        conn.send(
            {
                "metadata": cache.agent.get_agent_metadata(),
                "bases": cache.bases,
                "device_id": cache.device_id,
                "sums": np.stack([cache.sums(layer) for layer in range(config.layers)]),
            }
        )
    except Exception as error:  # handed to P, which reports it as its own failure
        conn.send({"error": f"{type(error).__name__}: {error}"})
        return
    conn.recv()


def receive(conn: Connection, owner: Any, timeout_s: float) -> dict[str, Any]:
    if not conn.poll(timeout_s):
        raise TimeoutError(f"the owner process sent nothing in {timeout_s:.0f} s")
    try:
        hello: dict[str, Any] = conn.recv()
    except EOFError:
        raise RuntimeError(f"the owner process died (exit code {owner.exitcode})") from None
    if "error" in hello:
        raise RuntimeError(f"the owner process failed: {hello['error']}")
    return hello


def loopback_reader(config: ReadConfig) -> Reader:
    """One agent with both caches registered, READing from the source into the destination:
    the hello a handshake would bring comes from the source cache in this process."""
    source = Cache(config, "loopback", config.seed + 1)
    destination = Cache(config, "loopback", config.seed + 2, agent=source.agent)
    hello = {
        "metadata": None,
        "bases": source.bases,
        "device_id": source.device_id,
        "sums": np.stack([source.sums(layer) for layer in range(config.layers)]),
    }
    reader = Reader(config, destination, hello)
    reader.source = source  # its memory is READ from: it lives as long as the reader
    return reader


class Reader:
    """P: prepares every layout's descriptor lists once (as the connector does at its
    handshake) and times READs from D (from its own agent when ``hello`` has no metadata:
    loopback)."""

    def __init__(self, config: ReadConfig, cache: Cache, hello: dict[str, Any]) -> None:
        self.config = config
        self.cache = cache
        self.source: Cache | None = None  # loopback: the cache READ from, in this process
        self.agent = cache.agent
        metadata = hello["metadata"]
        self.remote = self.agent.name if metadata is None else self.agent.add_remote_agent(metadata)
        self.remote_bases: list[int] = hello["bases"]
        self.remote_device: int = hello["device_id"]
        self.remote_sums: Any = hello["sums"]
        self.rng = np.random.default_rng(config.seed)
        self.prepared: dict[tuple[str, str], tuple[Any, Any]] = {}
        self.prep_ms: dict[str, float] = {}
        for layout in config.layouts:
            local = regions(config, layout, cache.bases)
            remote = regions(config, layout, self.remote_bases)
            for kind, build in (("per-block", per_block_descs), ("strided", strided_descs)):
                started = time.perf_counter()
                self.prepared[layout, kind] = (
                    self._prep("NIXL_INIT_AGENT", build(local, config.num_blocks, 0)),
                    self._prep(self.remote, build(remote, config.num_blocks, self.remote_device)),
                )
                self.prep_ms[f"{layout}/{kind}"] = (time.perf_counter() - started) * 1e3

    def _prep(self, agent: str, descs: Any) -> Any:
        return self.agent.prep_xfer_dlist(agent, descs, mem_type=self.cache.mem_type)

    def _block_ids(self, form: str, blocks: int, runs: int | None = None) -> tuple[Any, Any]:
        """Source (D) and destination (P) block ids, fresh for every READ."""
        nb = self.config.num_blocks
        if form == RUNS:
            assert runs is not None
            return run_ids(self.rng, nb, blocks, runs)
        if form in ("scattered", "strided"):
            # Random ids rarely abut, and the ones that do are what a fragmented cache has.
            return (
                self.rng.choice(nb, blocks, replace=False).astype(np.int64),
                self.rng.choice(nb, blocks, replace=False).astype(np.int64),
            )
        starts = self.rng.integers(0, nb - blocks + 1, size=2)
        return tuple(np.arange(s, s + blocks, dtype=np.int64) for s in starts)  # type: ignore[return-value]

    def _handles(
        self, layout: str, form: str, src: Any, dst: Any
    ) -> tuple[Any, Any, Any, Any, list[Any]]:
        """(local list, local ids, remote list, remote ids, lists to release afterwards)."""
        count = REGIONS_PER_LAYER[layout] * self.config.layers
        if form == "contiguous":
            local = self._prep(
                "NIXL_INIT_AGENT",
                span_descs(
                    regions(self.config, layout, self.cache.bases), int(dst[0]), len(dst), 0
                ),
            )
            remote = self._prep(
                self.remote,
                span_descs(
                    regions(self.config, layout, self.remote_bases), int(src[0]), len(src),
                    self.remote_device,
                ),
            )  # fmt: skip
            ids = np.arange(count, dtype=np.int32)
            return local, ids, remote, ids, [local, remote]
        local, remote = self.prepared[layout, "strided" if form == "strided" else "per-block"]
        # The "runs" form issues per-block descriptors, as "scattered" and "adjacent" do.
        nb = self.config.num_blocks
        return local, desc_ids(count, nb, dst), remote, desc_ids(count, nb, src), []

    def _read(
        self, local: Any, local_ids: Any, remote: Any, remote_ids: Any
    ) -> tuple[float, float]:
        """One READ as the connector issues it: (ms to DONE, ms of which making the request)."""
        started = time.perf_counter()
        handle = self.agent.make_prepped_xfer("READ", local, local_ids, remote, remote_ids)
        made = time.perf_counter()
        state = self.agent.transfer(handle)
        while state != "DONE":
            if state == "ERR":
                raise RuntimeError("NIXL reported the READ as failed")
            if time.perf_counter() - started > self.config.timeout_s:
                raise TimeoutError(f"a READ took over {self.config.timeout_s:.0f} s")
            state = self.agent.check_xfer_state(handle)
        done = time.perf_counter()
        self.agent.release_xfer_handle(handle)
        return (done - started) * 1e3, (made - started) * 1e3

    def cell(
        self, layout: str, form: str, tokens: int, shape_runs: int | None = None
    ) -> dict[str, Any]:
        """One point: ``warmup`` + ``repeats`` READs of ``tokens``, each with fresh ids of
        ``form`` (``runs``: in ``shape_runs`` runs on both sides)."""
        config = self.config
        blocks = config.blocks(tokens)
        times: list[float] = []
        making: list[float] = []
        paired: list[int] = []
        runs = config.warmup + config.repeats
        for run in range(runs):
            src, dst = self._block_ids(form, blocks, shape_runs)
            paired.append(paired_runs(src.tolist(), dst.tolist()))
            local, local_ids, remote, remote_ids, temporary = self._handles(layout, form, src, dst)
            checked = run == runs - 1
            if checked:
                self.cache.poison(chunk_ids(layout, config.num_blocks, dst))
            total_ms, make_ms = self._read(local, local_ids, remote, remote_ids)
            if checked:
                self._check(layout, form, tokens, src, dst)
            for handle in temporary:
                self.agent.release_dlist_handle(handle)
            if run >= config.warmup:
                times.append(total_ms)
                making.append(make_ms)
        descriptors = len(local_ids)
        nbytes = blocks * config.layers * 2 * config.chunk_bytes
        median = statistics.median(times)
        return {
            "layout": layout,
            "form": form,
            "tokens": tokens,
            "blocks": blocks,
            "descriptors": descriptors,
            # Runs of consecutive ids on both sides (NIXL merges each into one descriptor per
            # region), the median over the READs.
            "runs": int(statistics.median(paired)),
            "bytes": nbytes,
            "median_ms": median,
            "p90_ms": quantile(times, 0.9),
            "min_ms": min(times),
            "make_median_ms": statistics.median(making),
            "gb_per_s": nbytes / median / 1e6,
            "us_per_descriptor": median * 1e3 / descriptors,
            "times_ms": times,
        }

    def _check(self, layout: str, form: str, tokens: int, src: Any, dst: Any) -> None:
        """The READ's destination holds D's source bytes, chunk for chunk."""
        self.cache.sync()
        nb = self.config.num_blocks
        src_chunks = chunk_ids(layout, nb, src)
        dst_chunks = chunk_ids(layout, nb, dst)
        for layer in range(self.config.layers):
            got = self.cache.sums(layer, dst_chunks)
            if not np.array_equal(got, self.remote_sums[layer][src_chunks]):
                raise RuntimeError(
                    f"the {layout}/{form} READ of {tokens} tokens delivered wrong bytes "
                    f"(layer {layer})"
                )
