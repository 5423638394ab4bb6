"""A single-member etcd on loopback, for the one-machine stack, the tests and the benchmarks
(the binary from Debian's etcd-server), run as a child process: ready when it answers, and able
to say which registry replica leads on it, or to hang and resume it (SIGSTOP, SIGCONT: an etcd
that keeps its connections open and answers nothing, the fault that a dead one does not show)."""

from __future__ import annotations

import asyncio
import shutil
import signal
from pathlib import Path

import aetcd

from kvbroker.common.process.ports import free_port
from kvbroker.common.process.supervisor import Answers, ChildProcess
from kvbroker.common.process.tasks import poll_until

LEADER_KEY = b"/kvbroker/leader"


class LocalEtcd:
    def __init__(self, workdir: Path) -> None:
        """Its data goes to ``workdir/etcd``, its log to ``workdir/etcd.log``."""
        self.client_port = free_port()
        self.peer_port = free_port()
        self.child = ChildProcess(
            "etcd",
            self._argv(workdir / "etcd"),
            workdir / "etcd.log",
            ready=[Answers(self._answers, f"etcd serving on {self.url}", within_s=30)],
        )

    @property
    def url(self) -> str:
        """What ``kvbroker registry serve --store`` takes."""
        return f"etcd://127.0.0.1:{self.client_port}"

    async def start(self) -> None:
        """Starts it (again, after a stop: same ports, same data) and waits until it answers."""
        await self.child.start()

    async def stop(self) -> None:
        await self.child.stop()

    async def hang(self) -> None:
        """Stops it (SIGSTOP) and returns once every thread of it has stopped, so that no call
        made from then on is answered until ``resume``."""
        self.child.kill(signal.SIGSTOP)
        await poll_until(lambda: asyncio.to_thread(self._stopped), 5, "etcd stopped", every_s=0.01)

    def resume(self) -> None:
        self.child.kill(signal.SIGCONT)

    def _stopped(self) -> bool:
        threads = Path(f"/proc/{self.child.pid}/task")
        # /proc/PID/task/TID/stat: "TID (comm) STATE ..."; T is stopped by a signal.
        return all(
            (thread / "stat").read_text().rpartition(")")[2].split()[0] == "T"
            for thread in threads.iterdir()
        )

    def _argv(self, data_dir: Path) -> list[str]:
        binary = shutil.which("etcd")
        if binary is None:
            raise RuntimeError("etcd is not installed (Debian: apt-get install etcd-server)")
        peer = f"http://127.0.0.1:{self.peer_port}"
        client = f"http://127.0.0.1:{self.client_port}"
        return [
            binary,
            "--name=kvbroker",
            f"--data-dir={data_dir}",
            f"--listen-client-urls={client}",
            f"--advertise-client-urls={client}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=kvbroker={peer}",
        ]

    async def _answers(self) -> bool:
        await self.leader()
        return True

    async def leader(self) -> str:
        """The registry replica that leads now, as etcd says ("" while none does)."""
        async with aetcd.Client(port=self.client_port, timeout=2) as client:
            found = await client.get(LEADER_KEY)
            return found.value.decode() if found is not None else ""
