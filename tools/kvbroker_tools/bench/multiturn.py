"""The multi-turn benchmark: a follow-up turn's TTFT by the way its KV is got, so that the
registry's planner can be judged against every fixed path and against no reuse at all.

Arms: ``planner`` (the registry chooses), ``read``, ``decode-local`` and ``recompute`` (the
turn asks for that path with ``x-kvbroker-path``; it is taken when eligible, and the path
actually taken is recorded; ``read`` falls back to RECOMPUTE, so it is vLLM's own P/D
router), and ``off`` (no session id: plain P/D, no reuse). Axes: the context length, and the
size of the new suffix (a one-line question or a bulk tool result). The stack runs with P's
own prefix cache on or off (``--prefill-cache``); arms behind other routers: ``routers``.

Fairness, because the arms are compared with one another on a shared, drifting machine:
every measured follow-up is the second turn of its own conversation, and at each point and
repetition every arm gets the same conversation (the same text and token counts) behind an
opening line of its own, so no prefix cache, P's or D's, serves one arm with another's KV.
The first turn is computed by P and retained by D as in real use; with P's cache on, P holds
that first prompt. The arms take turns at each point, in an order rotated per repetition, so
drift hits each alike. The summary gives each arm's median and spread, the planner's ratio
to the best fixed path and to reuse off, and whether the issue's targets hold.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from kvbroker_tools.bench.plotting import ready_plotting, save_figure
from kvbroker_tools.bench.read_shapes import summarise_shapes
from kvbroker_tools.bench.routers import (
    FOREIGN_ARMS,
    router_comparisons,
    router_rows,
    router_targets,
    router_urls,
    sends_session,
)
from kvbroker_tools.bench.stats import quantile, ratio
from kvbroker_tools.bench.turns import TurnRecord, measured_turn
from kvbroker_tools.stack import KVBROKER, Stack

# The path each fixed arm asks for; "planner" asks for none, "off" sends no session id.
FIXED_PATHS = {"read": "READ", "decode-local": "DECODE_LOCAL", "recompute": "RECOMPUTE"}
ARMS = ("planner", *FIXED_PATHS, "off")
# With the arms behind other routers (``bench/routers.py``).
ALL_ARMS = (*ARMS, *FOREIGN_ARMS)
# New suffix sizes, in tokens: a one-line question and a bulk tool result.
SUFFIX_TOKENS = {"one-line": 16, "bulk": 1500}
DEFAULT_LENGTHS = (512, 1024, 2048, 4096, 6144)
# The targets: the planner within 10 % of the best fixed path and never slower than
# reuse off, at every point; for a one-line follow-up at the longest context, TTFT at least
# 1.8x lower than the READ path.
WITHIN_BEST = 1.10
SPEEDUP_OVER_READ = 1.8
# The pause before a follow-up, as a person's or a tool's between turns: D's retention report
# reaches the registry meanwhile, as in real use, so that no follow-up's TTFT includes the
# registry waiting for the previous turn to settle. Every arm pauses alike.
THINK_S = 0.5
# Room for the chat template's tokens and for the error of the learned characters-to-tokens
# ratio: the longest prompt must fit the engines' context.
PROMPT_MARGIN_TOKENS = 256


class ContextBuilder:
    """Deterministic agent-like text, grown to a target token count.

    Tokens per character are learned from the server's own prompt counts as turns go by.
    """

    def __init__(self, seed: int, tokens_per_char: float = 0.3) -> None:
        from random import Random

        self._random = Random(seed)
        self.tokens_per_char = tokens_per_char

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


@dataclass(frozen=True)
class MultiturnConfig:
    lengths: tuple[int, ...] = DEFAULT_LENGTHS
    suffixes: tuple[str, ...] = tuple(SUFFIX_TOKENS)
    arms: tuple[str, ...] = ARMS
    # Each arm twice in each place of the rotated order. On this 2-core machine one sample
    # can be twice another on the same path; a median of ten bears a few such.
    repeats: int = 2 * len(ARMS)
    max_tokens: int = 16
    # Measure the nodes' costs (`kvbroker calibrate`) after the warm-up, as an operator
    # would: otherwise the planner estimates from kvbroker.common.rules.costs' defaults.
    calibrate: bool = False
    suffix_tokens: Mapping[str, int] = field(default_factory=lambda: dict(SUFFIX_TOKENS))

    def __post_init__(self) -> None:
        if not self.arms or any(arm not in ALL_ARMS for arm in self.arms):
            raise ValueError(f"arms {list(self.arms)}: choose from {', '.join(ALL_ARMS)}")
        for name, values in (("arms", self.arms), ("suffixes", self.suffixes),
                             ("lengths", self.lengths)):  # fmt: skip
            if len(set(values)) != len(values):
                raise ValueError(f"{name} {list(values)}: each at most once")
        known = [s for s in SUFFIX_TOKENS if s in self.suffix_tokens]
        if not self.suffixes or any(s not in known for s in self.suffixes):
            raise ValueError(f"suffixes {list(self.suffixes)}: choose from {', '.join(known)}")
        if not self.lengths or min(self.lengths) < 1:
            raise ValueError(f"lengths {list(self.lengths)}: token counts above 0")
        if self.repeats < 1 or self.max_tokens < 1:
            raise ValueError("repeats and max_tokens are at least 1")

    def check_fits(self, max_model_len: int) -> None:
        """Refuses a configuration whose largest follow-up (its prompt, the margin and the
        answers) would not fit the engines' context."""
        suffix = max(self.suffix_tokens[s] for s in self.suffixes)
        longest = max(self.lengths) + suffix + 2 * self.max_tokens + PROMPT_MARGIN_TOKENS
        if longest > max_model_len:
            raise ValueError(
                f"the largest follow-up (~{longest} tokens with answers and a margin) does not "
                f"fit the engines' {max_model_len}: shorten the lengths"
            )


