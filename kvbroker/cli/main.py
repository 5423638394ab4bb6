"""``kvbroker``: run each part and manage leases and nodes.

One module per command group (as etcdctl and vLLM's CLI are laid out); this one only
assembles them. Every flag has an environment variable of the same name (``--registry`` is
``KVBROKER_REGISTRY``), so deployments configure with either.
"""

from __future__ import annotations

import typer

from kvbroker.cli.bench import bench_app
from kvbroker.cli.calibrate import calibrate
from kvbroker.cli.hint import hint
from kvbroker.cli.lease import lease_app
from kvbroker.cli.node import node_app
from kvbroker.cli.placement import placement_app
from kvbroker.cli.registry import registry_app
from kvbroker.cli.router import router_app
from kvbroker.cli.sidecar import sidecar_app
from kvbroker.cli.stack import demo, up
from kvbroker.cli.tenant import tenant_app

app = typer.Typer(
    name="kvbroker",
    help="Control plane for multi-turn KV reuse in P/D disaggregated vLLM serving.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
app.add_typer(registry_app, name="registry")
app.add_typer(lease_app, name="lease")
app.add_typer(node_app, name="node")
app.add_typer(sidecar_app, name="sidecar")
app.add_typer(router_app, name="router")
app.add_typer(placement_app, name="placement")
app.add_typer(tenant_app, name="tenant")
app.command("up")(up)
app.command("demo")(demo)
app.add_typer(bench_app, name="bench")
app.command("hint")(hint)
app.command("calibrate")(calibrate)
