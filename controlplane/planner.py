"""Each turn on its fastest path: the cost model that chooses how a turn's prompt gets its KV.

Three paths (``registry_pb2.TurnPath``):

- ``DECODE_LOCAL``: the turn goes straight to the decode node D that holds the conversation;
  D's prefix cache already has the retained tokens, so it computes only the new suffix and
  decodes. No KV moves. It costs D compute that its running decodes wait for, so it is
  capped (``max_local_prefill_tokens``): a bulk suffix never stalls a decode node.
- ``READ``: the prefill node P checks the lease, reads the retained blocks from D over NIXL,
  computes the suffix, and D reads the suffix's KV back from P to decode.
- ``RECOMPUTE``: P computes the whole prompt; D reads all of its KV from P.

Estimated time to first token of each, from the turn (retained and new tokens) and the two
nodes' ``Costs`` (measured by ``kvbroker calibrate``, defaults until then) and load:

    prefill(new, context) = fixed + new * per_token + new * context * per_token_context
    read(blocks)          = read_fixed + blocks * read_per_block

    DECODE_LOCAL = prefill_D(new, retained)                         * load_D
    READ         = lease_check + read_P(retained blocks) + prefill_P(new, retained) * load_P
                   + read_D(new blocks)
    RECOMPUTE    = prefill_P(all, 0) * load_P + read_D(all blocks)

where load = 1 + running requests (an engine shares its compute between what it runs). The
planner takes the cheapest eligible path. The algorithm is here, apart from the registry's
state; ``Hints`` feeds it and acts on its choice.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvbroker.common.costs import Costs
from kvbroker.v1 import registry_pb2

DECODE_LOCAL = registry_pb2.TURN_PATH_DECODE_LOCAL
READ = registry_pb2.TURN_PATH_READ
RECOMPUTE = registry_pb2.TURN_PATH_RECOMPUTE


@dataclass(frozen=True)
class PlannerConfig:
    # The longest suffix a decode node computes itself: its running decodes wait for it, so
    # this bounds the stall it adds to their inter-token latency.
    max_local_prefill_tokens: int = 2048
    # vLLM's kv_recompute_threshold: a read of fewer remote tokens is not worth it.
    min_read_tokens: int = 64
    # The lease check P makes before a read (a round trip to the registry through its sidecar).
    lease_check_ms: float = 5.0


@dataclass(frozen=True, slots=True)
class TurnRequest:
    """What the router says of a turn: its estimates of the prompt (0: not known), and a path
    it asks for (UNSPECIFIED: the planner's choice)."""

    prompt_tokens: int = 0
    new_tokens: int = 0
    wanted: registry_pb2.TurnPath = registry_pb2.TURN_PATH_UNSPECIFIED

    @classmethod
    def of(cls, request: registry_pb2.GetRoutingHintRequest) -> TurnRequest:
        return cls(request.prompt_tokens, request.new_tokens, request.path)

    def new_after(self, retained_tokens: int) -> int | None:
        """The suffix beyond ``retained_tokens``: the router's own estimate of it, else its
        estimate of the whole prompt less what is retained; None when neither is known."""
        if self.new_tokens:
            return self.new_tokens
        if self.prompt_tokens:
            return max(self.prompt_tokens - retained_tokens, 1)
        return None


UNSAID = TurnRequest()


@dataclass(frozen=True, slots=True)
class Turn:
    """What the planner knows of one turn."""

    retained_tokens: int  # in the holder's cache under the conversation's lease
    new_tokens: int  # the prompt beyond them
    block_size: int
    prefill_running: int  # requests the prefill node runs (or queues) now
    decode_running: int  # requests the holder runs (or queues) now
    # Whether the turn's decode node is the holder (it is unless the holder is draining).
    holder_decodes: bool = True

    def blocks(self, tokens: int) -> int:
        return -(-tokens // max(self.block_size, 1))


@dataclass(frozen=True, slots=True)
class Estimate:
    path: registry_pb2.TurnPath
    ttft_ms: float
    # Empty when the path can be taken.
    not_eligible: str = ""


def estimates(turn: Turn, prefill: Costs, decode: Costs, config: PlannerConfig) -> list[Estimate]:
    """Each path's estimated time to first token, cheapest first among the eligible."""
    new, retained = turn.new_tokens, turn.retained_tokens
    load_p, load_d = 1 + turn.prefill_running, 1 + turn.decode_running
    local = decode.prefill_ms(new, retained) * load_d
    read = (
        config.lease_check_ms
        + prefill.read_ms(turn.blocks(retained))
        + prefill.prefill_ms(new, retained) * load_p
        + decode.read_ms(turn.blocks(new))
    )
    recompute = prefill.prefill_ms(new + retained, 0) * load_p + decode.read_ms(
        turn.blocks(new + retained)
    )
    found = [
        Estimate(DECODE_LOCAL, local, _local_refusal(turn, config)),
        Estimate(
            READ,
            read,
            ""
            if retained >= config.min_read_tokens
            else f"{retained} retained tokens are under the read threshold of "
            f"{config.min_read_tokens}",
        ),
        Estimate(RECOMPUTE, recompute),
    ]
    return sorted(found, key=lambda e: (bool(e.not_eligible), e.ttft_ms))


def _local_refusal(turn: Turn, config: PlannerConfig) -> str:
    if not turn.holder_decodes:
        return "the holder is not this turn's decode node"
    if turn.new_tokens > config.max_local_prefill_tokens:
        return (
            f"a {turn.new_tokens}-token suffix is over the decode node's local limit of "
            f"{config.max_local_prefill_tokens}"
        )
    return ""


def choose(
    found: list[Estimate], wanted: registry_pb2.TurnPath = registry_pb2.TURN_PATH_UNSPECIFIED
) -> registry_pb2.TurnPath:
    """``wanted`` when it is eligible, else the cheapest eligible path (RECOMPUTE always is)."""
    eligible = [e.path for e in found if not e.not_eligible]
    return wanted if wanted in eligible else eligible[0]
