"""``kvbroker router``: run the KV-aware OpenAI-compatible proxy; defaults from RouterConfig."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import structlog
import typer

from kvbroker.cli.client import registry_flags
from kvbroker.cli.options import (
    DEFAULT_LOG_FORMAT,
    DEFAULT_LOG_LEVEL,
    LogFormatOpt,
    LogLevelOpt,
    apply_logging_flags,
    positive_seconds,
    seconds,
)
from kvbroker.cli.output import fail
from kvbroker.common.client.grpc_client import RegistryEndpoint
from kvbroker.router.config import RouterConfig

router_app = typer.Typer(help="Run the KV-aware OpenAI-compatible proxy.", no_args_is_help=True)


@router_app.command("run")
@registry_flags
def router_run(
    listen: Annotated[
        str, typer.Option(envvar="KVBROKER_ROUTER_LISTEN", help="HTTP address HOST:PORT.")
    ] = RouterConfig.listen,
    hint_timeout: Annotated[
        float,
        typer.Option(
            envvar="KVBROKER_HINT_TIMEOUT",
            callback=positive_seconds,
            help="Registry deadline per hint, s (a hint never waits past it).",
        ),
    ] = RouterConfig.hint_timeout_s,
    ready_node_wait: Annotated[
        float,
        typer.Option(
            envvar="KVBROKER_READY_NODE_WAIT",
            callback=seconds,
            help="How long a request waits for a ready node before a 503, s (0: no wait).",
        ),
    ] = RouterConfig.ready_node_wait_s,
    connect_timeout: Annotated[
        float,
        typer.Option(
            envvar="KVBROKER_ROUTER_CONNECT_TIMEOUT",
            callback=positive_seconds,
            help="How long connecting to an engine may take before it counts as unreachable, s.",
        ),
    ] = RouterConfig.connect_timeout_s,
    prefill_timeout: Annotated[
        float,
        typer.Option(
            envvar="KVBROKER_ROUTER_PREFILL_TIMEOUT",
            callback=positive_seconds,
            help="How long a prefill node may take to answer before the leg goes to another "
            "prefill node (504 when there is none), s.",
        ),
    ] = RouterConfig.prefill_timeout_s,
    decode_timeout: Annotated[
        float,
        typer.Option(
            envvar="KVBROKER_ROUTER_DECODE_TIMEOUT",
            callback=positive_seconds,
            help="How long a decode node may go silent (the whole answer when not streaming, "
            "between chunks when streaming) before a 504 or an error event, s.",
        ),
    ] = RouterConfig.decode_timeout_s,
    max_body_bytes: Annotated[
        int,
        typer.Option(
            envvar="KVBROKER_ROUTER_MAX_BODY_BYTES",
            help="Largest request body accepted; a larger one gets 413.",
        ),
    ] = RouterConfig.max_body_bytes,
    retain_sessionless: Annotated[
        bool,
        typer.Option(
            envvar="KVBROKER_RETAIN_SESSIONLESS",
            help="Retain turns that come without a session id under an id the router names "
            "(in the answer's x-kvbroker-session-id header), so a client's next sessionless "
            "turn reads them back by content; --no-retain-sessionless serves them plain P/D.",
        ),
    ] = RouterConfig.retain_sessionless,
    local_hints: Annotated[
        bool,
        typer.Option(
            envvar="KVBROKER_ROUTER_LOCAL_HINTS",
            help="Answer placement (dry-run) hints from this router's own copy of the "
            "registry leader's hint state, watched from the registry, while it is at most "
            "--hint-staleness behind; turns' hints (which claim leases) always ask the "
            "registry. Needs a credential that may watch the hint state.",
        ),
    ] = RouterConfig.local_hints,
    hint_staleness: Annotated[
        float,
        typer.Option(
            envvar="KVBROKER_HINT_STALENESS",
            callback=positive_seconds,
            help="With --local-hints: seconds the router's copy may be behind the leader "
            "for it to answer a placement hint itself; further behind, it asks the registry.",
        ),
    ] = RouterConfig.hint_staleness_s,
    api_keys: Annotated[
        Path | None,
        typer.Option(
            envvar="KVBROKER_API_KEYS",
            exists=True,
            dir_okay=False,
            readable=True,
            help="Require an API key (Authorization: Bearer KEY) on every /v1 request and "
            "scope session ids to its tenant: lines 'TENANT SHA256_HEX'. Without it any "
            "client may use any session: let only trusted clients reach the router.",
        ),
    ] = None,
    log_level: LogLevelOpt = DEFAULT_LOG_LEVEL,
    log_format: LogFormatOpt = DEFAULT_LOG_FORMAT,
    *,
    endpoint: RegistryEndpoint,
) -> None:
    """Serve /v1/chat/completions and /v1/completions, routing turns by the registry."""
    config = RouterConfig(
        listen=listen,
        hint_timeout_s=hint_timeout,
        ready_node_wait_s=ready_node_wait,
        connect_timeout_s=connect_timeout,
        prefill_timeout_s=prefill_timeout,
        decode_timeout_s=decode_timeout,
        max_body_bytes=max_body_bytes,
        retain_sessionless=retain_sessionless,
        local_hints=local_hints,
        hint_staleness_s=hint_staleness,
    )
    try:
        config.host_and_port()
    except ValueError:
        fail(f"--listen {listen!r} is not HOST:PORT", 2)
    from kvbroker.common.process.credentials import load_api_keys
    from kvbroker.router.server import serve as serve_router

    keys = None
    if api_keys is not None:
        try:
            keys = load_api_keys(api_keys)
        except ValueError as error:  # a malformed line, or not text at all
            fail(f"--api-keys: {error}", 2)
    apply_logging_flags(log_level, log_format)
    if keys is None and config.host_and_port()[0] not in ("127.0.0.1", "localhost", "[::1]"):
        structlog.get_logger("kvbroker.router").warning(
            "router_open",
            listen=listen,
            why="no --api-keys: any client reaching the router may close, keep alive or "
            "probe any session; let only trusted clients reach it",
        )
    serve_router(endpoint, config, keys)
