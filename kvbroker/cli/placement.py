"""``kvbroker placement``: run the placement hop for gateways (an Envoy external processor
before the fleet's own picker); defaults from PlacementConfig."""

from __future__ import annotations

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
    host_port,
    positive_seconds,
)
from kvbroker.cli.output import fail
from kvbroker.common.client.grpc_client import RegistryEndpoint
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
    log_level: LogLevelOpt = DEFAULT_LOG_LEVEL,
    log_format: LogFormatOpt = DEFAULT_LOG_FORMAT,
    *,
    endpoint: RegistryEndpoint,
) -> None:
    """Serve envoy.service.ext_proc.v3.ExternalProcessor: steer each request to the nodes
    holding its conversation's KV, or leave it unchanged."""
    from kvbroker.gateway.server import serve_forever

    config = PlacementConfig(listen=listen, mode=mode, hint_timeout_s=hint_timeout)
    apply_logging_flags(log_level, log_format)
    try:
        uvloop.run(serve_forever(endpoint, config))
    except (OSError, RuntimeError) as error:
        fail(f"cannot serve on {listen}: {error}")
