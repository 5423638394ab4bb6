"""kvbroker's own servers as child processes of a test or benchmark, ready once they have
announced themselves (see kvbroker.common.process.supervisor)."""

from __future__ import annotations

from pathlib import Path

from kvbroker.common.process.ports import free_port
from kvbroker.common.process.supervisor import Announces, ChildProcess
from kvbroker_tools.stack import KVBROKER, registry_command, sidecar_command


class RegistryProcess(ChildProcess):
    """`kvbroker registry serve` with ``flags``, on a loopback port chosen once, so that it
    keeps its address when started again."""

    def __init__(
        self, *flags: str, name: str = "registry", log: Path | None = None, listen: str = ""
    ) -> None:
        self.address = listen or f"127.0.0.1:{free_port()}"
        super().__init__(name, registry_command(self.address, *flags), log, ready=[Announces()])


class PlacementProcess(ChildProcess):
    """`kvbroker placement serve` against ``registry`` with ``flags``, on a loopback port
    chosen once (``address``, what Envoy's ext_proc cluster points at)."""

    def __init__(self, registry: str, *flags: str, log: Path | None = None) -> None:
        self.address = f"127.0.0.1:{free_port()}"
        argv = [KVBROKER, "placement", "serve", "--listen", self.address, "--registry", registry]
        super().__init__("placement", [*argv, *flags], log, ready=[Announces()])


def sidecar_process(
    registry: str,
    engine_url: str,
    node_id: str,
    socket: Path,
    role: str = "decode",
    log: Path | None = None,
) -> ChildProcess:
    """`kvbroker sidecar run` for the engine at ``engine_url``, serving it on ``socket``."""
    return ChildProcess(
        f"sidecar-{node_id}",
        sidecar_command(registry, engine_url, role, node_id, socket),
        log,
        ready=[Announces()],
    )
