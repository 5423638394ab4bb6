"""A single-member etcd on loopback, for the one-machine stack, the tests and the benchmarks
(the binary from Debian's etcd-server). The caller runs the process; this knows its command
line, when it answers, and which registry replica leads on it."""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path

import aetcd

from kvbroker.common.ports import free_port
from kvbroker.common.tasks import poll_until

LEADER_KEY = b"/kvbroker/leader"


@dataclass
class LocalEtcd:
    data_dir: Path
    client_port: int = field(default_factory=free_port)
    peer_port: int = field(default_factory=free_port)

    @property
    def url(self) -> str:
        """What ``kvbroker registry serve --store`` takes."""
        return f"etcd://127.0.0.1:{self.client_port}"

    def argv(self) -> list[str]:
        binary = shutil.which("etcd")
        if binary is None:
            raise RuntimeError("etcd is not installed (Debian: apt-get install etcd-server)")
        peer = f"http://127.0.0.1:{self.peer_port}"
        client = f"http://127.0.0.1:{self.client_port}"
        return [
            binary,
            "--name=kvbroker",
            f"--data-dir={self.data_dir}",
            f"--listen-client-urls={client}",
            f"--advertise-client-urls={client}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=kvbroker={peer}",
        ]

    async def wait_ready(self, within_s: float = 30.0) -> None:
        await poll_until(self._answers, within_s, f"etcd serving on {self.url}")

    async def _answers(self) -> bool:
        await self.leader()
        return True

    async def leader(self) -> str:
        """The registry replica that leads now, as etcd says ("" while none does)."""
        async with aetcd.Client(port=self.client_port, timeout=2) as client:
            found = await client.get(LEADER_KEY)
            return found.value.decode() if found is not None else ""
