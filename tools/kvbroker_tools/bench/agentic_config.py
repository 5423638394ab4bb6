"""What each arm of `kvbroker bench agentic` is and the stack it runs on, and the trace they
all replay, time-compressed.

Apart from the run (``kvbroker_tools.bench.agentic``) because all of it is settled before any stack
starts: the unit tests check the arms' stacks and the compression without one, and the report
records these settings beside the figures.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from kvbroker_tools.bench.retention import Conversation, Gap, TraceConfig, make_trace
from kvbroker_tools.stack import StackConfig

# The forks' stack (``stack_config``), and the arms that run on it: with session ids (reuse
# by content) and without.
FORKS_STACK = "forks"
FORK_ARMS = ("reuse-off", "kvbroker")
# vLLM's default decoder_kv_blocks_ttl, seconds; the fixed-ttl arm holds it, time-compressed.
VLLM_TTL_S = 480.0
# The compressed cap never goes below this: the stall it causes must stay visible.
MIN_FIXED_CAP_S = 20


def fixed_ttl_registry_flags(cap_s: int) -> tuple[str, ...]:
    """The fixed-ttl arm's registry: every lease lives for the cap; nothing is learned."""
    return ("--lease-ttl", str(cap_s), "--no-learn-idle-ttl")


# The fixed-ttl arm's connector: no release under pressure, no retention budget.
FIXED_TTL_CONNECTOR: dict[str, object] = {
    "kvbroker_pressure_release": False,
    "kvbroker_retention_max_fraction": 1.0,
}


@dataclass(frozen=True)
class Arm:
    name: str
    # Send a session id (D retains, the next turn may reuse).
    sessions: bool
    # Keep-alives during tool calls and DELETE when the client closes: kvbroker's API.
    keepalive_and_close: bool
    # Which stack serves it: "kvbroker" (defaults) or "fixed-ttl".
    stack: str


ARMS = {
    arm.name: arm
    for arm in (
        Arm("reuse-off", sessions=False, keepalive_and_close=False, stack="kvbroker"),
        Arm("kvbroker", sessions=True, keepalive_and_close=True, stack="kvbroker"),
        Arm("fixed-ttl", sessions=True, keepalive_and_close=False, stack="fixed-ttl"),
    )
}


@dataclass(frozen=True)
class AgenticConfig:
    """Sized for a 2-core machine: all three arms in about 15 minutes, stack starts included;
    the forks in about 4 more (their stack started, both arms)."""

    arms: tuple[str, ...] = tuple(ARMS)
    # 0: no trace (the forks alone).
    sessions: int = 20
    concurrency: int = 6
    mean_turns: float = 6.0
    max_turns: int = 12
    # Trace seconds per wall-clock second.
    time_scale: float = 12.0
    # Longest gap after compression; None: 1.2 x the fixed cap, so some gaps outlast it.
    max_gap_s: float | None = None
    # Blocks of 128 tokens per engine (P gets the same: Stack passes engine_args to both).
    kv_blocks: int = 72
    system_tokens: int = 500
    turn_tokens: int = 250
    max_tokens: int = 16
    stall_ms: float = 2000.0
    # The kvbroker arm's retention budget (kvbroker_retention_max_fraction); None: the
    # connector's default.
    retention_max_fraction: float | None = None
    seed: int = 0
    # Forks (``kvbroker_tools.bench.agentic_forks``), on a stack of their own for the reuse-off and
    # kvbroker arms: sub-agents a parent spawns at once (0: none), and the size of a group of
    # rollouts of one prompt (under 2: none).
    forks: int = 4
    rollouts: int = 4
    model_dir: Path | None = None
    workdir: Path = Path("/tmp/kvbroker-agentic")

    @property
    def fork_arms(self) -> tuple[str, ...]:
        """The arms that run the forks: reuse-off and kvbroker, as selected, when any fork is
        asked for."""
        if not (self.forks or self.rollouts > 1):
            return ()
        return tuple(arm for arm in FORK_ARMS if arm in self.arms)

    @property
    def fixed_cap_s(self) -> int:
        return max(round(VLLM_TTL_S / self.time_scale), MIN_FIXED_CAP_S)

    @property
    def gap_cap_s(self) -> float:
        return self.max_gap_s if self.max_gap_s is not None else 1.2 * self.fixed_cap_s

    def trace(self) -> list[Conversation]:
        full = make_trace(
            TraceConfig(conversations=self.sessions, mean_turns=self.mean_turns, seed=self.seed)
        )
        return compress(full, self.time_scale, self.gap_cap_s, self.max_turns)

    def stack_config(self, stack: str) -> StackConfig:
        if stack == FORKS_STACK:
            # The stack's defaults: reuse by content, not pressure on a small cache.
            return StackConfig(workdir=self.workdir / stack, model_dir=self.model_dir)
        config = StackConfig(
            workdir=self.workdir / stack,
            model_dir=self.model_dir,
            # kv_blocks counts blocks of vLLM's CPU default size, as the recorded runs did.
            block_size=128,
            engine_args=("--num-gpu-blocks-override", str(self.kv_blocks)),
        )
        if stack == "kvbroker" and self.retention_max_fraction is not None:
            budget: dict[str, object] = {
                "kvbroker_retention_max_fraction": self.retention_max_fraction
            }
            config = replace(config, connector_extra=budget)
        if stack == "fixed-ttl":
            config = replace(
                config,
                hard_cap_s=self.fixed_cap_s,
                registry_flags=fixed_ttl_registry_flags(self.fixed_cap_s),
                connector_extra=dict(FIXED_TTL_CONNECTOR),
            )
        return config


def compress(
    trace: Sequence[Conversation], time_scale: float, max_gap_s: float, max_turns: int
) -> list[Conversation]:
    """The trace in wall-clock seconds: gaps divided by ``time_scale`` and capped at
    ``max_gap_s``, conversations cut to ``max_turns`` turns."""
    if time_scale <= 0 or max_gap_s <= 0 or max_turns < 1:
        raise ValueError("need a positive time scale and gap cap, and at least one turn")
    return [
        Conversation(
            tuple(
                Gap(min(gap.seconds / time_scale, max_gap_s), gap.tool_call)
                for gap in conversation.gaps[: max_turns - 1]
            ),
            conversation.closes,
        )
        for conversation in trace
    ]
