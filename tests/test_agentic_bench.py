"""`kvbroker bench agentic`'s pure parts: trace compression, arm stacks, summary figures
and D's sampled gauges; the forks' stack, figures and files."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import math
from dataclasses import fields
from pathlib import Path

import httpx
import pytest

from kvbroker.common.process.tasks import poll_until
from kvbroker_tools.bench.agentic import DECODE_GAUGES, _sample_decode
from kvbroker_tools.bench.agentic_config import (
    FIXED_TTL_CONNECTOR,
    FORKS_STACK,
    AgenticConfig,
    compress,
)
from kvbroker_tools.bench.agentic_forks import (
    ROLLOUTS,
    SUB_AGENTS,
    ForkGroup,
    ForkRecord,
    against_reuse_off,
    summarise_group,
    write_forks,
)
from kvbroker_tools.bench.agentic_report import AgenticRecord, ArmResult, settings, summarise, write
from kvbroker_tools.bench.retention import Conversation, Gap
from kvbroker_tools.bench.stats import quantile
from kvbroker_tools.cli.bench import bench_agentic


def test_compress_scales_caps_gaps_and_cuts_turns() -> None:
    trace = [
        Conversation((Gap(120, True), Gap(6000, False), Gap(24, True)), closes=True),
        Conversation((), closes=False),
    ]
    compressed = compress(trace, time_scale=12, max_gap_s=48, max_turns=3)
    assert compressed[0] == Conversation((Gap(10, True), Gap(48, False)), closes=True)
    assert compressed[1] == Conversation((), closes=False)
    with pytest.raises(ValueError):
        compress(trace, time_scale=0, max_gap_s=48, max_turns=3)


def test_config_trace_is_deterministic_and_bounded() -> None:
    config = AgenticConfig(sessions=30, max_turns=5)
    trace = config.trace()
    assert trace == config.trace() and len(trace) == 30
    assert all(c.turns <= 5 for c in trace)
    assert all(0 <= g.seconds <= config.gap_cap_s for c in trace for g in c.gaps)
    # Some gaps outlast the fixed cap, so the fixed TTL can miss as vLLM's would.
    assert config.gap_cap_s > config.fixed_cap_s


def test_fixed_cap_is_compressed_but_bounded_below() -> None:
    assert AgenticConfig(time_scale=12).fixed_cap_s == 40
    assert AgenticConfig(time_scale=100).fixed_cap_s == 20


def test_arm_stacks() -> None:
    config = AgenticConfig(time_scale=12, kv_blocks=70, workdir=Path("/tmp/x"))
    fixed = config.stack_config("fixed-ttl")
    assert fixed.hard_cap_s == 40
    assert fixed.registry_flags == ("--lease-ttl", "40", "--no-learn-idle-ttl")
    assert fixed.connector_extra == FIXED_TTL_CONNECTOR
    assert fixed.engine_args == ("--num-gpu-blocks-override", "70")
    ours = config.stack_config("kvbroker")
    assert ours.engine_args == fixed.engine_args
    assert (ours.hard_cap_s, ours.registry_flags, ours.connector_extra) == (480, (), {})
    assert ours.workdir != fixed.workdir


def test_cli_defaults_match_the_config() -> None:
    defaults = AgenticConfig()
    options = inspect.signature(bench_agentic).parameters
    renamed = {"max_gap": "max_gap_s", "model": "model_dir"}
    for name, parameter in options.items():
        if name in ("output", "arms"):
            continue
        assert parameter.default == getattr(defaults, renamed.get(name, name)), name
    assert sorted(options["arms"].default.split(",")) == sorted(defaults.arms)


def _record(
    turn: int, ttft_ms: float, decision: str, decode_wait_ms: float, path: str = "READ"
) -> AgenticRecord:
    return AgenticRecord(
        arm="kvbroker",
        conversation_id="c",
        turn=turn,
        gap_s=0.0,
        after_tool_call=False,
        decision=decision,
        path=path,
        input_num_tokens=100,
        output_num_tokens=16,
        ttft_ms=ttft_ms,
        e2e_ms=ttft_ms + 100,
        prefill_leg_ms=ttft_ms - decode_wait_ms,
        decode_wait_ms=decode_wait_ms,
        waited_for_blocks=decode_wait_ms > 2000,
        sent_s=0.0,
    )


def test_summary_figures() -> None:
    result = ArmResult(
        "kvbroker",
        records=[
            _record(1, 100, "MISS", 50, "RECOMPUTE"),  # the first turn never counts for reuse
            _record(2, 200, "REUSE", 50, "DECODE_LOCAL"),
            _record(3, 300, "RECOMPUTE", 50, "RECOMPUTE"),
            _record(4, 5000, "REUSE", 4500),  # a stall
            _record(5, 400, "REUSE", math.nan),
        ],
        errors=["c turn 6: boom"],
        decode_samples=[(0.0, 0.5, 0), (1.0, 1.0, 2), (2.0, 0.0, 0), (3.0, 0.5, 1)],
    )
    row = summarise(result)
    assert (row["requests"], row["errors"], row["stalls"]) == (5, 1, 1)
    assert row["reuse_opportunities"] == 4
    assert row["reuse_rate"] == pytest.approx(3 / 4)
    assert row["paths"] == {"DECODE_LOCAL": 1, "READ": 2, "RECOMPUTE": 2}
    assert row["ttft_p50_ms"] == 300
    assert row["ttft_max_ms"] == 5000
    assert row["ttft_p90_ms"] == pytest.approx(3160)  # interpolated between 400 and 5000
    assert row["decode_wait_p50_ms"] == 50 and row["decode_wait_max_ms"] == 4500
    assert row["decode_kv_usage_mean"] == pytest.approx(0.5)
    assert row["decode_kv_usage_max"] == 1.0
    assert row["decode_waiting_share"] == pytest.approx(0.5)


def test_empty_arm_and_quantiles() -> None:
    row = summarise(ArmResult("reuse-off"))
    assert row["requests"] == 0 and math.isnan(row["ttft_p50_ms"])
    assert math.isnan(row["reuse_rate"]) and math.isnan(row["decode_kv_usage_mean"])
    assert quantile([7.0], 0.99) == 7.0
    assert quantile([1.0, 2.0, 3.0], 0.5) == 2.0


async def test_the_decode_sampler_adds_up_d_s_gauges() -> None:
    usage, waiting = DECODE_GAUGES["usage"], DECODE_GAUGES["waiting"]
    body = (
        f"# TYPE {usage} gauge\n"
        f'{usage}{{engine="0"}} 0.25\n'
        f'{usage}{{engine="1"}} 0.5\n'
        f"# TYPE {waiting} gauge\n"
        f'{waiting}{{engine="0"}} 2\n'
        f'{waiting}{{engine="1"}} 1\n'
    )

    def metrics(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/metrics"
        return httpx.Response(200, text=body)

    result = ArmResult("kvbroker")

    async def sampled() -> bool:
        return bool(result.decode_samples)

    async with httpx.AsyncClient(transport=httpx.MockTransport(metrics)) as client:
        sampler = asyncio.create_task(_sample_decode(client, "http://d", result, every_s=0.01))
        await poll_until(sampled, 30, "a sample of D's gauges", every_s=0.01)
        sampler.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sampler
    assert [sample[1:] for sample in result.decode_samples] == [(0.75, 3.0)] * len(
        result.decode_samples
    )


def test_write_outputs(tmp_path: Path) -> None:
    results = [
        ArmResult("reuse-off", records=[_record(1, 900, "MISS", 40)]),
        ArmResult(
            "kvbroker",
            records=[_record(1, 800, "MISS", 40), _record(2, 150, "REUSE", 40)],
            decode_samples=[(0.0, 0.2, 0.0), (1.0, 0.4, 0.0)],
        ),
    ]
    paths = write(results, AgenticConfig(), tmp_path)
    assert [p.name for p in paths] == ["records.jsonl", "summary.json", "agentic.png"]
    assert len((tmp_path / "records.jsonl").read_text().splitlines()) == 3
    assert {f.name for f in fields(AgenticRecord)} >= {
        "ttft_ms",
        "arm",
        "conversation_id",
        "turn",
        "decision",
        "input_num_tokens",
        "waited_for_blocks",
    }
    assert (tmp_path / "agentic.png").stat().st_size > 0


def test_the_forks_run_on_a_stack_of_defaults_for_reuse_off_and_kvbroker() -> None:
    config = AgenticConfig(workdir=Path("/tmp/x"))
    forks = config.stack_config(FORKS_STACK)
    # Reuse by content, not pressure: 32-token blocks and the default cache.
    assert (forks.block_size, forks.engine_args, forks.connector_extra) == (32, (), {})
    assert forks.workdir == Path("/tmp/x") / FORKS_STACK
    assert config.fork_arms == ("reuse-off", "kvbroker")
    assert AgenticConfig(arms=("kvbroker", "fixed-ttl")).fork_arms == ("kvbroker",)
    assert AgenticConfig(forks=0, rollouts=1).fork_arms == ()
    assert AgenticConfig(forks=0, rollouts=2).fork_arms == ("reuse-off", "kvbroker")


def _fork(arm: str, group: str, role: str, tokens: int, ttft_ms: float) -> ForkRecord:
    return ForkRecord(
        arm=arm,
        group=group,
        role=role,
        session_id="" if arm == "reuse-off" else f"forks-{role}",
        decision="MISS",
        path="RECOMPUTE",
        input_num_tokens=tokens,
        output_num_tokens=16,
        ttft_ms=ttft_ms,
        e2e_ms=ttft_ms + 100,
    )


def _groups() -> list[ForkGroup]:
    """Sub-agents of a parent with reuse off and on: three forks of 1,000 tokens each."""
    off = ForkGroup(
        "reuse-off",
        SUB_AGENTS,
        [_fork("reuse-off", SUB_AGENTS, "parent", 900, 800)]
        + [_fork("reuse-off", SUB_AGENTS, "fork", 1000, t) for t in (900, 1000, 1200)],
        computed_tokens=3000,
    )
    on = ForkGroup(
        "kvbroker",
        SUB_AGENTS,
        [_fork("kvbroker", SUB_AGENTS, "parent", 900, 800)]
        + [_fork("kvbroker", SUB_AGENTS, "fork", 1000, t) for t in (200, 250, 400)],
        reads=2,
        read_bytes=12e6,
        computed_tokens=1300,
    )
    return [off, on]


def test_fork_figures() -> None:
    off, on = (summarise_group(group) for group in _groups())
    # Only the forks count: the parent's turns are not forks.
    assert (off["forks"], off["prompt_tokens"], off["reuse_share"]) == (3, 3000, 0.0)
    assert off["computed_share"] == 1.0 and off["ttft_p50_ms"] == 1000
    assert on["reuse_share"] == pytest.approx(2 / 3)
    assert on["computed_share"] == pytest.approx(1300 / 3000)
    assert (on["read_mb"], on["ttft_p50_ms"], on["ttft_max_ms"]) == (12.0, 250, 400)
    # Each group against reuse-off's median; a group with one arm only has no ratio.
    rollouts = summarise_group(ForkGroup("kvbroker", ROLLOUTS, [], reads=0))
    assert math.isnan(rollouts["reuse_share"]) and math.isnan(rollouts["ttft_p50_ms"])
    assert against_reuse_off([off, on, rollouts]) == {SUB_AGENTS: 0.25}


def test_write_fork_outputs(tmp_path: Path) -> None:
    groups = _groups()
    config = AgenticConfig(sessions=0, forks=3, rollouts=0)
    paths = write_forks(groups, settings(config), tmp_path)
    assert [p.name for p in paths] == ["forks.json", "forks.png"]
    written = json.loads((tmp_path / "forks.json").read_text())
    assert written["config"]["forks"] == 3 and "workdir" not in written["config"]
    assert [row["arm"] for row in written["groups"]] == ["reuse-off", "kvbroker"]
    assert written["p50_against_reuse_off"] == {SUB_AGENTS: 0.25}
    assert len(written["records"]) == 8
    assert (tmp_path / "forks.png").stat().st_size > 0
