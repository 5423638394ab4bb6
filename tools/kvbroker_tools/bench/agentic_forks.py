"""Forks in `kvbroker bench agentic`: sub-agents and rollout groups, which reuse a retained
conversation's KV by content (docs/design.md, "Forks: reuse by content").

The trace's sessions each have a history of their own, so they measure reuse by session id
only. Agents also fork: a parent spawns sub-agents, each a new session id whose prompt is the
parent's whole history plus a task of its own; an RL trainer sends a group of rollouts of one
prompt. Two groups per arm, on a stack of their own (the stack's defaults: 32-token blocks and
room in the cache, since what is measured here is reuse, not pressure on the cache):

* ``sub-agents``: a parent of two turns (a system prompt, a task, a tool result), then
  ``forks`` sub-agents at once;
* ``rollouts``: one rollout of a prompt, then ``rollouts`` - 1 more of it at once.

With reuse (the ``kvbroker`` arm) every request has a session id of its own, which the router
knows nothing of (MISS), and its prefill engine matches the prompt against the retained leases;
without (``reuse-off``) they are plain P/D. The forks are sent once the decode node has
reported the parent's retention to the registry (an agent spawns sub-agents after reading its
answer; the report takes milliseconds). Each request is streamed and timed on the client; what
the prefill node did for a group's forks comes from its own counters over the group, since
requests that run at once cannot be told apart there: its D→P reads (one per fork that
reused: P issues no other READ) and the prompt tokens it computed.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

from kvbroker.common.process.tasks import poll_until
from kvbroker.common.rules.engine_metrics import Totals
from kvbroker.v1 import lease_pb2
from kvbroker_tools.bench.agentic_config import FORK_ARMS, AgenticConfig
from kvbroker_tools.bench.multiturn import ContextBuilder
from kvbroker_tools.bench.plotting import ready_plotting, save_figure
from kvbroker_tools.bench.stats import quantile
from kvbroker_tools.bench.turns import prefill_totals
from kvbroker_tools.chat import streamed_turn
from kvbroker_tools.harness.turns import current_lease
from kvbroker_tools.stack import Stack

SUB_AGENTS = "sub-agents"
ROLLOUTS = "rollouts"
# Seeds the groups' text apart from the trace's sessions (seed * 100_003 + index).
TEXT_SEED = 77_777


@dataclass
class ForkRecord:
    arm: str
    group: str
    # "parent": a turn of the parent, or the group's first rollout; "fork": a sub-agent, or
    # a later rollout.
    role: str
    # "" with reuse off (no session id).
    session_id: str
    decision: str
    path: str
    input_num_tokens: int
    output_num_tokens: int
    ttft_ms: float
    e2e_ms: float


@dataclass
class ForkGroup:
    arm: str
    group: str
    records: list[ForkRecord] = field(default_factory=list)
    # P's counters over the group's forks: D→P reads, their bytes, prompt tokens computed.
    reads: float = 0.0
    read_bytes: float = 0.0
    computed_tokens: float = 0.0

    @property
    def forks(self) -> list[ForkRecord]:
        return [r for r in self.records if r.role == "fork"]


def summarise_group(group: ForkGroup) -> dict[str, Any]:
    """A group's figures: its forks' TTFT, the share of them that read a retained prefix
    (reuse), and the share of their prompt tokens the prefill node computed."""
    forks = group.forks
    prompt = sum(r.input_num_tokens for r in forks)
    ttft = [r.ttft_ms for r in forks]
    return {
        "arm": group.arm,
        "group": group.group,
        "forks": len(forks),
        "reuse_share": min(group.reads, len(forks)) / len(forks) if forks else math.nan,
        "prompt_tokens": prompt,
        "computed_tokens": group.computed_tokens,
        "computed_share": group.computed_tokens / prompt if prompt else math.nan,
        "read_mb": group.read_bytes / 1e6,
        "ttft_p50_ms": quantile(ttft, 0.5),
        "ttft_max_ms": max(ttft, default=math.nan),
    }


def against_reuse_off(rows: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Per group, the kvbroker arm's median fork TTFT over reuse-off's (absent: either arm
    missing)."""
    p50 = {(row["group"], row["arm"]): row["ttft_p50_ms"] for row in rows}
    return {
        group: p50[(group, "kvbroker")] / p50[(group, "reuse-off")]
        for group in (SUB_AGENTS, ROLLOUTS)
        if (group, "kvbroker") in p50 and (group, "reuse-off") in p50
    }


