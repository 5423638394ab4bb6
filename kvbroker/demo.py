"""`kvbroker demo`: the whole stack, then a scripted agent session (system prompt, tool
results, a growing history) run twice on the same servers, with reuse and without, turn by
turn."""

from __future__ import annotations

import httpx
from rich.console import Console
from rich.table import Table

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


async def run_demo(stack: Stack, console: Console, tool_tokens: int = 700) -> None:
    table = Table(title="agent session: reuse ON vs OFF, per turn", title_justify="left")
    for column in ("turn", "context", "decision", "read from D", "P prefill ON", "P prefill OFF",
                   "TTFT ON", "TTFT OFF"):  # fmt: skip
        table.add_column(column, justify="right")
    results: dict[bool, list[dict[str, object]]] = {}
    async with httpx.AsyncClient(timeout=600) as client:
        for reuse in (True, False):
            builder = ContextBuilder(seed=42)
            messages = [{"role": "system", "content": SYSTEM + builder.text(600)}]
            turns: list[dict[str, object]] = []
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
    for number, (on, off) in enumerate(zip(results[True], results[False], strict=True), 1):
        mb = float(on["kv_read_bytes"]) / 1e6  # type: ignore[arg-type]
        read = f"{mb:.1f} MB in {float(on['kv_read_ms']):.0f} ms" if mb else "-"  # type: ignore[arg-type]
        table.add_row(
            str(number),
            f"{on['input_num_tokens']} tok",
            str(on["decision"]),
            read,
            f"{float(on['prefill_leg_ms']):.0f} ms",  # type: ignore[arg-type]
            f"{float(off['prefill_leg_ms']):.0f} ms",  # type: ignore[arg-type]
            f"{float(on['ttft_ms']):.0f} ms",  # type: ignore[arg-type]
            f"{float(off['ttft_ms']):.0f} ms",  # type: ignore[arg-type]
        )
    console.print(table)
    console.print(
        "[dim]ON: the router sends the session id; from turn 2 the prefill node reads the "
        "history's KV from the decode node (NIXL) instead of recomputing it. OFF: the same "
        "conversation without a session id, plain P/D.[/]"
    )