def arm_order(arms: Sequence[str], repetition: int) -> list[str]:
    """The arms rotated by the repetition: over len(arms) repetitions each arm runs in each
    place once, so a slow start or a drift within a point falls on every arm alike."""
    shift = repetition % len(arms)
    return [*arms[shift:], *arms[:shift]]


async def run_multiturn(
    stack: Stack, config: MultiturnConfig, console: Console
) -> list[TurnRecord]:
    """Every turn of the benchmark, openings and measured follow-ups, in the order run."""
    config.check_fits(stack.config.max_model_len)
    records: list[TurnRecord] = []
    points = [(length, suffix) for length in config.lengths for suffix in config.suffixes]
    async with (
        httpx.AsyncClient(timeout=600) as client,
        router_urls(stack, config.arms, stack.config.workdir) as urls,
    ):
        tokens_per_char = await _warm_up(stack, client, config, urls)
        if config.calibrate:
            await _calibrate(stack, console)
        with Progress(console=console) as progress:
            task = progress.add_task("multi-turn", total=len(points) * config.repeats)
            for index, (length, suffix) in enumerate(points):
                for repetition in range(config.repeats):
                    for arm in arm_order(config.arms, repetition):
                        # The same seed for every arm: the same conversation.
                        seed = index * config.repeats + repetition
                        conversation = _Conversation(arm, length, suffix, repetition, seed)
                        records += await conversation.run(
                            stack, client, config, tokens_per_char, urls[arm]
                        )
                    progress.advance(task)
    return records


async def _warm_up(
    stack: Stack, client: httpx.AsyncClient, config: MultiturnConfig, urls: Mapping[str, str]
) -> float:
    """One unrecorded conversation per arm at the shortest length, so that no arm pays the
    engines' first requests on a path; returns the characters-to-tokens ratio the measured
    conversations' text is built with (one ratio for all, so that all arms get the same)."""
    tokens_per_char = ContextBuilder(-1).tokens_per_char
    for arm in config.arms:
        conversation = _Conversation(arm, min(config.lengths), config.suffixes[0], -1, -1)
        (opening, _) = await conversation.run(stack, client, config, tokens_per_char, urls[arm])
        tokens_per_char = opening.input_num_tokens / conversation.opening_chars
    return tokens_per_char


