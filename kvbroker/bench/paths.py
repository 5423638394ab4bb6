"""Each path against the planner: a follow-up's TTFT when the turn is sent on one fixed path
(READ, DECODE_LOCAL, RECOMPUTE) and when the registry's planner chooses, by context length and
by the size of the new suffix (a one-line question, or a bulk tool result).

Every measured follow-up is the second turn of its own conversation (same length, different
text): the first turn was computed by P and retained by D as in real use, so with P's prefix
cache on, P holds that first prompt and nothing of another arm's. Arms take turns at each point
so that drift on a shared machine spreads over all of them.
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from kvbroker.bench.multiturn import ContextBuilder
from kvbroker.bench.turns import TurnRecord, measured_turn
from kvbroker.stack import Stack

ARMS = ("planner", "READ", "DECODE_LOCAL", "RECOMPUTE")
# New suffix sizes, in tokens: a one-line question and a bulk tool result.
SUFFIXES = {"one-line": 16, "bulk": 1500}


@dataclass(frozen=True)
class PathPoint:
    length: int
    suffix: str
    arm: str


async def run_paths(
    stack: Stack,
    lengths: Sequence[int],
    conversations: int,
    max_tokens: int,
    console: Console,
) -> list[tuple[PathPoint, TurnRecord]]:
    results: list[tuple[PathPoint, TurnRecord]] = []
    seed = 0
    total = len(lengths) * len(SUFFIXES) * conversations * len(ARMS)
    async with httpx.AsyncClient(timeout=600) as client:
        with Progress(console=console) as progress:
            task = progress.add_task("paths", total=total)
            for length in lengths:
                for suffix, suffix_tokens in SUFFIXES.items():
                    for repetition in range(conversations):
                        arms = ARMS[repetition % len(ARMS) :] + ARMS[: repetition % len(ARMS)]
                        for arm in arms:
                            seed += 1
                            point = PathPoint(length, suffix, arm)
                            record = await _follow_up(
                                stack, client, point, seed, suffix_tokens, max_tokens
                            )
                            results.append((point, record))
                            progress.advance(task)
    return results


async def _follow_up(
    stack: Stack,
    client: httpx.AsyncClient,
    point: PathPoint,
    seed: int,
    suffix_tokens: int,
    max_tokens: int,
) -> TurnRecord:
    """A conversation of about ``point.length`` tokens, then its measured follow-up."""
    builder = ContextBuilder(seed)
    session = f"paths-{seed}"
    messages = [{"role": "user", "content": builder.text(point.length)}]
    answer, first = await measured_turn(client, stack, messages, session, max_tokens)
    builder.learn(len(messages[0]["content"]), first["input_num_tokens"])
    messages += [
        {"role": "assistant", "content": answer},
        {"role": "user", "content": builder.text(suffix_tokens)},
    ]
    wanted = None if point.arm == "planner" else point.arm
    _, measured = await measured_turn(client, stack, messages, session, max_tokens, wanted)
    await client.delete(f"{stack.router_url}/v1/sessions/{session}")
    return TurnRecord(
        conversation_id=session,
        turn=2,
        kind="follow-up",
        reuse=True,
        target_tokens=point.length,
        **measured,
    )


def summarise(results: Sequence[tuple[PathPoint, TurnRecord]]) -> list[dict[str, object]]:
    """Median TTFT per (length, suffix) and arm, and which paths the planner took."""
    groups: dict[tuple[int, str], dict[str, list[TurnRecord]]] = defaultdict(
        lambda: defaultdict(list)
    )
    for point, record in results:
        groups[(point.length, point.suffix)][point.arm].append(record)
    rows: list[dict[str, object]] = []
    for (length, suffix), arms in sorted(groups.items()):
        row: dict[str, object] = {"length": length, "suffix": suffix}
        for arm, records in arms.items():
            row[f"{arm}_ms"] = statistics.median(r.ttft_ms for r in records)
            row["input_tokens"] = statistics.median(r.input_num_tokens for r in records)
        row["planner_paths"] = sorted({r.path for r in arms.get("planner", [])})
        fixed = [row[f"{a}_ms"] for a in ARMS[1:] if f"{a}_ms" in row]
        best = min(fixed)  # type: ignore[type-var]
        row["best_fixed_ms"] = best
        row["planner_vs_best"] = row["planner_ms"] / best  # type: ignore[operator]
        rows.append(row)
    return rows


def print_table(rows: Sequence[dict[str, object]], console: Console) -> None:
    table = Table(title="follow-up TTFT by path (medians)", title_justify="left")
    for column in ("context", "suffix", "tokens", *ARMS, "planner took", "planner/best"):
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(
            str(row["length"]),
            str(row["suffix"]),
            f"{row['input_tokens']:.0f}",
            *(f"{row[f'{arm}_ms']:.0f} ms" for arm in ARMS),
            ",".join(row["planner_paths"]),  # type: ignore[arg-type]
            f"{row['planner_vs_best']:.2f}x",
        )
    console.print(table)


def write(results: Sequence[tuple[PathPoint, TurnRecord]], rows: list[dict[str, object]],
          output: Path, meta: dict[str, object]) -> None:  # fmt: skip
    output.mkdir(parents=True, exist_ok=True)
    (output / "records.jsonl").write_text(
        "".join(
            json.dumps({"arm": p.arm, "suffix": p.suffix, **r.to_json()}) + "\n" for p, r in results
        )
    )
    (output / "summary.json").write_text(json.dumps({**meta, "rows": rows}, indent=2))


def plot(rows: Sequence[dict[str, object]], output: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    suffixes = list(SUFFIXES)
    fig, axes = plt.subplots(1, len(suffixes), figsize=(11, 4.2), sharey=False)
    for ax, suffix in zip(axes, suffixes, strict=True):
        chosen = [r for r in rows if r["suffix"] == suffix]
        lengths = [int(r["length"]) for r in chosen]  # type: ignore[call-overload]
        for arm, style in zip(ARMS, ("o-", "s--", "^--", "v--"), strict=True):
            ax.plot(lengths, [r[f"{arm}_ms"] for r in chosen], style, label=arm)
        ax.set_title(f"{suffix} follow-up")
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("TTFT, median (ms)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    path = output / "ttft_by_path.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
