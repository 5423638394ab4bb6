"""The multi-turn sweep: conversations whose context grows through a list of prompt lengths,
with reuse ON and OFF on the same servers in the same run (OFF sends no conversation id, so it
is plain P/D). Writes one JSON record per request, two charts and a summary table.
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

import httpx
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from kvbroker.bench.turns import TurnRecord, measured_turn
from kvbroker.stack import Stack

DEFAULT_LENGTHS = (512, 1024, 2048, 4096, 6144)
FOLLOW_UP_TOKENS = 16


class ContextBuilder:
    """Deterministic agent-like text, grown to a target token count.

    Tokens per character are learned from the server's own prompt counts as turns go by.
    """

    def __init__(self, seed: int) -> None:
        from random import Random

        self._random = Random(seed)
        self.tokens_per_char = 0.3

    def text(self, tokens: int) -> str:
        words = []
        chars = 0
        while chars * self.tokens_per_char < tokens:
            word = "".join(
                self._random.choice("bcdfghjklmnprstvwz") + self._random.choice("aeiou")
                for _ in range(self._random.randint(1, 3))
            )
            words.append(word)
            chars += len(word) + 1
        return " ".join(words)

    def learn(self, chars: int, tokens: int) -> None:
        if chars and tokens:
            self.tokens_per_char = tokens / chars


async def run_sweep(
    stack: Stack,
    output: Path,
    lengths: Sequence[int] = DEFAULT_LENGTHS,
    conversations: int = 3,
    max_tokens: int = 32,
    console: Console | None = None,
) -> list[TurnRecord]:
    console = console or Console()
    records: list[TurnRecord] = []
    total = conversations * 2 * len(lengths)  # progress counts lengths reached
    async with httpx.AsyncClient(timeout=600) as client:
        with Progress(console=console) as progress:
            task = progress.add_task("multi-turn sweep", total=total)
            for index in range(conversations):
                for reuse in (True, False):
                    conversation_id = f"bench-{index}-{'on' if reuse else 'off'}"
                    records += await _conversation(
                        stack, client, conversation_id, index, reuse, lengths, max_tokens
                    )
                    progress.advance(task, len(lengths))
            if any(r.reuse for r in records):
                for index in range(conversations):
                    await client.delete(f"{stack.router_url}/v1/sessions/bench-{index}-on")
    return records


def write_records(records: Sequence[TurnRecord], output: Path) -> Path:
    output.mkdir(parents=True, exist_ok=True)
    path = output / "records.jsonl"
    path.write_text("".join(json.dumps(record.to_json()) + "\n" for record in records))
    return path


async def _conversation(
    stack: Stack,
    client: httpx.AsyncClient,
    conversation_id: str,
    seed: int,
    reuse: bool,
    lengths: Sequence[int],
    max_tokens: int,
) -> list[TurnRecord]:
    """Grows one conversation through ``lengths``. At each length, a *grow* turn brings the
    context near the length (tool output, documents), then a *follow-up* turn adds one short
    question: the follow-up is the measured point, as in the seed's sweep."""
    builder = ContextBuilder(seed)  # same seed ON and OFF: the same conversation
    messages: list[dict[str, str]] = []
    records = []
    context_tokens = 0
    turn = 0
    for target in lengths:
        grow = max(target - context_tokens - 2 * max_tokens - FOLLOW_UP_TOKENS, 16)
        for kind, content in (("grow", builder.text(grow)), ("follow-up", builder.text(16))):
            turn += 1
            messages.append({"role": "user", "content": content})
            answer, measured = await measured_turn(
                client,
                stack,
                messages,
                conversation_id if reuse else None,
                max_tokens,
            )
            messages.append({"role": "assistant", "content": answer})
            builder.learn(
                sum(len(m["content"]) for m in messages[:-1]), measured["input_num_tokens"]
            )
            context_tokens = measured["input_num_tokens"] + measured["output_num_tokens"]
            records.append(
                TurnRecord(
                    conversation_id=conversation_id,
                    turn=turn,
                    kind=kind,
                    reuse=reuse,
                    target_tokens=target,
                    **measured,
                )
            )
    return records


