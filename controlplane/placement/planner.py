"""Each turn on its fastest path: the cost model that chooses how a turn's prompt gets its KV,
and on which prefill node.

Three paths (``registry_pb2.TurnPath``):

- ``DECODE_LOCAL``: the turn goes straight to the decode node D that holds the conversation;
  D's prefix cache already has the retained tokens, so it computes only the new suffix and
  decodes. No KV moves. It costs D compute that its running decodes wait for, so it is
  capped (``max_local_prefill_tokens``): a bulk suffix never stalls a decode node.
- ``READ``: the prefill node P checks the lease, reads the retained blocks from D over NIXL,
  computes the suffix, and D reads the suffix's KV back from P to decode.
- ``RECOMPUTE``: P computes the whole prompt; D reads all of its KV from P.

A fourth source is free: P's own prefix cache. The P that computed the conversation's last
prompt still caches it (vLLM's prefix caching, when the node says it is on), so on the next
turn it reads from D only the retained blocks beyond it (the engine consults its own cache
first) and computes only what lies beyond it. ``cached`` is that prompt's length in whole
blocks, never more than the retained tokens.

Estimated time to first token of each, from the turn (retained and new tokens) and the two
nodes' ``Costs`` (measured by ``kvbroker calibrate``, defaults until then) and load:

    prefill(new, context) = fixed + new * per_token + new * context * per_token_context
    read(blocks, runs)    = read_fixed + blocks * read_per_block + runs * read_per_run

    DECODE_LOCAL = prefill_D(new, retained)                         * load_D
    READ         = lease_check + read_P(retained blocks - cached blocks)
                   + prefill_P(new, retained) * load_P + read_D(new blocks)
    RECOMPUTE    = prefill_P(all - cached, cached) * load_P + read_D(all blocks)

A READ's runs are the stretches of consecutive block ids it pairs on both sides
(``kvbroker.common.rules.fragmentation``): on a GPU they, not the bytes, are what it costs. The
planner knows the source side of the D→P read (the lease's block ids, less the ones P's cache
holds) and not its destination, which P allocates only after the decision: it counts the
source's runs, a lower bound (a run of the READ needs a run on both sides). A lease whose ids
are not known is priced as scattered. The P→D pulls of both paths read blocks P allocates
afresh for the prompt and D for the decode: priced as one run, their lower bound too, alike
for both paths.

where load = 1 + running requests (an engine shares its compute between what it runs) and
all = retained + new. READ and RECOMPUTE are weighed on each candidate prefill node: the
least loaded (``routing.choose``, which every router without a planner uses too) first, then
the ones whose cache holds part of the conversation. The planner takes the cheapest eligible
(path, prefill node); ties keep the earlier candidate, so with no cache anywhere the choice of
P is the least-loaded one, as without a planner. The algorithm is here, apart from the
registry's state; ``Hints`` feeds it and acts on its choice.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvbroker.common.rules.costs import Costs
from kvbroker.common.rules.fragmentation import runs
from kvbroker.v1 import registry_pb2

DECODE_LOCAL = registry_pb2.TURN_PATH_DECODE_LOCAL
READ = registry_pb2.TURN_PATH_READ
RECOMPUTE = registry_pb2.TURN_PATH_RECOMPUTE

NOTHING_RETAINED = "nothing is retained for this conversation"
VERSION_MISMATCH = "the prefill node's vLLM NIXL connector cannot read from the holder's"


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
    # The node a router other than kvbroker's already sent the turn to ("": none).
    on_node_id: str = ""

    @classmethod
    def of(cls, request: registry_pb2.GetRoutingHintRequest) -> TurnRequest:
        return cls(request.prompt_tokens, request.new_tokens, request.path, request.on_node_id)

    def prompt_after(self, retained_tokens: int) -> int | None:
        """The whole prompt: the router's estimate of it, else ``retained_tokens`` and its
        estimate of the suffix; None when neither is known."""
        if self.prompt_tokens:
            return self.prompt_tokens
        if self.new_tokens:
            return retained_tokens + self.new_tokens
        return None

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

    retained_tokens: int  # in the holder's cache under the conversation's lease (0: none)
    new_tokens: int  # the prompt beyond them
    block_size: int
    decode_running: int  # requests the holder runs (or queues) now
    # Whether the turn's decode node is the holder (it is unless the holder is draining).
    holder_decodes: bool = True
    # The holder's block ids of the retained tokens, in order (the lease's handle; empty: not
    # known, and the READ is priced as scattered).
    retained_block_ids: tuple[int, ...] = ()

    def blocks(self, tokens: int) -> int:
        return -(-tokens // max(self.block_size, 1))

    def whole_blocks(self, tokens: int) -> int:
        return tokens // max(self.block_size, 1)

    def read_runs(self, cached_blocks: int) -> int | None:
        """Runs of the retained blocks a READ takes beyond P's ``cached_blocks``: those of the
        source ids, a lower bound of the READ's (None: the ids are not known)."""
        if not self.retained_block_ids:
            return None
        return runs(self.retained_block_ids[cached_blocks:])


