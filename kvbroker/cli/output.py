"""Rendering for people (rich tables) and scripts (JSON), and the CLI's error exits.

Everything shown comes from the registry or the command line (node ids, reasons, error
messages), so it is handed to rich as ``Text``, never as a markup string: a ``[/]`` in a node
id must print as itself, not end a style (or raise). And that text is the clients': a node id
or a conversation id may hold ESC and the other control characters, which a terminal obeys
(move the cursor, rewrite what was printed, retitle the window, write the clipboard). Every
printer here passes it through ``shown``, which writes them as escapes (``\x1b``); JSON output
is exact, its encoder escapes them already."""

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
from rich.text import Text

from kvbroker.common.client.grpc_client import AWAY_CODES, NOT_SERVING, from_grpc_error
from kvbroker.common.rules.clock import from_duration, from_timestamp
from kvbroker.common.rules.labels import label
from kvbroker.v1 import registry_pb2

# Exit codes: 0 ok, 1 the registry refused the request, 2 usage error (typer's), 3 the registry
# cannot be reached or cannot serve now (try again later), 4 a wait ran out of time.
EXIT_REJECTED = 1
EXIT_UNREACHABLE = 3
EXIT_TIMED_OUT = 4

# C0 controls (U+0000-U+001F), DEL and C1 controls (U+0080-U+009F): Unicode's Cc category,
# everything a terminal may act on rather than print.
_CONTROLS = {code: f"\\x{code:02x}" for code in (*range(0x20), *range(0x7F, 0xA0))}


def shown(text: str) -> Text:
    """``text`` ready for a terminal: as it is (no markup), its control characters written as
    ``\\xNN`` escapes."""
    return Text(text.translate(_CONTROLS))


class OutputFormat(StrEnum):
    table = "table"
    json = "json"


def fail(message: str, code: int = EXIT_REJECTED) -> NoReturn:
    """One line on stderr, ``message`` as it is (no markup), and exit ``code``."""
    Console(stderr=True).print(
        Text.assemble(("error:", "bold red"), " ", shown(message)), highlight=False, soft_wrap=True
    )
    raise typer.Exit(code)


def say(console: Console, message: str, mark: str = "dim") -> None:
    """One line of progress (or, with ``mark="red"``, a failure): a mark, then ``message``
    as it is."""
    console.print(Text.assemble(("·", mark), " ", shown(message)), highlight=False)


def fail_rpc(error: grpc.aio.AioRpcError, registry: str) -> NoReturn:
    """Exits on a failed registry call, deciding on its status and reason, never the text."""
    failure = from_grpc_error(error)
    code = failure.code()
    if failure.reason == registry_pb2.ERROR_REASON_UNSPECIFIED and code in AWAY_CODES:
        fail(
            f"cannot reach the registry at {registry} ({code.name}): {failure.message}",
            EXIT_UNREACHABLE,
        )
    why = code.name
    if failure.reason != registry_pb2.ERROR_REASON_UNSPECIFIED:
        why += f", {label(registry_pb2.ErrorReason, failure.reason)}"
    if failure.reason in NOT_SERVING:
        fail(
            f"the registry at {registry} cannot serve now: {failure.message} ({why})",
            EXIT_UNREACHABLE,
        )
    fail(f"{failure.message} ({why})")


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
        console.print(Text(empty, style="dim"))
        return
    table = Table(title=shown(title), title_justify="left", header_style="bold")
    for column in columns:
        table.add_column(column)
    for row in rows:
        table.add_row(*(shown(cell) for cell in row))
    console.print(table)


def emit_fields(title: str, fields: Sequence[tuple[str, str]]) -> None:
    table = Table(title=shown(title), title_justify="left", show_header=False, box=None)
    table.add_column(style="bold")
    table.add_column()
    for name, value in fields:
        table.add_row(shown(name), shown(value))
    Console().print(table)


def render(output: OutputFormat, payload: Any, as_table: Callable[[], None]) -> None:
    if output is OutputFormat.json:
        emit_json(payload)
    else:
        as_table()
