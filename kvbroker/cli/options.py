"""Flags that several commands share, declared once so that each reads and documents the same
way everywhere (every flag also has its ``KVBROKER_*`` environment variable)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, cast

import typer

from kvbroker.cli.output import OutputFormat, fail
from kvbroker.common.logging import LogFormat, configure_logging

# Where `registry serve` listens and the other commands look for it, unless told otherwise.
DEFAULT_REGISTRY = "127.0.0.1:7070"

RegistryOpt = Annotated[
    str,
    typer.Option(
        "--registry",
        envvar="KVBROKER_REGISTRY",
        help="Registry address HOST:PORT (several, comma-separated, to fail over).",
    ),
]
TokenOpt = Annotated[
    str | None,
    typer.Option("--token", envvar="KVBROKER_TOKEN", help="Bearer token for the registry."),
]
TlsCaOpt = Annotated[
    Path | None,
    typer.Option(
        "--tls-ca", envvar="KVBROKER_TLS_CA", help="CA bundle to verify the registry's TLS."
    ),
]
OutputOpt = Annotated[
    OutputFormat,
    typer.Option("--output", "-o", envvar="KVBROKER_OUTPUT", help="table for people, json."),
]
TimeoutOpt = Annotated[
    float,
    typer.Option("--timeout", envvar="KVBROKER_TIMEOUT", help="Deadline per call, seconds."),
]
DEFAULT_TIMEOUT_S = 5.0
MetricsListenOpt = Annotated[
    str | None,
    typer.Option(envvar="KVBROKER_METRICS_LISTEN", help="Prometheus HTTP HOST:PORT."),
]
LogLevelOpt = Annotated[str, typer.Option(envvar="KVBROKER_LOG_LEVEL")]
DEFAULT_LOG_LEVEL = "info"
LogFormatOpt = Annotated[
    str, typer.Option(envvar="KVBROKER_LOG_FORMAT", help="auto, json or console.")
]
DEFAULT_LOG_FORMAT = "auto"


def apply_logging_flags(level: str, fmt: str) -> None:
    """Checks --log-level and --log-format (exit 2 when wrong), then configures logging."""
    if fmt not in ("auto", "json", "console"):
        fail("--log-format is auto, json or console", 2)
    if level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
        fail("--log-level is debug, info, warning, error or critical", 2)
    configure_logging(level, cast(LogFormat, fmt))
