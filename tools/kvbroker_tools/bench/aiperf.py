"""NVIDIA's AIPerf as a client of the one-machine stack: does a client that names no session
(AIPerf's multi-turn workload at its defaults marks each conversation only with its own
``X-Correlation-ID``) get its later turns' KV reused?

The other benchmarks drive the router with kvbroker's own client, which sends a session id, so
they cannot show what a third-party load generator gets. Here AIPerf (its own virtualenv, ``make
aiperf``: its dependencies would move kvbroker's) runs its synthetic multi-turn workload,
streamed chat completions, against the router in arms:

* ``kvbroker``: the router retains sessionless turns under an id it names
  (``--retain-sessionless``) and P matches a later turn's prompt against those leases by
  content. AIPerf's default session handling: no session header.
* ``reuse-off``: the same workload and seed, the router with ``--no-retain-sessionless``: plain
  P/D, what AIPerf got before (the reference).
* ``session-header``: AIPerf told to send ``--session-header X-Session-ID``: reuse by id, on the
  kvbroker arm's stack, with its own seed so that its prompts match nothing retained before.

Per arm the figures come from two sides: AIPerf's own per-request export
(``profile_export.jsonl``: TTFT, the conversation and turn index), and the servers' counters
read before and after the arm (the router's turns by path, P's NIXL reads and the prompt tokens
it computed against those it was sent), since AIPerf runs turns concurrently and a turn's own
share of a counter cannot be told apart.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console
from rich.table import Table

from kvbroker_tools.bench.plotting import save_figure
from kvbroker_tools.bench.stats import quantile
from kvbroker_tools.bench.turns import prefill_totals
from kvbroker_tools.chat import streamed_turn
from kvbroker_tools.stack import Stack

# The router's TTFT histogram counts each turn once, by the path it took.
ROUTER_TURNS = "kvbroker_router_ttft_seconds_count"
PATHS = ("READ", "DECODE_LOCAL", "RECOMPUTE")
# What P's engine log says of each sessionless turn it asked the registry to match by content
# (engine_ext.prefix_match): matched against a lease (then READ), no match, no answer in time.
MATCH_LINES = {
    "matched": "kvbroker prefix match for ",
    "not_made": "kvbroker prefix match not made",
    "unanswered": "kvbroker prefix match unanswered",
}


@dataclass(frozen=True)
class Arm:
    name: str
    # The router's --retain-sessionless: which stack the arm runs on.
    retain_sessionless: bool
    # AIPerf's --session-header (None: its default, no session header).
    session_header: str | None = None


ARMS = {
    arm.name: arm
    for arm in (
        Arm("kvbroker", retain_sessionless=True),
        Arm("reuse-off", retain_sessionless=False),
        Arm("session-header", retain_sessionless=True, session_header="X-Session-ID"),
    )
}


@dataclass(frozen=True)
class AiperfConfig:
    arms: tuple[str, ...] = ("kvbroker", "reuse-off")
    conversations: int = 6
    turns: int = 4
    concurrency: int = 2
    input_tokens: int = 300
    output_tokens: int = 16
    seed: int = 0
    aiperf: Path = Path(".venv-aiperf/bin/aiperf")

    def command(
        self, arm: Arm, url: str, model: str, tokenizer: Path, seed: int, out: Path
    ) -> list[str]:
        """AIPerf's command line for one arm: its multi-turn synthetic workload, every length
        fixed (no spread), each conversation sent once."""
        argv = [
            str(self.aiperf), "profile",
            "--model", model, "--tokenizer", str(tokenizer),
            "--url", url, "--endpoint-type", "chat", "--streaming",
            "--conversation-num", str(self.conversations),
            "--conversation-turn-mean", str(self.turns), "--conversation-turn-stddev", "0",
            "--request-count", str(self.conversations * self.turns),
            "--concurrency", str(self.concurrency),
            "--prompt-input-tokens-mean", str(self.input_tokens),
            "--prompt-input-tokens-stddev", "0",
            "--prompt-output-tokens-mean", str(self.output_tokens),
            "--prompt-output-tokens-stddev", "0",
            "--extra-inputs", "ignore_eos:true",
            "--random-seed", str(seed),
            "--output-artifact-dir", str(out),
            "--ui-type", "none", "--no-server-metrics", "--no-gpu-telemetry",
        ]  # fmt: skip
        if arm.session_header:
            argv += ["--session-header", arm.session_header]
        return argv


@dataclass(frozen=True)
class Request:
    """One request of AIPerf's export."""

    conversation: str
    turn: int
    ttft_ms: float
    # The turn's prompt, the whole history, as AIPerf's tokenizer counts it (no chat
    # template), and as the server's usage reported it (after the template).
    input_tokens: int
    prompt_tokens: int
    error: str = ""


