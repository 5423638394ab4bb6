"""Rendering for people (rich tables) and scripts (JSON), and the CLI's error exits."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any, NoReturn

import grpc
import typer
from google.protobuf.json_format import MessageToDict
from google.protobuf.message import Message
from rich.console import Console
from rich.table import Table

from kvbroker.common.clock import from_duration, from_timestamp

# Exit codes: 0 ok, 1 the registry refused the request, 2 usage error (typer's), 3 registry
# unreachable.
EXIT_REJECTED = 1
EXIT_UNREACHABLE = 3


class OutputFormat(StrEnum):
    table = "table"
    json = "json"


def fail(message: str, code: int = EXIT_REJECTED) -> NoReturn:
    Console(stderr=True).print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def fail_rpc(error: grpc.aio.AioRpcError, registry: str) -> NoReturn:
    code = error.code()
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        fail(
            f"cannot reach the registry at {registry} ({code.name}): {error.details()}",
            EXIT_UNREACHABLE,
        )
    fail(f"{error.details()} ({code.name})")


def to_dict(message: Message) -> dict[str, Any]:
    return MessageToDict(message, preserving_proto_field_name=True)


def emit_json(payload: Any) -> None:
    json.dump(payload, sys.stdout, indent=2, sort_keys=False)
    sys.stdout.write("\n")


def when(ts: Any) -> str:
    if not ts.seconds and not ts.nanos:
        return "-"
    return datetime.fromtimestamp(from_timestamp(ts), UTC).strftime("%H:%M:%S")


def seconds_left(duration: Any) -> str:
    left = from_duration(duration)
    return f"{left:.1f}s" if left else "-"


def emit_table(
    title: str, columns: Sequence[str], rows: Sequence[Sequence[str]], empty: str
) -> None:
    console = Console()
    if not rows:
        console.print(f"[dim]{empty}[/]")
        return
    table = Table(title=title, title_justify="left", header_style="bold")
    for column in columns:
        table.add_column(column)
    for row in rows:
        table.add_row(*row)
    console.print(table)


def emit_fields(title: str, fields: Sequence[tuple[str, str]]) -> None:
    table = Table(title=title, title_justify="left", show_header=False, box=None)
    table.add_column(style="bold")
    table.add_column()
    for name, value in fields:
        table.add_row(name, value)
    Console().print(table)


def render(output: OutputFormat, payload: Any, as_table: Callable[[], None]) -> None:
    if output is OutputFormat.json:
        emit_json(payload)
    else:
        as_table()