@dataclass(frozen=True, slots=True)
class Prefill:
    """A prefill node the turn may go to, as the planner weighs it."""

    node_id: str
    costs: Costs
    running: int  # requests it runs (or queues) now
    # Tokens of this conversation's prompt its own prefix cache holds (0: none, or its engine
    # caches no prefixes).
    cached_tokens: int = 0
    # Whether its NIXL connector can read from the holder's (``routing.can_transfer``).
    reads_holder: bool = True


@dataclass(frozen=True, slots=True)
class Estimate:
    path: registry_pb2.TurnPath
    ttft_ms: float
    # Empty when the path can be taken.
    not_eligible: str = ""
    # The prefill node it is for (empty for DECODE_LOCAL), and the tokens counted from its
    # own cache.
    prefill_node_id: str = ""
    cached_tokens: int = 0


@dataclass(frozen=True, slots=True)
class Plan:
    """The planner's choice, the prefill node the turn goes to (the first candidate when the
    path has no prefill leg), and the estimates behind it, cheapest eligible first."""

    chosen: Estimate
    prefill_node_id: str
    estimates: list[Estimate]

    @property
    def path(self) -> registry_pb2.TurnPath:
        return self.chosen.path


def plan(
    turn: Turn,
    prefills: Sequence[Prefill],
    decode: Costs,
    config: PlannerConfig,
    wanted: registry_pb2.TurnPath = registry_pb2.TURN_PATH_UNSPECIFIED,
) -> Plan:
    """The cheapest eligible (path, prefill node) over ``prefills`` (not empty; the
    least-loaded candidate first, so it wins ties); ``wanted`` when it is eligible, on its
    cheapest prefill node. RECOMPUTE is always eligible."""
    found = [_decode_local(turn, decode, config)]
    for prefill in prefills:
        found += _prefill_legs(turn, prefill, decode, config)
    found.sort(key=_rank)  # stable: among equals the earlier candidate stays first
    eligible = [e for e in found if not e.not_eligible]
    best = next((e for e in eligible if e.path == wanted), None) or _fallback(eligible, wanted)
    return Plan(best, best.prefill_node_id or prefills[0].node_id, found)


def _fallback(eligible: Sequence[Estimate], wanted: registry_pb2.TurnPath) -> Estimate:
    """The path taken when ``wanted`` cannot be: the cheapest, except that asking for READ
    asks for the P/D split (vLLM's own router: read when it is worth it, else P computes),
    so it falls back to RECOMPUTE and not to a prefill on the decode node."""
    if wanted == READ:
        return next(e for e in eligible if e.path == RECOMPUTE)
    return eligible[0]


def _rank(estimate: Estimate) -> tuple[bool, float]:
    return bool(estimate.not_eligible), estimate.ttft_ms


def _decode_local(turn: Turn, decode: Costs, config: PlannerConfig) -> Estimate:
    load_d = 1 + turn.decode_running
    ttft = decode.prefill_ms(turn.new_tokens, turn.retained_tokens) * load_d
    return Estimate(DECODE_LOCAL, ttft, _local_refusal(turn, config))


def _prefill_legs(
    turn: Turn, prefill: Prefill, decode: Costs, config: PlannerConfig
) -> list[Estimate]:
    """READ and RECOMPUTE on one prefill node, counting what its own cache holds."""
    new, retained = turn.new_tokens, turn.retained_tokens
    total = new + retained
    # vLLM caches whole blocks, and computes at least the prompt's last token itself.
    cached_blocks = turn.whole_blocks(min(prefill.cached_tokens, total - 1))
    cached = cached_blocks * turn.block_size
    load_p = 1 + prefill.running
    costs = prefill.costs
    read = (
        config.lease_check_ms
        + costs.read_ms(
            max(turn.blocks(retained) - cached_blocks, 0), turn.read_runs(cached_blocks)
        )
        + costs.prefill_ms(new, retained) * load_p
        + decode.read_ms(turn.blocks(new), 1)
    )
    recompute = costs.prefill_ms(total - cached, cached) * load_p + decode.read_ms(
        turn.blocks(total), 1
    )
    return [
        Estimate(READ, read, _read_refusal(turn, prefill, cached, config), prefill.node_id, cached),
        Estimate(RECOMPUTE, recompute, "", prefill.node_id, cached),
    ]


def _read_refusal(turn: Turn, prefill: Prefill, cached: int, config: PlannerConfig) -> str:
    """As the prefill engine decides (``engine_ext.verdict``): a read must bring at least the
    threshold beyond what its own cache has, between connectors that can transfer."""
    retained = turn.retained_tokens
    if not retained:
        return NOTHING_RETAINED
    if not prefill.reads_holder:
        return VERSION_MISMATCH
    remote = retained - cached
    if remote >= max(config.min_read_tokens, 1):
        return ""
    beyond = " beyond the prefill node's own cache" if cached else ""
    return (
        f"{max(remote, 0)} retained tokens{beyond} are under the read threshold of "
        f"{config.min_read_tokens}"
    )


def _local_refusal(turn: Turn, config: PlannerConfig) -> str:
    if not turn.retained_tokens:
        return NOTHING_RETAINED
    if not turn.holder_decodes:
        return "the holder is not this turn's decode node"
    if turn.new_tokens > config.max_local_prefill_tokens:
        return (
            f"a {turn.new_tokens}-token suffix is over the decode node's local limit of "
            f"{config.max_local_prefill_tokens}"
        )
    return ""
