"""A node's costs as the planner weighs them (``controlplane/placement/planner.py``): what
``kvbroker calibrate`` measures and the registry stores (``node_pb2.CostProfile``), and the
defaults until a node is calibrated (:func:`default_costs`, by where the node keeps its KV).
The planner weighs them scaled by the node's live correction
(``controlplane/sessions/cost_correction.py``)."""

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

    def prefill_ms(self, new_tokens: float, context_tokens: float) -> float:
        return (
            self.prefill_fixed_ms
            + new_tokens * self.prefill_us_per_token / 1e3
            + new_tokens * context_tokens * self.prefill_ns_per_token_context / 1e6
        )

    def read_ms(self, blocks: float) -> float:
        return self.read_fixed_ms + blocks * self.read_us_per_block / 1e3

    def scaled(self, prefill: float, read: float) -> Costs:
        """These costs with the prefill figures times ``prefill`` and the read figures times
        ``read`` (a live correction, ``controlplane/sessions/cost_correction.py``)."""
        return Costs(
            self.prefill_fixed_ms * prefill,
            self.prefill_us_per_token * prefill,
            self.prefill_ns_per_token_context * prefill,
            self.read_fixed_ms * read,
            self.read_us_per_block * read,
        )

    @classmethod
    def of(cls, profile: node_pb2.CostProfile) -> Costs:
        return cls(
            profile.prefill_fixed_ms,
            profile.prefill_us_per_token,
            profile.prefill_ns_per_token_context,
            profile.read_fixed_ms,
            profile.read_us_per_block,
        )

    def to_proto(self, into: node_pb2.CostProfile) -> None:
        into.prefill_fixed_ms = self.prefill_fixed_ms
        into.prefill_us_per_token = self.prefill_us_per_token
        into.prefill_ns_per_token_context = self.prefill_ns_per_token_context
        into.read_fixed_ms = self.read_fixed_ms
        into.read_us_per_block = self.read_us_per_block


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


# A READ between GPU engines, from issue 27's H200 pair (docs/gpu-transfer.md): 24k tokens
# (1536 blocks) of a 32B-class model (64 layers) in 767 ms with vLLM 0.32's per-block
# descriptors, two a layer (K and V), against 24 ms with one descriptor per layer. The bytes
# cost 24 ms over the 1536 blocks; each descriptor the rest over 1536 x 128 descriptors.
# vLLM 0.33's packed cache issues one descriptor per layer and block (its strided lists are
# prepared once and change nothing per READ), so a block costs 64 descriptors and its bytes.
# `kvbroker bench nixl-read` on the one-GPU machine lent here could not replace these: its UCX
# had no CUDA IPC and emulated the READ over TCP loopback (docs/gpu-transfer.md).
_H200_BLOCKS = 1536
_H200_PER_BLOCK_MS = 767.0
_H200_CONTIGUOUS_MS = 24.0
_SPLIT_DESCRIPTORS_PER_BLOCK = 128
_PACKED_DESCRIPTORS_PER_BLOCK = 64
_GPU_US_PER_DESCRIPTOR = (
    1e3 * (_H200_PER_BLOCK_MS - _H200_CONTIGUOUS_MS) / (_H200_BLOCKS * _SPLIT_DESCRIPTORS_PER_BLOCK)
)
_GPU_BYTES_US_PER_BLOCK = 1e3 * _H200_CONTIGUOUS_MS / _H200_BLOCKS

# Until a GPU fleet is calibrated. Only the READ figures are GPU figures: the prefill ones
# stay the CPU defaults, which no GPU measurement here replaced (calibration measures both).
# The fixed part of a READ on a warm NIXL connection (making and posting the request, its
# completion) was not separated by any measurement: 1 ms, which errs toward recomputing the
# smallest suffixes.
GPU_COSTS = replace(
    DEFAULT_COSTS,
    read_fixed_ms=1.0,
    read_us_per_block=_PACKED_DESCRIPTORS_PER_BLOCK * _GPU_US_PER_DESCRIPTOR
    + _GPU_BYTES_US_PER_BLOCK,
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