async def _calibrate(stack: Stack, console: Console) -> None:
    """``kvbroker calibrate`` on the stack's registry, its table shown. After the warm-up,
    whose READ turns gave P a read cost of its own."""
    process = await asyncio.create_subprocess_exec(
        KVBROKER,
        "calibrate",
        "--registry",
        stack.registry_address,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        env={**os.environ, **stack.kvbroker_env()},
    )
    out, _ = await process.communicate()
    console.print(out.decode(), end="", markup=False, highlight=False)
    if process.returncode != 0:
        raise RuntimeError(f"kvbroker calibrate failed (exit {process.returncode})")


@dataclass
class _Conversation:
    """One measured sample: an opening turn of about ``length`` tokens, then the follow-up
    with the new suffix, sent on the arm's path."""

    arm: str
    length: int
    suffix: str
    repetition: int
    seed: int
    opening_chars: int = 0

    @property
    def name(self) -> str:
        return f"multiturn-{self.arm}-{self.length}-{self.suffix}-{self.repetition}"

    @property
    def session(self) -> str | None:
        """The session id sent: none for reuse off (plain P/D)."""
        return self.name if sends_session(self.arm) else None

    async def run(
        self,
        stack: Stack,
        client: httpx.AsyncClient,
        config: MultiturnConfig,
        tokens_per_char: float,
        url: str,
    ) -> tuple[TurnRecord, TurnRecord]:
        builder = ContextBuilder(self.seed, tokens_per_char)
        # The arm's own first line (the same length for every arm): its blocks' hashes, and so
        # every later block's, are its own.
        opening = f"Conversation {ALL_ARMS.index(self.arm)}.\n{builder.text(self.length)}"
        self.opening_chars = len(opening)
        messages = [{"role": "user", "content": opening}]
        answer, first = await measured_turn(
            client, stack, messages, self.session, config.max_tokens, base_url=url
        )
        messages += [
            {"role": "assistant", "content": answer},
            {"role": "user", "content": builder.text(config.suffix_tokens[self.suffix])},
        ]
        await asyncio.sleep(THINK_S)
        fixed = FIXED_PATHS.get(self.arm)
        _, follow_up = await measured_turn(
            client, stack, messages, self.session, config.max_tokens, fixed, url
        )
        if self.session is not None:
            await client.delete(f"{stack.router_url}/v1/sessions/{self.session}")
        return self._record("opening", first), self._record("follow-up", follow_up)

    def _record(self, kind: str, measured: dict[str, Any]) -> TurnRecord:
        return TurnRecord(
            conversation_id=self.name,
            kind=kind,
            arm=self.arm,
            suffix=self.suffix,
            repetition=self.repetition,
            target_tokens=self.length,
            **measured,
        )


@dataclass(frozen=True)
class Spread:
    """One arm's follow-up TTFTs at one point: median, quartiles and extremes, in ms."""

    n: int
    median_ms: float
    q1_ms: float
    q3_ms: float
    min_ms: float
    max_ms: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        ordered = sorted(values)
        q1, q3 = (quantile(ordered, q, parts=4) for q in (0.25, 0.75))
        return cls(len(ordered), statistics.median(ordered), q1, q3, ordered[0], ordered[-1])


def targets(row: Mapping[str, Any], longest: bool) -> dict[str, bool | None]:
    """The issue's targets at one point (None where an arm it needs did not run):
    ``within_best`` (planner/best fixed <= WITHIN_BEST), ``not_slower_than_off``
    (planner/off <= 1) and, for a one-line follow-up at the longest context only,
    ``speedup_over_read`` (read/planner >= SPEEDUP_OVER_READ)."""
    best, off, read = row["planner_vs_best"], row["planner_vs_off"], row["read_vs_planner"]
    verdicts: dict[str, bool | None] = {
        "within_best": None if best is None else best <= WITHIN_BEST,
        "not_slower_than_off": None if off is None else off <= 1.0,
    }
    if longest and row["suffix"] == "one-line":
        verdicts["speedup_over_read"] = None if read is None else read >= SPEEDUP_OVER_READ
    return verdicts


