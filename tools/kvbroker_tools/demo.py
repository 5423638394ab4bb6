"""`kvbroker demo`: the whole stack, then a scripted agent session (system prompt, tool
results, a growing history, a sub-agent) run twice on the same servers, with reuse and
without, turn by turn.

The session is written so that each of kvbroker's ways to a turn's KV happens for the reason
it exists, chosen by the planner's own cost model and never forced: the first turn has nothing
retained (RECOMPUTE); a tool result of a few hundred tokens is computed by the decode node on
the history it holds (DECODE_LOCAL); a pasted test log longer than the decode node's local
limit (``PlannerConfig.max_local_prefill_tokens``: a bulk suffix would stall its running
decodes) goes to the prefill node, which reads the history from D over NIXL (READ); and a
sub-agent, a new session id whose prompt is the parent's history and its own task, is matched
by content and reads the parent's KV (a fork).

The table says what happened, not what was hoped for: each turn's path as the router's answer
headers gave it and the KV the prefill node read from the decode node, measured on P; the lines
under it say why, from the same headers and sizes. It fits a standard 80-column terminal:
units live in the headers, so that no cell wraps."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from kvbroker.controlplane.placement.planner import PlannerConfig
from kvbroker_tools.bench.agentic_forks import retention_reported
from kvbroker_tools.bench.multiturn import ContextBuilder
from kvbroker_tools.bench.turns import measured_turn
from kvbroker_tools.stack import Stack

SESSION = "demo-agent"
SUB_AGENT = "demo-agent-reviewer"
SYSTEM = "You are a coding agent. Tools: read_file, run_tests, search. Notes follow. "
# The decode node's local limit at the registry's defaults, which the demo's stack runs.
LOCAL_LIMIT = PlannerConfig.max_local_prefill_tokens


@dataclass(frozen=True)
class Step:
    """One request of the session: who sends it, its text, and the tokens of tool output
    pasted after the text (0: none)."""

    role: str
    text: str
    pasted_tokens: int = 0
    # A sub-agent: its own session id, its prompt the parent's history and this task.
    fork: bool = False


STEPS = (
    Step("user", "Fix the failing test in the lease renewal path."),
    Step("tool", "read_file(controlplane/registry.py) returned:", 700),
    # Longer than the decode node's local limit: the planner sends it to the prefill node.
    Step("tool", "run_tests() returned the whole log:", LOCAL_LIMIT + 500),
    Step("user", "Good. Now summarise what you changed and why."),
    Step("sub-agent", "You are a reviewer sub-agent: check the change above for races.", fork=True),
)

# Printed under the table, one line per path, each short enough not to wrap at 80 columns
# (as the table's caption it would wrap at the table's width, narrower).
CAPTION = "\n".join(
    (
        "P: the prefill node, D: the decode node; prefill: P's leg, 0 when none.",
        "ON: with a session id; the registry picks each turn's path:",
        "  READ          P reads the history's KV from D (NIXL), computes the rest",
        "  DECODE_LOCAL  D computes the rest on the history it holds; nothing moves",
        "  RECOMPUTE     P computes the whole prompt (turn 1, or reading won't pay)",
        "  fork: READ    a new session found its parent's KV by content and read it",
        "OFF: the same turns without a session id, plain P/D: P computes it all.",
    )
)


def _moved(turn: Mapping[str, Any]) -> str:
    """The KV P read from D during ``turn``, or none."""
    read_bytes = float(turn["kv_read_bytes"])
    return f"{read_bytes / 1e6:.1f} MB" if read_bytes else "none"


def is_fork(turn: Mapping[str, Any]) -> bool:
    """A turn the router knew nothing of (MISS: a new session id) whose prefill node still
    read KV from D: matched by content, a fork of a retained conversation."""
    return turn["decision"] == "MISS" and float(turn["kv_read_bytes"]) > 0


def shown_path(turn: Mapping[str, Any]) -> str:
    """The path as it happened: the router's header, or ``fork: READ`` for a fork (the router
    planned a miss; P's engine found the parent's KV and read it)."""
    return "fork: READ" if is_fork(turn) else str(turn["path"])


def why(turn: Mapping[str, Any], new_tokens: int) -> str:
    """Why ``turn`` took its path, from the router's headers and the turn's sizes; at most 64
    characters, so that a numbered line fits 80 columns."""
    decision, path = turn["decision"], turn["path"]
    if turn.get("consistency") == "DEGRADED":
        return f"a DEGRADED hint (the registry away or behind): {decision} {path}"
    if is_fork(turn):
        return "new session id, its prompt a parent's: P read the parent's KV"
    if decision == "MISS":
        return "a new session: nothing is retained yet, P computes it all"
    if decision == "RECOMPUTE":
        return "the registry found no retained KV worth using: P computes it all"
    if path == "DECODE_LOCAL":
        return f"{new_tokens:,} new tokens: D computes them on the history it holds"
    if path == "READ" and new_tokens > LOCAL_LIMIT:
        return f"{new_tokens:,} new tokens, over D's {LOCAL_LIMIT:,} limit: P reads the history"
    if path == "READ":
        return f"{new_tokens:,} new tokens, estimated faster on P: P reads the history"
    return f"the router answered {decision} {path}"


def new_tokens(turns: Sequence[Mapping[str, Any]]) -> list[int]:
    """Each turn's prompt beyond the previous turn's prompt and answer (the whole prompt for
    the first): what was new in it."""
    found, before = [], 0
    for turn in turns:
        found.append(int(turn["input_num_tokens"]) - before)
        before = int(turn["input_num_tokens"]) + int(turn["output_num_tokens"])
    return found


def show_turns(
    console: Console, on: Sequence[Mapping[str, Any]], off: Sequence[Mapping[str, Any]]
) -> None:
    """The demo's result: the turns' table, why each reuse-ON turn took its path, then what
    the paths mean."""
    console.print(turn_table(on, off))
    console.print("why (ON), from the router's x-kvbroker-decision and -path headers:")
    for number, (turn, new) in enumerate(zip(on, new_tokens(on), strict=True), start=1):
        # The reasons are plain text, never markup.
        console.print(Text(f"{number:>4}  {why(turn, new)}"))
    console.print(Text(CAPTION, style="dim"))


def turn_table(on: Sequence[Mapping[str, Any]], off: Sequence[Mapping[str, Any]]) -> Table:
    """One row per turn: the reuse-ON run's path and what it read from D, then P's prefill leg
    and the TTFT of both runs (``measured_turn``'s measurements)."""
    table = Table(
        title="agent session: reuse ON vs OFF, per turn",
        title_justify="left",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
    )
    # Headers at most 7 wide but the path's, which fits DECODE_LOCAL: the table fits 80.
    for name in ("turn", "prompt\ntokens"):
        table.add_column(name, justify="right", no_wrap=True)
    table.add_column("path\n(ON)", no_wrap=True, min_width=len("DECODE_LOCAL"))
    table.add_column("read\nfrom D", justify="right", no_wrap=True)
    for name in ("prefill\nON ms", "prefill\nOFF ms", "TTFT\nON ms", "TTFT\nOFF ms"):
        table.add_column(name, justify="right", no_wrap=True)
    for number, (with_reuse, without) in enumerate(zip(on, off, strict=True), start=1):
        table.add_row(
            str(number),
            str(with_reuse["input_num_tokens"]),
            # From the router's header, as it came: shown as text, never as markup.
            Text(shown_path(with_reuse)),
            _moved(with_reuse),
            f"{float(with_reuse['prefill_leg_ms']):.0f}",
            f"{float(without['prefill_leg_ms']):.0f}",
            f"{float(with_reuse['ttft_ms']):.0f}",
            f"{float(without['ttft_ms']):.0f}",
        )
    return table


async def play(
    client: httpx.AsyncClient, stack: Stack, console: Console, reuse: bool
) -> list[dict[str, Any]]:
    """The session's steps through the router, each measured (``measured_turn``): with
    session ids when ``reuse``, else plain P/D. The same text either way (one seed)."""
    builder = ContextBuilder(seed=42)
    messages = [{"role": "system", "content": SYSTEM + builder.text(600)}]
    turns: list[dict[str, Any]] = []
    label = "ON" if reuse else "OFF"
    for number, step in enumerate(STEPS, start=1):
        body = step.text
        if step.pasted_tokens:
            body += " " + builder.text(step.pasted_tokens)
        # A sub-agent starts from the parent's whole history; it answers no one after.
        prompt = [*messages, {"role": "user", "content": body}]
        session = (SUB_AGENT if step.fork else SESSION) if reuse else None
        if step.fork and reuse:
            # The agent spawns it after reading its answer: by then D's report of the parent's
            # retention (milliseconds) has reached the registry, which matches only that.
            await retention_reported(stack.registry_address, SESSION)
        with console.status(f"reuse {label}: turn {number}/{len(STEPS)}"):
            answer, measured = await measured_turn(client, stack, prompt, session, max_tokens=24)
        turns.append(measured)
        if not step.fork:
            messages = [*prompt, {"role": "assistant", "content": answer}]
            # Tokens per character from the server's own count: pasted sizes come out true.
            builder.learn(sum(len(m["content"]) for m in prompt), measured["input_num_tokens"])
    return turns


async def run_demo(stack: Stack, console: Console) -> None:
    async with httpx.AsyncClient(timeout=600) as client:
        on = await play(client, stack, console, reuse=True)
        off = await play(client, stack, console, reuse=False)
        for session in (SESSION, SUB_AGENT):
            await client.delete(f"{stack.router_url}/v1/sessions/{session}")
    show_turns(console, on, off)
