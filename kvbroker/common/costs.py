"""A node's costs as the planner weighs them (``controlplane/planner.py``): what
``kvbroker calibrate`` measures and the registry stores (``node_pb2.CostProfile``), and the
defaults until a node is calibrated. The planner weighs them scaled by the node's live
correction (``controlplane/cost_correction.py``)."""

from __future__ import annotations

from dataclasses import dataclass

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
        ``read`` (a live correction, ``controlplane/cost_correction.py``)."""
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