def read_export(path: Path) -> list[Request]:
    """The requests of an AIPerf ``profile_export.jsonl``: one JSON record a line, its
    ``metadata`` (conversation_id, turn_index from 0) and ``metrics`` (name -> value, unit);
    TTFT in ms (NaN for a request that failed before its first token)."""
    requests = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        record = json.loads(line)
        metadata, metrics = record["metadata"], record.get("metrics") or {}
        ttft = metrics.get("time_to_first_token") or {}
        if ttft and ttft.get("unit", "ms") != "ms":
            raise ValueError(f"{path}: TTFT in {ttft['unit']!r}, not ms")
        error = record.get("error")
        requests.append(
            Request(
                conversation=str(metadata.get("conversation_id")),
                turn=int(metadata.get("turn_index") or 0),
                ttft_ms=float(ttft.get("value", math.nan)),
                input_tokens=int(_value(metrics, "input_sequence_length")),
                prompt_tokens=int(_value(metrics, "usage_prompt_tokens")),
                error=str(error.get("message") or error) if error else "",
            )
        )
    return requests


def _value(metrics: Mapping[str, Any], name: str) -> float:
    return float((metrics.get(name) or {}).get("value", 0))


def find_export(artifacts: Path) -> Path:
    """AIPerf writes its records under a folder it names after the run, inside ``artifacts``."""
    found = sorted(artifacts.rglob("profile_export.jsonl"))
    if not found:
        raise RuntimeError(f"AIPerf wrote no profile_export.jsonl under {artifacts}")
    return found[0]


@dataclass
class Counters:
    """The servers' running counters that an arm moves: the router's turns by path, P's NIXL
    reads and prompt tokens (computed, sent)."""

    paths: dict[str, float] = field(default_factory=dict)
    reads: float = 0.0
    computed_tokens: float = 0.0
    prompt_tokens: float = 0.0

    def minus(self, before: Counters) -> Counters:
        return Counters(
            {p: self.paths.get(p, 0.0) - before.paths.get(p, 0.0) for p in PATHS},
            self.reads - before.reads,
            self.computed_tokens - before.computed_tokens,
            self.prompt_tokens - before.prompt_tokens,
        )


