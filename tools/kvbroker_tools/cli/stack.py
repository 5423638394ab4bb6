"""``kvbroker up`` and ``kvbroker demo``: the whole stack on this machine, and the one way to
run it under a command (signals, progress, always stopped) that the benchmarks use too. The
stack is imported only when it runs, so that the operator commands start fast."""

from __future__ import annotations

import asyncio
import json
import signal
from collections.abc import Awaitable, Callable
from enum import StrEnum
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console

from kvbroker.cli.options import TokenFileOpt, TokenOpt, bearer_token
from kvbroker.cli.output import fail, say

if TYPE_CHECKING:
    from kvbroker_tools.stack import Stack


class Switch(StrEnum):
    on = "on"
    off = "off"


def up(
    reuse: Annotated[Switch, typer.Option(help="KV reuse across turns.")] = Switch.on,
    model: Annotated[
        Path | None,
        typer.Option(help="A model directory [default: the generated test model]."),
    ] = None,
    workdir: Annotated[Path, typer.Option(help="Sockets and logs of every process.")] = Path(
        "/tmp/kvbroker-up"
    ),
    replicas: Annotated[
        int,
        typer.Option(min=1, help="Registry replicas; more than one also starts an etcd."),
    ] = 1,
    token: TokenOpt = None,
    token_file: TokenFileOpt = None,
    kv_events: Annotated[
        Switch,
        typer.Option(
            help="vLLM's KV cache events from every engine, over ZMQ on an ipc socket in "
            "--workdir each (the JSON line lists them under kv_events)."
        ),
    ] = Switch.off,
    retain_sessionless: Annotated[
        Switch,
        typer.Option(
            help="Turns sent with no session id retained too, under an id the router names, "
            "so a client's next turn reuses them by content (the router's "
            "--retain-sessionless)."
        ),
    ] = Switch.on,
) -> None:
    """Start registry, prefill and decode vLLM servers with sidecars, and the router, on this
    machine; print one JSON line when ready; stop everything on Ctrl-C or SIGTERM."""

    async def serve(stack: Stack, console: Console) -> None:
        print(json.dumps(stack.describe()), flush=True)
        await asyncio.Event().wait()  # until a signal

    run_with_stack(
        reuse is Switch.on, model, workdir, serve, Console(stderr=True), replicas,
        bearer_token(token, token_file), kv_events=kv_events is Switch.on,
        retain_sessionless=retain_sessionless is Switch.on,
    )  # fmt: skip


def run_with_stack(
    reuse: bool,
    model: Path | None,
    workdir: Path,
    body: Callable[[Stack, Console], Awaitable[None]],
    console: Console | None = None,
    replicas: int = 1,
    token: str | None = None,
    prefill_prefix_caching: bool = False,
    kv_events: bool = False,
    retain_sessionless: bool = False,
) -> None:
    """Starts the stack, runs ``body(stack, console)``, and always stops the stack: when the
    body ends, fails, or Ctrl-C / SIGTERM arrives (also while the engines are starting).
    ``retain_sessionless`` is off unless asked: the demo and the benchmarks send turns without
    a session id as their reuse-off arm."""
    from kvbroker_tools.stack import Stack, StackConfig

    console = console or Console()

    async def until_signal(work: Awaitable[None], stop: asyncio.Event) -> None:
        task = asyncio.ensure_future(work)
        waiter = asyncio.ensure_future(stop.wait())
        await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        else:
            task.result()

    async def run() -> None:
        stack = Stack(
            StackConfig(
                workdir=workdir,
                model_dir=model,
                reuse=reuse,
                registry_replicas=replicas,
                token=token,
                prefill_prefix_caching=prefill_prefix_caching,
                kv_events=kv_events,
                retain_sessionless=retain_sessionless,
            ),
            progress=partial(say, console),
        )
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        try:
            with console.status("starting the stack"):
                await until_signal(stack.start(), stop)
            if not stop.is_set():
                say(console, f"stack ready: router {stack.router_url}")
                await until_signal(body(stack, console), stop)
        finally:
            say(console, "stopping the stack")
            await stack.stop()

    try:
        asyncio.run(run())
    except (RuntimeError, TimeoutError) as error:
        fail(str(error))


def demo(
    model: Annotated[Path | None, typer.Option(help="A model directory.")] = None,
    workdir: Annotated[Path, typer.Option(help="Sockets and logs.")] = Path("/tmp/kvbroker-demo"),
) -> None:
    """Start the stack and run a scripted agent session with reuse and without."""
    from kvbroker_tools.demo import run_demo

    run_with_stack(True, model, workdir, run_demo)
