"""`kvbroker demo`: the whole stack, then a scripted agent session (system prompt, tool
results, a growing history) run twice on the same servers, with reuse and without, turn by
turn.

The table says what happened, not what was hoped for: each turn's path as the router took it
and the KV the prefill node read from the decode node (nothing, on DECODE_LOCAL and
RECOMPUTE), and the caption explains the paths rather than promising one. It fits a standard
80-column terminal: units live in the headers, so that no cell wraps."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import httpx
from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from kvbroker.bench.multiturn import ContextBuilder
from kvbroker.bench.turns import measured_turn
from kvbroker.stack import Stack

SYSTEM = "You are a coding agent. Tools: read_file, run_tests, search. Notes follow. "
TASKS = [
    ("user", "Fix the failing test in the lease renewal path."),
    ("tool", "read_file(controlplane/registry.py) returned:"),
    ("tool", "run_tests() returned:"),
    ("tool", "search('renew') returned:"),
    ("user", "Good. Now summarise what you changed and why."),
]

# Printed under the table, one line per path, each short enough not to wrap at 80 columns
# (as the table's caption it would wrap at the table's width, narrower).
CAPTION = "\n".join(
    (
        "P: the prefill node, D: the decode node; prefill: P's leg, 0 when none.",
        "ON: with a session id; the registry picks each turn's path:",
        "  READ          P reads the history's KV from D (NIXL), computes the rest",
        "  DECODE_LOCAL  D computes the rest on the history it holds; nothing moves",
        "  RECOMPUTE     P computes the whole prompt (turn 1, or reading won't pay)",
        "OFF: the same turns without a session id, plain P/D: P computes it all.",
    )
)


def _moved(turn: Mapping[str, Any]) -> str:
    """The KV P read from D during ``turn``, or none."""
    read_bytes = float(turn["kv_read_bytes"])
    return f"{read_bytes / 1e6:.1f} MB" if read_bytes else "none"


def show_turns(
    console: Console, on: Sequence[Mapping[str, Any]], off: Sequence[Mapping[str, Any]]
) -> None:
    """The demo's result: the turns' table, then what its paths mean."""
    console.print(turn_table(on, off))
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
            # The router's header, as it came: shown as text, never as markup.
            Text(str(with_reuse["path"])),
            _moved(with_reuse),
            f"{float(with_reuse['prefill_leg_ms']):.0f}",
            f"{float(without['prefill_leg_ms']):.0f}",
            f"{float(with_reuse['ttft_ms']):.0f}",
            f"{float(without['ttft_ms']):.0f}",
        )
    return table


async def run_demo(stack: Stack, console: Console, tool_tokens: int = 700) -> None:
    results: dict[bool, list[dict[str, Any]]] = {}
    async with httpx.AsyncClient(timeout=600) as client:
        for reuse in (True, False):
            builder = ContextBuilder(seed=42)
            messages = [{"role": "system", "content": SYSTEM + builder.text(600)}]
            turns: list[dict[str, Any]] = []
            label = "ON" if reuse else "OFF"
            for number, (kind, text) in enumerate(TASKS, start=1):
                body = text if kind == "user" else f"{text} {builder.text(tool_tokens)}"
                messages.append({"role": "user", "content": body})
                with console.status(f"reuse {label}: turn {number}/{len(TASKS)}"):
                    answer, measured = await measured_turn(
                        client,
                        stack,
                        messages,
                        "demo-agent" if reuse else None,
                        max_tokens=24,
                    )
                messages.append({"role": "assistant", "content": answer})
                turns.append(measured)
            results[reuse] = turns
        await client.delete(f"{stack.router_url}/v1/sessions/demo-agent")
    show_turns(console, results[True], results[False])
