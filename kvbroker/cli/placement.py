"""``kvbroker placement``: run the placement hop for gateways (an Envoy external processor
before the fleet's own picker); defaults from PlacementConfig."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
import uvloop

from kvbroker.cli.client import registry_flags
from kvbroker.cli.options import (
    DEFAULT_LOG_FORMAT,
    DEFAULT_LOG_LEVEL,
    LogFormatOpt,
    LogLevelOpt,
    apply_logging_flags,
    finite,
    host_port,
    positive_seconds,
)
from kvbroker.cli.output import fail
from kvbroker.common.client.grpc_client import RegistryEndpoint
from kvbroker.common.process.credentials import (
    fresh_credential,
    load_api_keys,
    load_session_keys,
    read_digest_file,
)
from kvbroker.common.rules.tenants import ScopedSessions
from kvbroker.gateway.config import Mode, PlacementConfig

placement_app = typer.Typer(
    help="Run the placement hop for gateways (Envoy ext_proc).", no_args_is_help=True
)


@placement_app.command("serve")
@registry_flags
def placement_serve(
    listen: Annotated[
        str,
        typer.Option(
            envvar="KVBROKER_PLACEMENT_LISTEN",
            callback=host_port,
            help="gRPC address HOST:PORT Envoy's ext_proc filter calls.",
        ),
    ] = PlacementConfig.listen,
    mode: Annotated[
        Mode,
        typer.Option(
            envvar="KVBROKER_PLACEMENT_MODE",
            help="pre-epp: the endpoint subset as Envoy metadata for llm-d's (or any GIE) "
            "picker, and the affinity headers; dynamo-headers: Dynamo's pin headers only.",
        ),
    ] = PlacementConfig.mode,
    hint_timeout: Annotated[
        float,
        typer.Option(
            envvar="KVBROKER_PLACEMENT_HINT_TIMEOUT",
            callback=positive_seconds,
            help="Registry deadline per request, s; past it the request goes on unchanged.",
        ),
    ] = PlacementConfig.hint_timeout_s,
    credentials: Annotated[
        Path | None,
        typer.Option(
            envvar="KVBROKER_PLACEMENT_CREDENTIALS",
            help="Tokens Envoy may call the hop with, one 'CALLER SHA256_HEX' line each (the "
            "form of the registry's --credentials; 'kvbroker placement credential CALLER' "
            "prints one); Envoy sends 'authorization: Bearer TOKEN' in its grpc_service's "
            "initial_metadata. Unset: the hop serves whoever reaches its port.",
        ),
    ] = None,
    max_hints_per_second: Annotated[
        float,
        typer.Option(
            envvar="KVBROKER_PLACEMENT_MAX_HINTS_PER_SECOND",
            callback=finite,
            min=1,
            help="Registry hints a second, at most, for the hop as a whole; past it a request "
            "goes on unchanged.",
        ),
    ] = PlacementConfig.max_hints_per_s,
    api_keys: Annotated[
        Path | None,
        typer.Option(
            envvar="KVBROKER_API_KEYS",
            help="The tenants' API keys (the router's --api-keys file, 'TENANT SHA256_HEX' "
            "lines): a session is its client's key's tenant's, and a request without a key the "
            "file holds is pinned nowhere. Unset (and no --session-keys): session headers are "
            "taken as sent.",
        ),
    ] = None,
    session_keys: Annotated[
        Path | None,
        typer.Option(
            envvar="KVBROKER_SESSION_KEYS",
            help="The tenants' session keys ('TENANT SESSION_KEY_HEX' lines, 'kvbroker tenant "
            "key'; a secret): a signed session id is its tenant's when its signature verifies.",
        ),
    ] = None,
    log_level: LogLevelOpt = DEFAULT_LOG_LEVEL,
    log_format: LogFormatOpt = DEFAULT_LOG_FORMAT,
    *,
    endpoint: RegistryEndpoint,
) -> None:
    """Serve envoy.service.ext_proc.v3.ExternalProcessor: steer each request to the nodes
    holding its conversation's KV, or leave it unchanged."""
    from kvbroker.gateway.server import serve_forever

    digests: frozenset[str] = frozenset()
    if credentials is not None:
        try:
            digests = frozenset(read_digest_file(credentials, _caller, "CALLER SHA256_HEX"))
        except ValueError as error:
            fail(str(error))
    sessions = None
    if api_keys is not None or session_keys is not None:
        try:
            sessions = ScopedSessions(
                load_api_keys(api_keys) if api_keys is not None else None,
                load_session_keys(session_keys) if session_keys is not None else None,
            )
        except ValueError as error:
            fail(str(error), 2)
    config = PlacementConfig(
        listen=listen,
        mode=mode,
        hint_timeout_s=hint_timeout,
        token_digests=digests,
        max_hints_per_s=max_hints_per_second,
        sessions=sessions,
    )
    apply_logging_flags(log_level, log_format)
    try:
        uvloop.run(serve_forever(endpoint, config))
    except (OSError, RuntimeError) as error:
        fail(f"cannot serve on {listen}: {error}")


@placement_app.command("credential")
def placement_credential(
    caller: Annotated[str, typer.Argument(help="Who calls the hop with it (e.g. envoy).")],
) -> None:
    """Print a fresh token (for Envoy's initial_metadata) and the line for --credentials
    (which holds only the token's SHA-256)."""
    try:
        token, line = fresh_credential(_caller(caller))
    except ValueError as error:
        fail(str(error), 2)
    typer.echo(f"token: {token}")
    typer.echo(f"line:  {line}")


def _caller(name: str) -> str:
    """A caller's name in the hop's credentials file: any word (it is only logged)."""
    if not name or not name.isprintable() or any(c.isspace() or c == "#" for c in name):
        raise ValueError(f"caller {name!r} must be one word without '#'")
    return name
