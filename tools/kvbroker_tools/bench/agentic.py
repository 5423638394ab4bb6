"""Concurrent agent sessions on a decode node whose KV cache is small: what retention policy
costs the requests that need the blocks.

The multi-turn sweep shows what reuse saves one conversation; the retention simulation shows
what a fixed TTL holds idle on a model of a trace. Neither shows the cost that matters once
the decode node is full: retained KV of idle (or abandoned) conversations competing with the
blocks that new turns need. Here the real one-machine stack (vLLM CPU engines, NIXL, registry,
sidecars, router) serves several agent sessions at once, with the engines' KV cache cut to a
few dozen blocks so that five or six idle conversations fill it. The sessions follow the
retention trace (``kvbroker_tools.bench.retention.make_trace``: tool calls, think times, clients
that close and clients that vanish), time-compressed so that all three arms fit in about a
quarter of an hour on 2 cores. Three arms replay the same trace:

* ``reuse-off``: no session id; plain P/D, every turn recomputed, nothing retained.
* ``fixed-ttl``: vLLM's behaviour: every retention is held for the hard cap (480 s, compressed
  like the trace), never released under pressure, no retention budget; clients have no
  keep-alive or close (vLLM offers neither). Turns that need blocks wait until a retention
  expires.
* ``kvbroker``: the defaults: idle leases, keep-alives during tool calls, close on exit,
  release under pressure and a retention budget.

Each request is a streamed chat turn through the router (``kvbroker_tools.bench.turns``); the
client measures TTFT and reads the registry's decision. A request *waited for blocks* when its
decode leg (TTFT minus P's prefill leg, as the router reports it: D admitting the request,
pulling the new KV from P and producing the first token) took longer than ``stall_ms``. With
room on D that leg took 40-700 ms in the smoke runs, up to 1.7 s when six sessions' first
turns reached D's one core at once; waiting for blocks to be freed took 2.3-9.3 s. Every record
keeps ``decode_wait_ms``, so the threshold can be moved afterwards. Beside the requests, D's
own gauges (KV cache usage, requests waiting) are sampled once a second.

Then, on a stack of their own, forks: a parent that spawns sub-agents with its history and a
group of rollouts of one prompt, reuse-off against kvbroker
(``kvbroker_tools.bench.agentic_forks``).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import Callable, Sequence

import httpx
from rich.console import Console
from rich.progress import Progress

from kvbroker.common.rules.engine_metrics import read_gauges
from kvbroker_tools.bench.agentic_config import ARMS, FORKS_STACK, AgenticConfig, Arm
from kvbroker_tools.bench.agentic_forks import ForkGroup, run_forks
from kvbroker_tools.bench.agentic_report import AgenticRecord, ArmResult
from kvbroker_tools.bench.multiturn import ContextBuilder
from kvbroker_tools.bench.retention import Conversation, Gap
from kvbroker_tools.bench.turns import measured_turn
from kvbroker_tools.stack import Stack

# An agent in a tool call renews its lease this often (compressed seconds; the registry's
# shortest idle TTL is 10 s).
KEEPALIVE_EVERY_S = 5.0
# D's gauges, sampled during each arm.
DECODE_GAUGES = {"usage": "vllm:kv_cache_usage_perc", "waiting": "vllm:num_requests_waiting"}


async def run_agentic(
    config: AgenticConfig, console: Console
) -> tuple[list[ArmResult], list[ForkGroup]]:
    """Every selected arm, one stack at a time (the kvbroker stack first: reuse-off, then
    kvbroker), then the forks on their own stack; each stack is stopped before the next
    starts, and on failure or SIGTERM."""
    task = asyncio.current_task()
    assert task is not None
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, task.cancel)
    trace = config.trace() if config.sessions else []
    if trace:
        gaps = [gap.seconds for conversation in trace for gap in conversation.gaps]
        console.print(
            f"[dim]·[/] trace: {len(trace)} sessions, {sum(c.turns for c in trace)} turns, "
            f"{sum(gaps):.0f} s of gaps (x{config.time_scale:g} compressed, capped at "
            f"{config.gap_cap_s:.0f} s); fixed-ttl cap {config.fixed_cap_s} s"
        )
    arms = [ARMS[name] for name in ARMS if name in config.arms] if trace else []
    results: list[ArmResult] = []
    groups: list[ForkGroup] = []
    stacks = [*dict.fromkeys(arm.stack for arm in arms)]
    if config.fork_arms:
        stacks.append(FORKS_STACK)
    try:
        for stack_name in stacks:
            stack = Stack(
                config.stack_config(stack_name),
                progress=lambda message: console.print(f"[dim]·[/] {message}"),
            )
            try:
                with console.status(f"starting the {stack_name} stack"):
                    await stack.start()
                    await _warm_up(stack)
                for arm in (a for a in arms if a.stack == stack_name):
                    results.append(await run_arm(stack, arm, trace, config, console))
                if stack_name == FORKS_STACK:
                    for name in config.fork_arms:
                        groups += await run_forks(stack, name, config, console)
            finally:
                console.print(f"[dim]·[/] stopping the {stack_name} stack")
                await stack.stop()
    finally:
        loop.remove_signal_handler(signal.SIGTERM)
    return results, groups


async def _warm_up(stack: Stack) -> None:
    """The engines' first request is slow (README); it is not part of any arm."""
    async with httpx.AsyncClient(timeout=600) as client:
        await measured_turn(
            client,
            stack,
            [{"role": "user", "content": ContextBuilder(-1).text(200)}],
            None,
            4,
        )


