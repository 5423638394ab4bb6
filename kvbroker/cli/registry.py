"""``kvbroker registry``: run the registry. The tunables' defaults are RegistryConfig's, so the
flags and the library cannot drift apart; the server itself is imported only when it runs, so
that the operator commands start fast."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
import uvloop

from kvbroker.cli.options import (
    DEFAULT_LOG_FORMAT,
    DEFAULT_LOG_LEVEL,
    LogFormatOpt,
    LogLevelOpt,
    MetricsListenOpt,
    TokenFileOpt,
    TokenOpt,
    apply_logging_flags,
    bearer_token,
    host_port,
    positive_seconds,
    seconds,
)
from kvbroker.cli.output import fail
from kvbroker.common.client.grpc_client import DEFAULT_REGISTRY_ADDRESS
from kvbroker.common.process.ports import ensure_free
from kvbroker.controlplane.config import RegistryConfig
from kvbroker.controlplane.placement.planner import PlannerConfig

registry_app = typer.Typer(help="Run the registry.", no_args_is_help=True)


@registry_app.command("serve")
def registry_serve(
    listen: Annotated[
        str,
        typer.Option(
            envvar="KVBROKER_LISTEN",
            callback=host_port,
            help="gRPC address HOST:PORT (port 0: any).",
        ),
    ] = DEFAULT_REGISTRY_ADDRESS,
    metrics_listen: MetricsListenOpt = None,
    token: TokenOpt = None,
    token_file: TokenFileOpt = None,
    tls_cert: Annotated[
        Path | None,
        typer.Option(
            envvar="KVBROKER_TLS_CERT", help="The registry's server certificate (PEM): serve TLS."
        ),
    ] = None,
    tls_key: Annotated[
        Path | None,
        typer.Option(envvar="KVBROKER_TLS_KEY", help="The private key of --tls-cert (PEM)."),
    ] = None,
    tls_client_ca: Annotated[
        Path | None,
        typer.Option(
            envvar="KVBROKER_TLS_CLIENT_CA",
            help="Require client certs signed by this CA (mTLS); their common name is the "
            "caller: admin, replica, router or node:NODE_ID:NODE_ROLE.",
        ),
    ] = None,
    tls_peer_ca: Annotated[
        Path | None,
        typer.Option(
            envvar="KVBROKER_TLS_PEER_CA",
            help="CA of the replicas' server certificates (default: --tls-client-ca).",
        ),
    ] = None,
    credentials: Annotated[
        Path | None,
        typer.Option(
            envvar="KVBROKER_CREDENTIALS",
            help="Per-role and per-node tokens: lines 'HOLDER SHA256_HEX', HOLDER one of "
            "admin, replica, router, node:NODE_ID:NODE_ROLE (see 'kvbroker registry "
            "credential'). A file it cannot read, or with no credential, stops the registry.",
        ),
    ] = None,
    lease_ttl: Annotated[
        float,
        typer.Option(
            envvar="KVBROKER_LEASE_TTL",
            callback=positive_seconds,
            help="Idle TTL, seconds: a lease not renewed this long ends (until one is learned).",
        ),
    ] = RegistryConfig.default_lease_ttl_s,
    learn_idle_ttl: Annotated[
        bool,
        typer.Option(
            envvar="KVBROKER_LEARN_IDLE_TTL",
            help="Learn the idle TTL from the gaps between turns (a bounded high percentile).",
        ),
    ] = RegistryConfig.learn_idle_ttl,
    min_idle_ttl: Annotated[
        float,
        typer.Option(
            envvar="KVBROKER_MIN_IDLE_TTL",
            callback=positive_seconds,
            help="Shortest learned idle TTL.",
        ),
    ] = RegistryConfig.min_idle_ttl_s,
    max_idle_ttl: Annotated[
        float,
        typer.Option(
            envvar="KVBROKER_MAX_IDLE_TTL",
            callback=positive_seconds,
            help="Longest learned idle TTL.",
        ),
    ] = RegistryConfig.max_idle_ttl_s,
    turn_settle_timeout: Annotated[
        float,
        typer.Option(
            envvar="KVBROKER_TURN_SETTLE_TIMEOUT",
            callback=seconds,
            help="A hint waits this long for the previous turn's retention, seconds.",
        ),
    ] = RegistryConfig.turn_settle_timeout_s,
    max_lease_ttl: Annotated[
        float,
        typer.Option(
            envvar="KVBROKER_MAX_LEASE_TTL",
            callback=positive_seconds,
            help="Longest TTL a call may ask.",
        ),
    ] = RegistryConfig.max_lease_ttl_s,
    claim_timeout: Annotated[
        float,
        typer.Option(
            envvar="KVBROKER_CLAIM_TIMEOUT",
            callback=positive_seconds,
            help="How long a hint protects a read.",
        ),
    ] = RegistryConfig.claim_timeout_s,
    revoke_grace: Annotated[
        float,
        typer.Option(
            envvar="KVBROKER_REVOKE_GRACE",
            callback=seconds,
            help="Blocks kept after a revoke, seconds.",
        ),
    ] = RegistryConfig.revoke_grace_s,
    heartbeat_interval: Annotated[
        float,
        typer.Option(
            envvar="KVBROKER_HEARTBEAT_INTERVAL",
            callback=positive_seconds,
            help="Sidecar heartbeat.",
        ),
    ] = RegistryConfig.heartbeat_interval_s,
    session_ttl: Annotated[
        float,
        typer.Option(
            envvar="KVBROKER_SESSION_TTL",
            callback=positive_seconds,
            help="Silence before a node is DOWN.",
        ),
    ] = RegistryConfig.session_ttl_s,
    max_local_prefill_tokens: Annotated[
        int,
        typer.Option(
            envvar="KVBROKER_MAX_LOCAL_PREFILL_TOKENS",
            min=0,
            help="The longest new suffix a decode node computes itself (the DECODE_LOCAL "
            "path); it bounds the stall its running decodes see. 0: never.",
        ),
    ] = PlannerConfig.max_local_prefill_tokens,
    store: Annotated[
        str,
        typer.Option(
            envvar="KVBROKER_STORE",
            help="'memory', or etcd://HOST:PORT[,HOST:PORT] to run as one of several replicas.",
        ),
    ] = "memory",
    advertise: Annotated[
        str | None,
        typer.Option(
            envvar="KVBROKER_ADVERTISE",
            callback=host_port,
            help="HOST:PORT other replicas forward to (default: the listen address).",
        ),
    ] = None,
    election_ttl: Annotated[
        int,
        typer.Option(
            envvar="KVBROKER_ELECTION_TTL",
            help="Seconds before a dead leader is replaced (etcd store).",
        ),
    ] = 2,
    etcd_prefix: Annotated[
        str, typer.Option(envvar="KVBROKER_ETCD_PREFIX", help="Key prefix in etcd.")
    ] = "/kvbroker",
    hint_staleness: Annotated[
        float,
        typer.Option(
            envvar="KVBROKER_HINT_STALENESS",
            help="Seconds a follower's copy of the leader's state may be behind for it to "
            "answer dry-run hints itself; further behind, it forwards them (etcd store).",
        ),
    ] = 1.0,
    log_level: LogLevelOpt = DEFAULT_LOG_LEVEL,
    log_format: LogFormatOpt = DEFAULT_LOG_FORMAT,
) -> None:
    """Serve the registry: standalone in memory, or one replica of several sharing etcd.
    Prints one JSON line with its addresses."""
    token = bearer_token(token, token_file)
    if (tls_cert is None) != (tls_key is None):
        fail("--tls-cert and --tls-key go together", 2)
    try:
        config = RegistryConfig(
            default_lease_ttl_s=lease_ttl,
            learn_idle_ttl=learn_idle_ttl,
            min_idle_ttl_s=min_idle_ttl,
            max_idle_ttl_s=max_idle_ttl,
            turn_settle_timeout_s=turn_settle_timeout,
            max_lease_ttl_s=max_lease_ttl,
            claim_timeout_s=claim_timeout,
            revoke_grace_s=revoke_grace,
            heartbeat_interval_s=heartbeat_interval,
            session_ttl_s=session_ttl,
            planner=PlannerConfig(max_local_prefill_tokens=max_local_prefill_tokens),
        )
    except ValueError as error:
        fail(str(error), 2)
    # Imported here so that the operator commands start fast.
    from kvbroker.controlplane.server import ServerOptions, TlsFiles, serve_forever
    from kvbroker.controlplane.storage.etcd_store import EtcdEndpoints

    if store != "memory":
        try:
            EtcdEndpoints.parse(store)
        except ValueError as error:
            fail(str(error), 2)
    if election_ttl < 1:
        fail("--election-ttl must be at least 1 second", 2)
    try:
        ensure_free(listen)
    except OSError as error:
        fail(f"cannot serve on {listen}: {error}")
    apply_logging_flags(log_level, log_format)
    tls = TlsFiles(tls_cert, tls_key, tls_client_ca, tls_peer_ca) if tls_cert and tls_key else None
    options = ServerOptions(
        listen=listen,
        metrics_listen=metrics_listen,
        token=token,
        credentials_file=credentials,
        tls=tls,
        config=config,
        store=store,
        advertise=advertise,
        election_ttl_s=election_ttl,
        etcd_prefix=etcd_prefix,
        hint_staleness_s=hint_staleness,
    )
    try:
        # uvloop: the registry's time is mostly event loop and gRPC per-call work, and uvloop
        # answers ~25% more calls a second than asyncio's own loop on the same core.
        uvloop.run(serve_forever(options))
    except OSError as error:
        fail(f"cannot serve on {listen}: {error}")
    except ValueError as error:
        fail(str(error), 2)


@registry_app.command("credential")
def registry_credential(
    who: Annotated[
        str,
        typer.Argument(
            help="The holder: admin, replica, router or node:NODE_ID:NODE_ROLE (NODE_ROLE: "
            "prefill, decode or both; what the node may register as)."
        ),
    ],
) -> None:
    """Print a fresh token (give it to its holder) and the line for --credentials (which
    holds only the token's SHA-256)."""
    from kvbroker.common.process.credentials import fresh_credential
    from kvbroker.controlplane.api.identity import Principal

    # The holder as the registry will read it back from the file, or refused here.
    try:
        holder = Principal.parse(who)
    except ValueError as error:
        fail(str(error), 2)
    token, line = fresh_credential(str(holder))
    typer.echo(f"token: {token}")
    typer.echo(f"line:  {line}")