def summarise(records: Sequence[TurnRecord]) -> list[dict[str, Any]]:
    """Per (length, suffix): each arm's spread and the paths it took, the best fixed arm, the
    planner's ratios to it and to reuse off, READ's to the planner, and the targets."""
    groups: dict[tuple[int, str], dict[str, list[TurnRecord]]] = defaultdict(
        lambda: defaultdict(list)
    )
    for record in records:
        if record.kind == "follow-up":
            groups[(record.target_tokens, record.suffix)][record.arm].append(record)
    longest = max((length for length, _ in groups), default=0)
    rows: list[dict[str, Any]] = []
    suffix_order = list(SUFFIX_TOKENS)
    for (length, suffix), by_arm in sorted(
        groups.items(), key=lambda item: (suffix_order.index(item[0][1]), item[0][0])
    ):
        arms = {
            arm: {
                **vars(Spread.of([r.ttft_ms for r in chosen])),
                "input_tokens": statistics.median(r.input_num_tokens for r in chosen),
                "paths": dict(Counter(r.path for r in chosen)),
                "read_shapes": summarise_shapes(r.read_shapes for r in chosen),
            }
            for arm in ALL_ARMS
            if (chosen := by_arm.get(arm))
        }
        median = {arm: figures["median_ms"] for arm, figures in arms.items()}
        fixed = [arm for arm in FIXED_PATHS if arm in median]
        best = min(fixed, key=median.__getitem__) if fixed else None
        row: dict[str, Any] = {
            "length": length,
            "suffix": suffix,
            "input_tokens": statistics.median(
                r.input_num_tokens for chosen in by_arm.values() for r in chosen
            ),
            "arms": arms,
            "best_fixed_arm": best,
            "planner_vs_best": ratio(median.get("planner"), median.get(best or "")),
            "planner_vs_off": ratio(median.get("planner"), median.get("off")),
            "read_vs_planner": ratio(median.get("read"), median.get("planner")),
            # Every planner follow-up took the best fixed arm's path: then a gap between the
            # two is no wrong choice, but noise or the cost of planning.
            "planner_took_best_path": best is not None
            and "planner" in arms
            and set(arms["planner"]["paths"]) == {FIXED_PATHS[best]},
            **router_rows(median),
        }
        row["targets"] = {**targets(row, length == longest), **router_targets(row)}
        rows.append(row)
    return rows


def verdict(rows: Sequence[Mapping[str, Any]]) -> dict[str, bool | None]:
    """Each target over every point: True if it held wherever it was measured, None if it
    was measured nowhere."""
    held: dict[str, list[bool]] = defaultdict(list)
    for row in rows:
        for name, value in row["targets"].items():
            if value is not None:
                held[name].append(value)
    names = ["within_best", "not_slower_than_off", "speedup_over_read"]
    names += [name for name in held if name not in names]
    return {name: all(held[name]) if held[name] else None for name in names}


def _mark(value: bool | None) -> str:
    return "-" if value is None else ("yes" if value else "NO")