async def run_forks(
    stack: Stack, arm: str, config: AgenticConfig, console: Console
) -> list[ForkGroup]:
    """The arm's two groups (one left out when its count is too small to fork), each session
    closed after its group; prompts sized as the trace's sessions."""
    groups = []
    async with httpx.AsyncClient(timeout=600) as client:
        if config.forks:
            with console.status(f"{arm}: a parent and {config.forks} sub-agents"):
                groups.append(await _sub_agents(client, stack, arm, config))
        if config.rollouts > 1:
            with console.status(f"{arm}: a group of {config.rollouts} rollouts"):
                groups.append(await _rollouts(client, stack, arm, config))
    return groups


async def _sub_agents(
    client: httpx.AsyncClient, stack: Stack, arm: str, config: AgenticConfig
) -> ForkGroup:
    """A parent's two turns, then its sub-agents at once: its history and a task each."""
    builder = ContextBuilder(config.seed * 100_003 + TEXT_SEED)
    group = ForkGroup(arm, SUB_AGENTS)
    parent = _session(arm, "parent")
    messages = [
        {
            "role": "system",
            "content": "You are a coding agent. " + builder.text(config.system_tokens),
        },
        {"role": "user", "content": builder.text(config.turn_tokens)},
    ]
    for turn in (1, 2):
        if turn == 2:
            tool = "Tool output:\n" + builder.text(config.turn_tokens)
            messages.append({"role": "user", "content": tool})
        answer = await _turn(client, stack, group, "parent", parent, messages, config.max_tokens)
        messages.append({"role": "assistant", "content": answer})
    tasks = [
        [*messages, {"role": "user", "content": f"Sub-agent {n}: check part {n} of the change."}]
        for n in range(1, config.forks + 1)
    ]
    await _forks(client, stack, group, parent, tasks, config.max_tokens)
    return group


async def _rollouts(
    client: httpx.AsyncClient, stack: Stack, arm: str, config: AgenticConfig
) -> ForkGroup:
    """One rollout of a prompt, then the group's others at once."""
    builder = ContextBuilder(config.seed * 100_003 + TEXT_SEED + 1)
    group = ForkGroup(arm, ROLLOUTS)
    prompt = [
        {"role": "system", "content": "Solve the task. " + builder.text(config.system_tokens)},
        {"role": "user", "content": builder.text(config.turn_tokens)},
    ]
    first = _session(arm, "rollout-0")
    await _turn(client, stack, group, "parent", first, prompt, config.max_tokens)
    others = [prompt] * (config.rollouts - 1)
    await _forks(client, stack, group, first, others, config.max_tokens, "rollout")
    return group


def _session(arm: str, name: str) -> str | None:
    return f"forks-{name}" if arm == "kvbroker" else None


async def _forks(
    client: httpx.AsyncClient,
    stack: Stack,
    group: ForkGroup,
    parent: str | None,
    prompts: Sequence[list[dict[str, str]]],
    max_tokens: int,
    name: str = "sub",
) -> None:
    """``prompts`` at once, each its own session, once the parent's retention is reported;
    then P's counters over them, and every session of the group closed."""
    if parent is not None:
        await retention_reported(stack.registry_address, parent)
    prefill_url = stack.url(stack.prefill)
    before = await prefill_totals(client, prefill_url)
    sessions = [_session(group.arm, f"{name}-{n}") for n in range(1, len(prompts) + 1)]
    await asyncio.gather(
        *(
            _turn(client, stack, group, "fork", session, prompt, max_tokens)
            for session, prompt in zip(sessions, prompts, strict=True)
        )
    )
    legs = sum(r.path != "DECODE_LOCAL" for r in group.forks)
    after = await _counted(client, prefill_url, before, legs)
    group.reads = after.reads - before.reads
    group.read_bytes = after.read_bytes - before.read_bytes
    group.computed_tokens = after.computed_tokens - before.computed_tokens
    for session in (parent, *sessions):
        if session is not None:
            await client.delete(f"{stack.router_url}/v1/sessions/{session}")


async def _turn(
    client: httpx.AsyncClient,
    stack: Stack,
    group: ForkGroup,
    role: str,
    session: str | None,
    messages: list[dict[str, str]],
    max_tokens: int,
) -> str:
    turn = await streamed_turn(client, stack, messages, session, max_tokens)
    if turn.status != 200:
        raise RuntimeError(f"router answered {turn.status}: {turn.error!r}")
    group.records.append(
        ForkRecord(
            arm=group.arm,
            group=group.group,
            role=role,
            session_id=session or "",
            decision=turn.headers.get("x-kvbroker-decision", "?"),
            path=turn.headers.get("x-kvbroker-path", "?"),
            input_num_tokens=int(turn.usage.get("prompt_tokens", 0)),
            output_num_tokens=int(turn.usage.get("completion_tokens", 0)),
            ttft_ms=1000 * turn.ttft_s,
            e2e_ms=1000 * turn.e2e_s,
        )
    )
    return turn.text


