"""Flags that several commands share, declared once so that each reads and documents the same
way everywhere (every flag also has its ``KVBROKER_*`` environment variable), and the checks
that turn a bad value into a usage error (exit 2) before anything runs."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, cast

import typer

from kvbroker.cli.output import OutputFormat, fail
from kvbroker.common.process.logging import LogFormat, configure_logging
from kvbroker.common.process.tls_files import TlsFileError, check_certificates

# The longest duration a flag may give (ten years): protobuf Durations and gRPC deadlines
# overflow not far above it, and nothing the registry keeps or a call waits for is longer.
MAX_SECONDS = 10 * 365 * 24 * 3600


def finite(value: float | None) -> float | None:
    """A typer callback: refuses inf and nan, which min= and max= let through."""
    if value is not None and not math.isfinite(value):
        raise typer.BadParameter(f"{value} is not a finite number")
    return value


def seconds(value: float | None) -> float | None:
    """A typer callback for durations: finite, from 0 to MAX_SECONDS."""
    checked = finite(value)
    if checked is not None and not 0 <= checked <= MAX_SECONDS:
        raise typer.BadParameter(f"{checked} is not between 0 and {MAX_SECONDS} seconds")
    return checked


def positive_seconds(value: float | None) -> float | None:
    """A typer callback for durations that must pass: above 0 (min= cannot exclude 0)."""
    checked = seconds(value)
    if checked == 0:
        raise typer.BadParameter("0 is not above 0 seconds")
    return checked


def host_port(value: str | None) -> str | None:
    """A typer callback for listen addresses: HOST:PORT, the port a number below 65536."""
    if value:
        host, sep, port = value.rpartition(":")
        if not sep or not host or not port.isdigit() or int(port) > 65535:
            raise typer.BadParameter(f"{value!r} is not HOST:PORT")
    return value


def pem_certificates(value: Path | None) -> Path | None:
    """A typer callback for --tls-ca: a file of PEM certificates (with anything else gRPC
    fails every call with a handshake error that reads like an unreachable registry)."""
    if value is not None:
        try:
            check_certificates(value, "certificate")
        except TlsFileError as error:
            raise typer.BadParameter(str(error)) from None
    return value


def pem_private_key(value: Path | None) -> Path | None:
    """A typer callback for --tls-client-key: a file holding a PEM private key."""
    if value is not None and b"PRIVATE KEY-----" not in value.read_bytes():
        raise typer.BadParameter(f"{str(value)!r} holds no PEM private key")
    return value


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
    typer.Option(
        "--token",
        envvar="KVBROKER_TOKEN",
        help="Bearer token for the registry (visible in the process list: prefer "
        "KVBROKER_TOKEN or --token-file).",
    ),
]
TokenFileOpt = Annotated[
    Path | None,
    typer.Option(
        "--token-file",
        envvar="KVBROKER_TOKEN_FILE",
        exists=True,
        dir_okay=False,
        readable=True,
        help="A file holding the bearer token (instead of --token).",
    ),
]
TlsCaOpt = Annotated[
    Path | None,
    typer.Option(
        "--tls-ca",
        envvar="KVBROKER_TLS_CA",
        exists=True,
        dir_okay=False,
        readable=True,
        callback=pem_certificates,
        help="CA bundle to verify the registry's TLS.",
    ),
]
# A client certificate for a registry that requires one (mTLS); its common name says who the
# caller is (admin, router, node:NODE_ID). Not --tls-cert/--tls-key, which are `registry
# serve`'s own server certificate (KVBROKER_TLS_CERT/KEY): an environment that sets both for a
# registry must not hand its server certificate to a client by accident, or the reverse.
TlsClientCertOpt = Annotated[
    Path | None,
    typer.Option(
        "--tls-client-cert",
        envvar="KVBROKER_TLS_CLIENT_CERT",
        exists=True,
        dir_okay=False,
        readable=True,
        callback=pem_certificates,
        help="Client certificate to present to a registry that requires one (mTLS; with "
        "--tls-client-key and --tls-ca). Its common name is the caller's role.",
    ),
]
TlsClientKeyOpt = Annotated[
    Path | None,
    typer.Option(
        "--tls-client-key",
        envvar="KVBROKER_TLS_CLIENT_KEY",
        exists=True,
        dir_okay=False,
        readable=True,
        callback=pem_private_key,
        help="The private key of --tls-client-cert.",
    ),
]
OutputOpt = Annotated[
    OutputFormat,
    typer.Option("--output", "-o", envvar="KVBROKER_OUTPUT", help="table for people, json."),
]
TimeoutOpt = Annotated[
    float,
    typer.Option(
        "--timeout",
        envvar="KVBROKER_TIMEOUT",
        callback=positive_seconds,
        help="Deadline per call, s.",
    ),
]
DEFAULT_TIMEOUT_S = 5.0
MetricsListenOpt = Annotated[
    str | None,
    typer.Option(
        envvar="KVBROKER_METRICS_LISTEN", callback=host_port, help="Prometheus HTTP HOST:PORT."
    ),
]
LogLevelOpt = Annotated[
    str,
    typer.Option(envvar="KVBROKER_LOG_LEVEL", help="debug, info, warning, error or critical."),
]
DEFAULT_LOG_LEVEL = "info"
LogFormatOpt = Annotated[
    str, typer.Option(envvar="KVBROKER_LOG_FORMAT", help="auto, json or console.")
]
DEFAULT_LOG_FORMAT = "auto"


def bearer_token(token: str | None, token_file: Path | None) -> str | None:
    """The token --token or --token-file gives (exit 2 when both do, or the file is empty)."""
    if token_file is None:
        return token
    if token:
        fail("give --token or --token-file, not both", 2)
    read = token_file.read_text().strip()
    if not read:
        fail(f"--token-file {str(token_file)!r} is empty", 2)
    return read


def apply_logging_flags(level: str, fmt: str) -> None:
    """Checks --log-level and --log-format (exit 2 when wrong), then configures logging."""
    if fmt not in ("auto", "json", "console"):
        fail("--log-format is auto, json or console", 2)
    if level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
        fail("--log-level is debug, info, warning, error or critical", 2)
    configure_logging(level, cast(LogFormat, fmt))