def summarise(records: Sequence[TurnRecord]) -> list[dict[str, float]]:
    """Median figures of the follow-up turns per prompt length, ON and OFF side by side."""
    groups: dict[tuple[int, bool], list[TurnRecord]] = defaultdict(list)
    for record in records:
        if record.kind == "follow-up":
            groups[(record.target_tokens, record.reuse)].append(record)
    rows = []
    for length in sorted({r.target_tokens for r in records}):
        on, off = groups[(length, True)], groups[(length, False)]
        if not on or not off:
            continue

        def median(values: list[float]) -> float:
            return statistics.median(values) if values else float("nan")

        row = {
            "target_tokens": length,
            "input_tokens": median([r.input_num_tokens for r in on]),
            "ttft_on_ms": median([r.ttft_ms for r in on]),
            "ttft_off_ms": median([r.ttft_ms for r in off]),
            "prefill_on_ms": median([r.prefill_leg_ms for r in on]),
            "prefill_off_ms": median([r.prefill_leg_ms for r in off]),
            "kv_read_ms": median([r.kv_read_ms for r in on]),
            "kv_read_mb": median([r.kv_read_bytes / 1e6 for r in on]),
        }
        row["ttft_ratio"] = row["ttft_off_ms"] / row["ttft_on_ms"]
        rows.append(row)
    return rows


def print_table(rows: Sequence[dict[str, float]], console: Console) -> None:
    table = Table(title="multi-turn TTFT, reuse ON vs OFF (medians)", title_justify="left")
    for column in ("prompt", "tokens", "TTFT OFF", "TTFT ON", "OFF/ON", "prefill OFF",
                   "prefill ON", "KV read", "KV MB"):  # fmt: skip
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(
            str(int(row["target_tokens"])),
            f"{row['input_tokens']:.0f}",
            f"{row['ttft_off_ms']:.0f} ms",
            f"{row['ttft_on_ms']:.0f} ms",
            f"{row['ttft_ratio']:.2f}x",
            f"{row['prefill_off_ms']:.0f} ms",
            f"{row['prefill_on_ms']:.0f} ms",
            f"{row['kv_read_ms']:.1f} ms",
            f"{row['kv_read_mb']:.1f}",
        )
    console.print(table)


def plot(rows: Sequence[dict[str, float]], output: Path, title: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    output.mkdir(parents=True, exist_ok=True)
    lengths = [int(r["target_tokens"]) for r in rows]
    ttft = output / "ttft_vs_prompt_length.png"
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot(lengths, [r["ttft_off_ms"] for r in rows], "o-", label="reuse OFF (recompute)")
    ax.plot(lengths, [r["ttft_on_ms"] for r in rows], "o-", label="reuse ON (read from D)")
    ax.set_xlabel("prompt length (tokens)")
    ax.set_ylabel("TTFT, median (ms)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(ttft, dpi=120)
    plt.close(fig)

    bars = output / "prefill_breakdown.png"
    fig, ax = plt.subplots(figsize=(8, 4.2))
    width = 0.38
    positions = range(len(rows))
    off_total = [r["prefill_off_ms"] for r in rows]
    on_read = [r["kv_read_ms"] for r in rows]
    on_compute = [max(r["prefill_on_ms"] - r["kv_read_ms"], 0.0) for r in rows]
    ax.bar([p - width / 2 for p in positions], off_total, width, label="OFF: compute",
           color="#c44e52")  # fmt: skip
    ax.bar([p + width / 2 for p in positions], on_compute, width, label="ON: compute",
           color="#4c72b0")  # fmt: skip
    ax.bar([p + width / 2 for p in positions], on_read, width, bottom=on_compute,
           label="ON: KV transfer from D", color="#55a868")  # fmt: skip
    for position, off, compute, read in zip(positions, off_total, on_compute, on_read, strict=True):
        ax.annotate(f"{off:.0f}", (position - width / 2, off), ha="center", va="bottom", fontsize=8)
        ax.annotate(
            f"{compute + read:.0f}\n(KV {read:.0f})",
            (position + width / 2, compute + read),
            ha="center",
            va="bottom",
            fontsize=8,
        )
    ax.set_xticks(list(positions), [str(n) for n in lengths])
    ax.set_xlabel("prompt length (tokens)")
    ax.set_ylabel("prefill leg, median (ms)")
    ax.set_title("Prefill duration: compute vs KV transfer")
    ax.grid(axis="y", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(bars, dpi=120)
    plt.close(fig)
    return [ttft, bars]
