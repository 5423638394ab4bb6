"""``kvbroker tenant``: a tenant's API key and the lines for the files that accept it, and the
signed session ids its clients send where no router forwards their key
(``kvbroker.common.rules.tenants``)."""

from __future__ import annotations

from typing import Annotated

import typer

from kvbroker.cli.output import fail
from kvbroker.common.process.credentials import fresh_credential
from kvbroker.common.rules.tenants import parse_tenant, session_key, sign_session

tenant_app = typer.Typer(help="Tenants' API keys and signed session ids.", no_args_is_help=True)


@tenant_app.command("key")
def tenant_key(
    tenant: Annotated[str, typer.Argument(help="The tenant the key names.")],
) -> None:
    """Print a fresh API key for TENANT, its line for the router's (and engines', the hop's)
    --api-keys file, which holds only its SHA-256, and its line for the engines' session keys
    file, which holds a secret that signs the tenant's session ids."""
    try:
        name = parse_tenant(tenant)
    except ValueError as error:
        fail(str(error), 2)
    key, line = fresh_credential(name.name)
    typer.echo(f"key:               {key}")
    typer.echo(f"api-keys line:     {line}")
    typer.echo(f"session-keys line: {name.name} {session_key(key)}")


@tenant_app.command("session-id")
def tenant_session_id(
    session: Annotated[str, typer.Argument(help="The client's own session id.")],
    tenant: Annotated[
        str, typer.Option(envvar="KVBROKER_TENANT", help="The tenant whose key signs it.")
    ],
    api_key: Annotated[
        str,
        typer.Option(
            envvar="KVBROKER_API_KEY",
            help="The tenant's API key (give it as KVBROKER_API_KEY: a flag is visible in the "
            "process list).",
        ),
    ],
) -> None:
    """Print SESSION signed with the tenant's key, the session id to send through a router
    that forwards no client header (vllm-router): engines given the tenant's session key
    resolve it to the tenant's conversation, any other engine to none."""
    try:
        typer.echo(sign_session(api_key, parse_tenant(tenant), session))
    except ValueError as error:
        fail(str(error), 2)