def router_paths(text: str) -> dict[str, float]:
    """Turns the router has routed, by path, from its /metrics answer."""
    paths = dict.fromkeys(PATHS, 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == ROUTER_TURNS and sample.labels.get("path") in paths:
                paths[sample.labels["path"]] += sample.value
    return paths


async def read_counters(client: httpx.AsyncClient, stack: Stack) -> Counters:
    totals = await prefill_totals(client, stack.url(stack.prefill))
    paths = router_paths((await client.get(f"{stack.router_url}/metrics")).text)
    return Counters(paths, totals.reads, totals.computed_tokens, totals.prompt_tokens)


def count_matches(log_text: str) -> dict[str, int]:
    """P's content matches in a stretch of its engine log, by outcome."""
    lines = log_text.splitlines()
    return {key: sum(marker in line for line in lines) for key, marker in MATCH_LINES.items()}


def prefill_log(stack: Stack) -> Path:
    return stack.config.workdir / f"vllm-{stack.prefill.name}.log"


@dataclass
class ArmSummary:
    arm: str
    session_header: str | None
    requests: int
    errors: int
    first_turns: int
    later_turns: int
    ttft_first_p50_ms: float
    ttft_first_p99_ms: float
    ttft_later_p50_ms: float
    ttft_later_p99_ms: float
    # Every turn's whole prompt by AIPerf's count, and by the server's usage: what a server
    # without reuse computes.
    aiperf_input_tokens: int
    prompt_tokens: int
    # The router's turns by path; P's NIXL reads; P's prompt tokens computed and sent to it.
    paths: dict[str, float]
    p_reads: float
    p_computed_tokens: float
    p_prompt_tokens: float
    # P's content matches during the arm (count_matches).
    matches: dict[str, int]

    @property
    def reused_later(self) -> float:
        """Later turns that reused retained KV: by id (the router's READ and DECODE_LOCAL
        turns) or, sessionless, by content (P's matches). A first turn reuses nothing: no
        prompt of AIPerf's starts with another conversation's."""
        by_id = self.paths.get("READ", 0.0) + self.paths.get("DECODE_LOCAL", 0.0)
        return by_id + self.matches.get("matched", 0)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "reused_later": self.reused_later}


def summarise(
    arm: Arm, requests: Iterable[Request], counters: Counters, matches: dict[str, int]
) -> ArmSummary:
    """An arm's figures: TTFT quantiles of first and of later turns (failed requests left
    out), and what its counters moved by."""
    done = [r for r in requests if not r.error]
    errors = sum(1 for r in requests if r.error)
    first = [r.ttft_ms for r in done if r.turn == 0]
    later = [r.ttft_ms for r in done if r.turn > 0]
    return ArmSummary(
        arm=arm.name,
        session_header=arm.session_header,
        requests=len(done) + errors,
        errors=errors,
        first_turns=len(first),
        later_turns=len(later),
        ttft_first_p50_ms=quantile(first, 0.5),
        ttft_first_p99_ms=quantile(first, 0.99),
        ttft_later_p50_ms=quantile(later, 0.5),
        ttft_later_p99_ms=quantile(later, 0.99),
        aiperf_input_tokens=sum(r.input_tokens for r in done),
        prompt_tokens=sum(r.prompt_tokens for r in done),
        paths=counters.paths,
        p_reads=counters.reads,
        p_computed_tokens=counters.computed_tokens,
        p_prompt_tokens=counters.prompt_tokens,
        matches=matches,
    )


async def warm_up(stack: Stack) -> None:
    """The engines' first request is slow (README); it is no arm's. A sessionless turn, so on
    a retaining router it leaves a lease that no AIPerf prompt starts with."""
    async with httpx.AsyncClient(timeout=600) as client:
        turn = await streamed_turn(
            client, stack, [{"role": "user", "content": "warm up " * 50}], None, 4
        )
        if turn.status != 200:
            raise RuntimeError(f"warm-up answered {turn.status}: {turn.error!r}")


async def run_arm(
    stack: Stack, arm: Arm, config: AiperfConfig, seed: int, out: Path, console: Console
) -> ArmSummary:
    """Runs AIPerf for one arm against the stack's router; its log and artifacts in
    ``out/<arm>``."""
    artifacts = out / arm.name
    artifacts.mkdir(parents=True, exist_ok=True)
    assert stack.model_dir is not None
    argv = config.command(
        arm, stack.router_url, stack.config.served_model, stack.model_dir, seed, artifacts
    )
    console.print(f"[dim]·[/] {arm.name}: {' '.join(argv)}")
    async with httpx.AsyncClient(timeout=60) as client:
        before = await read_counters(client, stack)
        log_offset = prefill_log(stack).stat().st_size
        with (artifacts / "aiperf.log").open("wb") as log:
            process = await asyncio.create_subprocess_exec(
                *argv, stdout=log, stderr=asyncio.subprocess.STDOUT,
                env={**os.environ, "NO_COLOR": "1"},
            )  # fmt: skip
            try:
                code = await process.wait()
            except asyncio.CancelledError:
                process.terminate()
                await process.wait()
                raise
        if code != 0:
            raise RuntimeError(f"AIPerf exited {code}; its log: {artifacts / 'aiperf.log'}")
        after = await read_counters(client, stack)
    with prefill_log(stack).open("rb") as log:
        log.seek(log_offset)
        matches = count_matches(log.read().decode(errors="replace"))
    return summarise(arm, read_export(find_export(artifacts)), after.minus(before), matches)