async def run_arm(
    stack: Stack,
    arm: Arm,
    trace: Sequence[Conversation],
    config: AgenticConfig,
    console: Console,
) -> ArmResult:
    """The trace's sessions, ``concurrency`` at a time: a session starts when one ends."""
    result = ArmResult(arm.name)
    started = time.perf_counter()
    sessions = iter(enumerate(trace))
    async with httpx.AsyncClient(timeout=600) as client:
        sampler = asyncio.create_task(_sample_decode(client, stack.url(stack.decode), result))
        with Progress(console=console, transient=False) as progress:
            task = progress.add_task(arm.name, total=sum(c.turns for c in trace))

            async def worker() -> None:
                for index, conversation in sessions:
                    await _session(
                        stack, client, arm, index, conversation, config, result, started,
                        lambda turns: progress.advance(task, turns),
                    )  # fmt: skip

            try:
                async with asyncio.TaskGroup() as workers:  # one failing cancels the rest
                    for _ in range(config.concurrency):
                        workers.create_task(worker())
            finally:
                sampler.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await sampler
    result.wall_s = time.perf_counter() - started
    return result


async def _session(
    stack: Stack,
    client: httpx.AsyncClient,
    arm: Arm,
    index: int,
    conversation: Conversation,
    config: AgenticConfig,
    result: ArmResult,
    arm_started: float,
    advance: Callable[[int], None],
) -> None:
    conversation_id = f"agentic-{arm.name}-{index}"
    session = conversation_id if arm.sessions else None
    # Seeded by the session alone: every arm replays the same conversation (at temperature
    # 0 the answers match too). Each session has its own system text, so no KV is shared
    # between sessions and the cache holds one copy per conversation.
    builder = ContextBuilder(config.seed * 100_003 + index)
    system = "You are a coding agent. " + builder.text(config.system_tokens)
    messages = [
        {"role": "system", "content": system},
        {"role": "user", "content": builder.text(config.turn_tokens)},
    ]
    gaps = (Gap(0.0, tool_call=False), *conversation.gaps)
    for turn, gap in enumerate(gaps, start=1):
        if turn > 1:
            await _idle(client, stack.router_url, session, gap, arm, result)
            prefix = "Tool output:\n" if gap.tool_call else ""
            messages.append({"role": "user", "content": prefix + builder.text(config.turn_tokens)})
        sent = time.perf_counter() - arm_started
        try:
            answer, measured = await measured_turn(
                client,
                stack,
                messages,
                session,
                config.max_tokens,
            )
        except (RuntimeError, httpx.HTTPError) as error:
            # The history is broken from here on: the session ends, counted as an error.
            result.errors.append(f"{conversation_id} turn {turn}: {error!r}")
            advance(conversation.turns - turn + 1)
            return
        messages.append({"role": "assistant", "content": answer})
        builder.learn(sum(len(m["content"]) for m in messages[:-1]), measured["input_num_tokens"])
        decode_wait = measured["ttft_ms"] - measured["prefill_leg_ms"]
        result.records.append(
            AgenticRecord(
                arm=arm.name,
                conversation_id=conversation_id,
                turn=turn,
                gap_s=round(gap.seconds, 3),
                after_tool_call=gap.tool_call,
                decision=measured["decision"],
                path=measured["path"],
                input_num_tokens=measured["input_num_tokens"],
                output_num_tokens=measured["output_num_tokens"],
                ttft_ms=measured["ttft_ms"],
                e2e_ms=measured["e2e_ms"],
                prefill_leg_ms=measured["prefill_leg_ms"],
                decode_wait_ms=decode_wait,
                waited_for_blocks=decode_wait > config.stall_ms,
                sent_s=round(sent, 3),
                read_shapes=measured["read_shapes"],
            )
        )
        advance(1)
    if conversation.closes and session is not None and arm.keepalive_and_close:
        with contextlib.suppress(httpx.HTTPError):
            await client.delete(f"{stack.router_url}/v1/sessions/{session}")
            result.closes += 1
    # Otherwise the client is gone: whatever D retains stays until its lease or TTL ends.


async def _idle(
    client: httpx.AsyncClient,
    router_url: str,
    session: str | None,
    gap: Gap,
    arm: Arm,
    result: ArmResult,
) -> None:
    """Waits out a gap; an agent on kvbroker keeps its lease alive while a tool runs."""
    if not (gap.tool_call and session is not None and arm.keepalive_and_close):
        await asyncio.sleep(gap.seconds)
        return
    loop = asyncio.get_running_loop()
    end = loop.time() + gap.seconds
    while (left := end - loop.time()) > 0:
        await asyncio.sleep(min(KEEPALIVE_EVERY_S, left))
        if end - loop.time() > 0:
            # A refused keep-alive (no live lease) is not an error: the turn just misses.
            with contextlib.suppress(httpx.HTTPError):
                await client.post(f"{router_url}/v1/sessions/{session}/keepalive")
                result.keepalives += 1


async def _sample_decode(
    client: httpx.AsyncClient, decode_url: str, result: ArmResult, every_s: float = 1.0
) -> None:
    started = time.perf_counter()
    while True:
        with contextlib.suppress(httpx.HTTPError):
            text = (await client.get(f"{decode_url}/metrics", timeout=5)).text
            values = read_gauges(text, DECODE_GAUGES)
            result.decode_samples.append(
                (round(time.perf_counter() - started, 2), values["usage"], values["waiting"])
            )
        await asyncio.sleep(every_s)
