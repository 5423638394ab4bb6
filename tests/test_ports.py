"""Free ports come from below the kernel's ephemeral range (where outgoing connections take
their source ports, which made "address already in use" races), are free, and are never handed
out twice while the process that drew one lives (two children on one port: issue 43); a port a
server listens on is found taken before a gRPC server would share it; and a start that finds
its port taken names the process holding it."""

from __future__ import annotations

import os
import select
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvbroker.common.process import ports
from kvbroker.common.process.supervisor import (
    Answers,
    ChildProcess,
    ChildStartError,
    StartFailure,
)

ROOT = Path(__file__).resolve().parent.parent


def test_free_ports_are_bindable_and_outside_the_ephemeral_range() -> None:
    low = ports._ephemeral_low()
    drawn = {ports.free_port() for _ in range(50)}
    assert all(10_000 <= port < low for port in drawn)
    assert len(drawn) > 40  # drawn at random, not handed out in sequence
    for port in list(drawn)[:5]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def draws_first(monkeypatch: pytest.MonkeyPatch, port: int) -> None:
    """The next random draw is ``port``; those after it are random again."""
    real = ports._RANDOM.randint
    forced = iter([port])
    monkeypatch.setattr(ports._RANDOM, "randint", lambda a, b: next(forced, None) or real(a, b))


def test_a_port_drawn_twice_is_handed_out_once(monkeypatch: pytest.MonkeyPatch) -> None:
    first = ports.free_port()
    # Not bound yet (its server has not started): it binds, and before reservations the
    # second call returned it too, a birthday collision among a cluster's ~20 ports.
    with socket.socket() as s:
        s.bind(("127.0.0.1", first))
    draws_first(monkeypatch, first)
    second = ports.free_port()
    assert second != first


@pytest.fixture
def process_with_a_port() -> Iterator[tuple[subprocess.Popen[str], int]]:
    """Another process that took a port from free_port and lives until its stdin closes; the
    port is not bound by anything."""
    script = (
        "import sys; from kvbroker.common.process.ports import free_port; "
        "print(free_port(), flush=True); sys.stdin.read()"
    )
    with running(script) as (process, port):
        yield process, port


class running:
    """A Python child running ``script`` that prints one number (a port) and then lives until
    its stdin is closed: (the process, the number)."""

    def __init__(self, script: str, *args: str) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-c", script, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )

    def __enter__(self) -> tuple[subprocess.Popen[str], int]:
        assert self.process.stdout is not None
        try:
            readable, _, _ = select.select([self.process.stdout], [], [], 30)
            assert readable, "the child printed no port within 30 s"
            return self.process, int(self.process.stdout.readline())
        except BaseException:
            end(self.process)
            raise

    def __exit__(self, *exc: object) -> None:
        end(self.process)


def end(process: subprocess.Popen[str]) -> None:
    if process.stdin is not None and not process.stdin.closed:
        process.stdin.close()
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def test_a_port_another_process_took_is_not_handed_out_until_it_ends(
    monkeypatch: pytest.MonkeyPatch, process_with_a_port: tuple[subprocess.Popen[str], int]
) -> None:
    other, theirs = process_with_a_port
    with socket.socket() as s:
        s.bind(("127.0.0.1", theirs))  # free: only the other process's reservation holds it
    draws_first(monkeypatch, theirs)
    assert ports.free_port() != theirs
    end(other)
    # The kernel dropped the reservation with its process: nothing stale is left.
    draws_first(monkeypatch, theirs)
    assert ports.free_port() == theirs


LISTENS = """
import socket, sys
server = socket.socket()
server.bind(("127.0.0.1", 0))
server.listen()
print(server.getsockname()[1], flush=True)
sys.stdin.read()
"""


def test_who_holds_a_port_names_the_process_listening_on_it() -> None:
    with running(LISTENS, "--a-listener") as (holder, port):
        said = ports.who_holds([port, ports.free_port()])
        assert said.startswith(f"port {port} is held by pid {holder.pid} (")
        assert "--a-listener" in said and "LISTEN" in said
        assert said.count("is held by") == 1  # a free port is left out
    assert ports.who_holds([port]) == ""


def test_ensure_free_refuses_a_port_a_server_listens_on() -> None:
    with socket.socket() as server:
        # As a gRPC server binds: another gRPC server could share the port, this check cannot.
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        server.bind(("127.0.0.1", 0))
        server.listen()
        address = f"127.0.0.1:{server.getsockname()[1]}"
        with pytest.raises(OSError, match="in use") as error:
            ports.ensure_free(address)
        assert address in str(error.value) and f"pid {os.getpid()}" in str(error.value)
    ports.ensure_free(address)  # closed: free again
    ports.ensure_free("127.0.0.1:0")
    ports.ensure_free(f"localhost:{ports.free_port()}")


# A server that finds its port taken: ZMQ names the address and the server runs on; Python's
# own bind error names none (the port is then found in the child's command line) and it exits.
ZMQ_SAYS = """
import sys, time
print(f"zmq.error.ZMQError: Address already in use (addr='tcp://127.0.0.1:{sys.argv[1]}')",
      file=sys.stderr, flush=True)
time.sleep(120)
"""
BIND_FAILS = """
import socket, sys
socket.socket().bind(("127.0.0.1", int(sys.argv[1])))
"""


async def never() -> bool:
    return False


@pytest.mark.parametrize("script", [ZMQ_SAYS, BIND_FAILS], ids=["names its port", "exits"])
async def test_a_start_on_a_taken_port_names_who_holds_it(tmp_path: Path, script: str) -> None:
    with running(LISTENS, "--the-holder") as (holder, port):
        child = ChildProcess(
            "engine",
            [sys.executable, "-c", script, str(port)],
            tmp_path / "engine.log",
            ready=[Answers(never, "the engine healthy", within_s=60)],
        )
        try:
            with pytest.raises(ChildStartError) as error:
                await child.start()
        finally:
            await child.stop()
    assert error.value.failure is StartFailure.PORT_IN_USE
    assert error.value.holders.startswith(f"port {port} is held by pid {holder.pid} (")
    assert "--the-holder" in error.value.holders and error.value.holders in str(error.value)