async def run_stack_arms(
    stack: Stack, arms: list[Arm], config: AiperfConfig, out: Path, console: Console
) -> list[ArmSummary]:
    """The arms that share this stack, one after another; each after the first its own seed,
    so that its prompts start with nothing an earlier arm left retained."""
    await warm_up(stack)
    return [
        await run_arm(stack, arm, config, config.seed + index, out, console)
        for index, arm in enumerate(arms)
    ]


def _ms(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:,.0f}"


def print_table(rows: list[ArmSummary], console: Console) -> None:
    table = Table(title="AIPerf multi-turn through the router (TTFT, ms)", title_justify="left")
    columns = (
        "arm", "later reused", "P reads", "1st p50", "1st p99", "later p50", "later p99",
        "P computed/sent",
    )  # fmt: skip
    for column in columns:
        table.add_column(column, justify="right", no_wrap=True)
    for row in rows:
        table.add_row(
            row.arm,
            f"{row.reused_later:.0f} of {row.later_turns}",
            f"{row.p_reads:.0f}",
            *(_ms(v) for v in (row.ttft_first_p50_ms, row.ttft_first_p99_ms)),
            *(_ms(v) for v in (row.ttft_later_p50_ms, row.ttft_later_p99_ms)),
            f"{row.p_computed_tokens:,.0f}/{row.p_prompt_tokens:,.0f}",
        )
    console.print(table)
    for row in rows:
        if row.errors:
            console.print(f"[red]{row.arm}: {row.errors} of {row.requests} requests failed[/]")


def write(
    rows: list[ArmSummary], config: AiperfConfig, output: Path, meta: Mapping[str, Any]
) -> Path:
    output.mkdir(parents=True, exist_ok=True)
    path = output / "summary.json"
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in asdict(config).items()}
    path.write_text(
        json.dumps({"config": settings, **meta, "arms": [row.to_json() for row in rows]}, indent=2)
        + "\n"
    )
    return path


def plot(rows: list[ArmSummary], output: Path) -> Path:
    """TTFT p50 of first and later turns per arm, and the prompt tokens P computed against
    those it was sent."""
    import matplotlib.pyplot as plt

    fig, (ttft, tokens) = plt.subplots(1, 2, figsize=(10, 4))
    names = [row.arm for row in rows]
    x = range(len(rows))
    ttft.bar([i - 0.2 for i in x], [r.ttft_first_p50_ms for r in rows], 0.4, label="first turns")
    ttft.bar([i + 0.2 for i in x], [r.ttft_later_p50_ms for r in rows], 0.4, label="later turns")
    ttft.set_xticks(list(x), names)
    ttft.set_ylabel("TTFT p50, ms (AIPerf)")
    ttft.legend()
    tokens.bar([i - 0.2 for i in x], [r.p_prompt_tokens for r in rows], 0.4, label="sent to P")
    tokens.bar([i + 0.2 for i in x], [r.p_computed_tokens for r in rows], 0.4, label="P computed")
    tokens.set_xticks(list(x), names)
    tokens.set_ylabel("prompt tokens")
    tokens.legend()
    fig.suptitle("AIPerf multi-turn, default session handling (vLLM CPU)")
    return save_figure(fig, output / "aiperf.png")
