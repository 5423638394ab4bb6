"""``kvbroker``: run each part and manage leases and nodes.

One module per command group (as etcdctl and vLLM's CLI are laid out); this one only
assembles them. Every flag has an environment variable of the same name (``--registry`` is
``KVBROKER_REGISTRY``), so deployments configure with either.

The tools' commands (the one-machine stack, the demo, the benchmarks) are not in this package:
kvbroker-tools (tools/ in the checkout) adds them through the ``kvbroker.commands`` entry
points, a typer app as a group and a function as a command. Without the tools, each of
``TOOL_COMMANDS`` is still listed, and running it says how to install them.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib.metadata import entry_points

import typer

from kvbroker.cli.calibrate import calibrate
from kvbroker.cli.hint import hint
from kvbroker.cli.lease import lease_app
from kvbroker.cli.node import node_app
from kvbroker.cli.output import fail
from kvbroker.cli.placement import placement_app
from kvbroker.cli.registry import registry_app
from kvbroker.cli.router import router_app
from kvbroker.cli.sidecar import sidecar_app
from kvbroker.cli.tenant import tenant_app

TOOL_COMMANDS_GROUP = "kvbroker.commands"
# The commands kvbroker-tools registers (tools/pyproject.toml; tests/test_wheel.py checks that
# the two lists agree), named here so that a product installed alone can say where they are.
TOOL_COMMANDS = ("up", "demo", "bench")
TOOLS_INSTALL = "pip install kvbroker-tools (from a checkout: pip install -e tools)"
# A missing tool's stand-in takes whatever follows its name, --help included.
_ANY_ARGUMENTS = {"allow_extra_args": True, "ignore_unknown_options": True}

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
app.command("hint")(hint)
app.command("calibrate")(calibrate)


def _not_installed(name: str) -> Callable[[], None]:
    def not_installed() -> None:
        fail(f"`kvbroker {name}` is one of kvbroker's tools, not installed here: {TOOLS_INSTALL}")

    return not_installed


def add_tool_commands(cli: typer.Typer) -> None:
    """The installed tools' commands; a stand-in for each of ``TOOL_COMMANDS`` they lack."""
    found = {point.name: point for point in entry_points(group=TOOL_COMMANDS_GROUP)}
    for name in [*TOOL_COMMANDS, *sorted(found.keys() - set(TOOL_COMMANDS))]:
        if name not in found:
            cli.command(
                name,
                help=f"Not installed: part of kvbroker's tools ({TOOLS_INSTALL}).",
                add_help_option=False,
                context_settings=_ANY_ARGUMENTS,
            )(_not_installed(name))
            continue
        command = found[name].load()
        if isinstance(command, typer.Typer):
            cli.add_typer(command, name=name)
        else:
            cli.command(name)(command)


add_tool_commands(app)