def _times(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _comparisons(row: Mapping[str, Any], arm: str) -> list[tuple[str, bool | None]]:
    """The ratios judged against ``arm`` at this point, with their verdicts: the planner's to
    the best fixed arm and to reuse off, READ's to the planner."""
    verdicts = row["targets"]
    found: list[tuple[str, bool | None]] = []
    if arm == row["best_fixed_arm"]:
        same = " (same path)" if row["planner_took_best_path"] else ""
        found.append(
            (f"planner/best {_times(row['planner_vs_best'])}{same}", verdicts["within_best"])
        )
    if arm == "off":
        found.append(
            (f"planner/off {_times(row['planner_vs_off'])}", verdicts["not_slower_than_off"])
        )
    if arm == "read" and "speedup_over_read" in verdicts:
        found.append(
            (f"read/planner {_times(row['read_vs_planner'])}", verdicts["speedup_over_read"])
        )
    return found + router_comparisons(row, arm)


def print_table(rows: Sequence[Mapping[str, Any]], console: Console) -> None:
    """One line per point and arm; each ratio the targets judge is on the line of the arm
    the planner is compared with."""
    table = Table(
        title=f"follow-up TTFT by arm; targets: planner/best <= {WITHIN_BEST:.2f}x, "
        f"planner/off <= 1, read/planner >= {SPEEDUP_OVER_READ}x at the longest one-line",
        title_justify="left",
    )
    for column in ("context", "suffix", "arm", "tokens", "median", "IQR", "took", "ratio",
                   "target"):  # fmt: skip
        table.add_column(column, justify="left" if column in ("arm", "took", "ratio") else "right")
    for row in rows:
        for index, (arm, figures) in enumerate(row["arms"].items()):
            comparisons = _comparisons(row, arm)
            table.add_row(
                str(row["length"]) if index == 0 else "",
                str(row["suffix"]) if index == 0 else "",
                arm,
                f"{figures['input_tokens']:.0f}",
                f"{figures['median_ms']:.0f} ms",
                f"{figures['q1_ms']:.0f}-{figures['q3_ms']:.0f}",
                ", ".join(f"{path} {n}" for path, n in sorted(figures["paths"].items())),
                "\n".join(text for text, _ in comparisons),
                "\n".join(_mark(value) for _, value in comparisons),
            )
        table.add_section()
    console.print(table)
    console.print(
        "targets at every point: "
        + ", ".join(f"{name} {_mark(value)}" for name, value in verdict(rows).items())
    )


def write(
    records: Sequence[TurnRecord],
    rows: Sequence[Mapping[str, Any]],
    output: Path,
    meta: Mapping[str, Any],
) -> list[Path]:
    """records.jsonl (every turn) and summary.json (the rows, targets and run settings)."""
    output.mkdir(parents=True, exist_ok=True)
    turns = output / "records.jsonl"
    turns.write_text("".join(json.dumps(record.to_json()) + "\n" for record in records))
    summary = output / "summary.json"
    summary.write_text(
        json.dumps(
            {
                **meta,
                "targets": {"within_best": WITHIN_BEST, "speedup_over_read": SPEEDUP_OVER_READ},
                "verdict": verdict(rows),
                "rows": list(rows),
                # Every READ's blocks and runs, follow-ups and openings (bench.read_shapes).
                "read_shapes": summarise_shapes(record.read_shapes for record in records),
            },
            indent=2,
        )
    )
    return [turns, summary]


def plot(rows: Sequence[Mapping[str, Any]], output: Path, title: str) -> Path:
    """TTFT by arm and context length, one panel per suffix size: medians, IQR as bars."""
    ready_plotting()
    import matplotlib.pyplot as plt

    suffixes = [s for s in SUFFIX_TOKENS if any(r["suffix"] == s for r in rows)]
    fig, axes = plt.subplots(1, len(suffixes), figsize=(5.5 * len(suffixes), 4.4), squeeze=False)
    styles = dict(
        zip(ALL_ARMS, ("o-", "s--", "^--", "v--", "x:", "D-", "d:", "P-", "p:"), strict=True)
    )
    for ax, suffix in zip(axes[0], suffixes, strict=True):
        chosen = [r for r in rows if r["suffix"] == suffix]
        for arm in ALL_ARMS:
            points = [(r["length"], r["arms"][arm]) for r in chosen if arm in r["arms"]]
            if not points:
                continue
            medians = [figures["median_ms"] for _, figures in points]
            below = [m - figures["q1_ms"] for m, (_, figures) in zip(medians, points, strict=True)]
            above = [figures["q3_ms"] - m for m, (_, figures) in zip(medians, points, strict=True)]
            ax.errorbar(
                [length for length, _ in points],
                medians,
                yerr=[below, above],
                fmt=styles[arm],
                capsize=3,
                linewidth=2.2 if arm == "planner" else 1.2,
                label="reuse off" if arm == "off" else arm,
            )
        ax.set_yscale("log")
        ax.set_title(f"{suffix} follow-up")
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("TTFT, median and IQR (ms)")
        ax.grid(alpha=0.3, which="both")
        ax.legend()
    fig.suptitle(title)
    return save_figure(fig, output / "ttft_by_path.png")