async def _counted(
    client: httpx.AsyncClient, prefill_url: str, before: Totals, legs: int
) -> Totals:
    """P's totals once they count ``legs`` more prefills than ``before`` (vLLM observes a
    request's histograms when it finishes, after its answer may have left)."""

    async def caught_up() -> Totals | None:
        now = await prefill_totals(client, prefill_url)
        return now if now.prefills >= before.prefills + legs else None

    found = await poll_until(caught_up, 30, "P's metrics counting the forks' prefills")
    assert found is not None
    return found


async def retention_reported(registry: str, session: str, within_s: float = 30) -> None:
    """Waits until the conversation's newest lease is ACTIVE: the decode node has reported
    its last turn's retention (until then the lease its turn claimed is the newest, and a
    claimed lease is matched by no one)."""

    async def active() -> bool:
        lease = await current_lease(registry, session)
        return lease is not None and lease.state == lease_pb2.LEASE_STATE_ACTIVE

    await poll_until(active, within_s, f"{session}'s retention reported")


def print_forks(rows: Sequence[dict[str, Any]], console: Console) -> None:
    table = Table(title="forks: sub-agents and rollouts of one prompt", title_justify="left")
    # Short headers: a console that is not a terminal is 80 columns wide.
    for column in ("group", "arm", "forks", "reuse", "computed", "read", "p50", "max"):
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(
            row["group"],
            row["arm"],
            str(row["forks"]),
            f"{100 * row['reuse_share']:.0f} %",
            f"{row['computed_tokens']:,.0f}/{row['prompt_tokens']:,}",
            f"{row['read_mb']:.1f} MB",
            f"{row['ttft_p50_ms'] / 1000:.2f} s",
            f"{row['ttft_max_ms'] / 1000:.2f} s",
        )
    console.print(table)
    ratios = against_reuse_off(rows)
    console.print(
        "reuse: forks whose prefill read a retained prefix from D; computed: the forks' prompt "
        "tokens P computed, of all; p50, max: the forks' TTFT"
        + "".join(f"; {group}: p50 x{ratio:.2f} of reuse-off" for group, ratio in ratios.items())
    )


def write_forks(groups: Sequence[ForkGroup], settings: dict[str, Any], output: Path) -> list[Path]:
    """forks.json (the settings, each group's figures and every request) and forks.png."""
    output.mkdir(parents=True, exist_ok=True)
    rows = [summarise_group(group) for group in groups]
    path = output / "forks.json"
    path.write_text(
        json.dumps(
            {
                "config": settings,
                "groups": rows,
                "p50_against_reuse_off": against_reuse_off(rows),
                "records": [asdict(r) for group in groups for r in group.records],
            },
            indent=2,
        )
    )
    return [path, plot_forks(groups, output / "forks.png")]


def plot_forks(groups: Sequence[ForkGroup], path: Path) -> Path:
    """Per group: each fork's TTFT by arm (dots, the median a bar), and the share of the
    forks' prompt tokens the prefill node computed."""
    ready_plotting()
    import matplotlib.pyplot as plt

    colors = {"reuse-off": "#c44e52", "kvbroker": "#4c72b0"}
    names = [name for name in (SUB_AGENTS, ROLLOUTS) if any(g.group == name for g in groups)]
    arms = [arm for arm in FORK_ARMS if any(g.arm == arm for g in groups)]
    fig, (times, computed) = plt.subplots(1, 2, figsize=(11, 4.2))
    width = 0.8 / max(len(arms), 1)
    for a, arm in enumerate(arms):
        for n, name in enumerate(names):
            found = [g for g in groups if g.arm == arm and g.group == name]
            if not found:
                continue
            group, row = found[0], summarise_group(found[0])
            x = n + (a - (len(arms) - 1) / 2) * width
            label = arm if n == 0 else None
            times.bar(x, row["ttft_p50_ms"] / 1000, width, color=colors[arm], alpha=0.5,
                      label=label)  # fmt: skip
            times.scatter([x] * len(group.forks), [r.ttft_ms / 1000 for r in group.forks],
                          color=colors[arm], s=12, zorder=3)  # fmt: skip
            share = 100 * row["computed_share"]
            computed.bar(x, share, width, color=colors[arm], label=label)
            computed.annotate(f"{share:.0f} %\nreuse {100 * row['reuse_share']:.0f} %",
                              (x, share), ha="center", va="bottom", fontsize=8)  # fmt: skip
    for axes in (times, computed):
        axes.set_xticks(range(len(names)), names)
        axes.grid(axis="y", alpha=0.3)
        axes.legend(loc="upper right")
    times.set_ylabel("fork TTFT (s; bar: median)")
    times.set_title("TTFT of each fork")
    computed.set_ylim(0, 125)
    computed.set_ylabel("forks' prompt tokens P computed (%)")
    computed.set_title("What the prefill node computed")
    return save_figure(fig, path)
