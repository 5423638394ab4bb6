"""A node's costs as the planner weighs them (``controlplane/placement/planner.py``): what
``kvbroker calibrate`` measures and the registry stores (``node_pb2.CostProfile``), and the
defaults until a node is calibrated (:func:`default_costs`, by where the node keeps its KV).
The planner weighs them scaled by the node's live correction
(``controlplane/sessions/cost_correction.py``).

A READ costs ``fixed + runs x per_run + blocks x per_block``: on a GPU what a READ costs is
its descriptors, one per region for each run of consecutive block ids
(``kvbroker.common.rules.fragmentation``), at about 8 µs each whatever their bytes, and the
bytes themselves at over 1 TB/s (``per_block``); on the CPU engines the bytes dominate and the
calibrated per-block figure covers both (``per_run`` 0)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import StrEnum

from kvbroker.v1 import node_pb2


@dataclass(frozen=True, slots=True)
class Costs:
    """One node's cost figures (``node_pb2.CostProfile`` inside the registry)."""

    prefill_fixed_ms: float
    prefill_us_per_token: float
    prefill_ns_per_token_context: float
    read_fixed_ms: float
    read_us_per_block: float
    # Per run of consecutive block ids (0: the per-block figure covers the descriptors).
    read_us_per_run: float = 0.0

    def prefill_ms(self, new_tokens: float, context_tokens: float) -> float:
        return (
            self.prefill_fixed_ms
            + new_tokens * self.prefill_us_per_token / 1e3
            + new_tokens * context_tokens * self.prefill_ns_per_token_context / 1e6
        )

    def read_ms(self, blocks: float, runs: float | None = None) -> float:
        """A READ of ``blocks`` in ``runs`` runs of consecutive ids (None: not known, priced as
        scattered, every block its own run)."""
        runs = blocks if runs is None else min(runs, blocks)
        return (
            self.read_fixed_ms
            + blocks * self.read_us_per_block / 1e3
            + runs * self.read_us_per_run / 1e3
        )

    def scaled(self, prefill: float, read: float) -> Costs:
        """These costs with the prefill figures times ``prefill`` and the read figures times
        ``read`` (a live correction, ``controlplane/sessions/cost_correction.py``)."""
        return Costs(
            self.prefill_fixed_ms * prefill,
            self.prefill_us_per_token * prefill,
            self.prefill_ns_per_token_context * prefill,
            self.read_fixed_ms * read,
            self.read_us_per_block * read,
            self.read_us_per_run * read,
        )

    @classmethod
    def of(cls, profile: node_pb2.CostProfile) -> Costs:
        return cls(
            profile.prefill_fixed_ms,
            profile.prefill_us_per_token,
            profile.prefill_ns_per_token_context,
            profile.read_fixed_ms,
            profile.read_us_per_block,
            profile.read_us_per_run,
        )

    def to_proto(self, into: node_pb2.CostProfile) -> None:
        into.prefill_fixed_ms = self.prefill_fixed_ms
        into.prefill_us_per_token = self.prefill_us_per_token
        into.prefill_ns_per_token_context = self.prefill_ns_per_token_context
        into.read_fixed_ms = self.read_fixed_ms
        into.read_us_per_block = self.read_us_per_block
        into.read_us_per_run = self.read_us_per_run


# Until a fleet is calibrated: the 20M-parameter test model on one CPU core of this project's
# development machine (float32), which errs toward moving no KV for short suffixes anywhere.
DEFAULT_COSTS = Costs(
    prefill_fixed_ms=25.0,
    prefill_us_per_token=450.0,
    prefill_ns_per_token_context=15.0,
    read_fixed_ms=20.0,
    read_us_per_block=400.0,
)


class KvDevice(StrEnum):
    """Where a node's engine keeps its KV cache: a READ between GPUs costs a few microseconds
    a descriptor, one between CPU engines hundreds of microseconds a block."""

    CPU = "cpu"
    CUDA = "cuda"


# A READ between GPU engines, measured on one NVIDIA H200 (docs/gpu-transfer.md, "The H200
# loopback run": `bench nixl-read --loopback`, one NIXL agent READing from itself over UCX
# cuda_copy, 64 layers x 8 KV heads x 128, bf16, 16-token blocks, 4 MiB a block over all
# layers; vLLM 0.33's packed cache, one region per layer, so a run is 64 descriptors).
# Per run: the least-squares slope of 24,576-token READs in 27, 607, 821, 1,175 and 1,445
# runs (15.7 to 720 ms), 516 us (8.1 us a descriptor; issue 35's table gave 7.96). Per block
# (the bytes): the fit of one descriptor per region at 2k, 8k and 24k tokens, 3.34 us.
_H200_US_PER_RUN = 516.5
_H200_US_PER_BLOCK = 3.34

# Until a GPU fleet is calibrated. Only the READ figures are GPU figures: the prefill ones
# stay the CPU defaults, which no GPU measurement here replaced (calibration measures both).
# The fixed part is 0: the fit of the runs puts it below zero (-13 ms), and the smallest READ
# measured (2,048 tokens in one run, 0.70 ms) costs about one run and its bytes.
GPU_COSTS = replace(
    DEFAULT_COSTS,
    read_fixed_ms=0.0,
    read_us_per_block=_H200_US_PER_BLOCK,
    read_us_per_run=_H200_US_PER_RUN,
)


def device_of(value: node_pb2.KvDevice) -> KvDevice | None:
    """A node's ``NodeSpec.kv_device`` (None: not reported)."""
    return _DEVICES.get(value)


_DEVICES = {node_pb2.KV_DEVICE_CPU: KvDevice.CPU, node_pb2.KV_DEVICE_CUDA: KvDevice.CUDA}


def default_costs(device: KvDevice | None) -> Costs:
    """The costs the planner weighs for a node that is not calibrated (a calibration replaces
    them): the GPU figures for a node whose KV is in GPU memory, the CPU ones otherwise and
    for a node that does not say where its KV is."""
    return GPU_COSTS if device is KvDevice.CUDA else DEFAULT_COSTS
