"""Free loopback ports for the processes a one-machine stack, test or benchmark starts, and
who holds a port when a start finds it taken.

A port is chosen now and bound later, by another process. Asking the kernel for one (binding
port 0) hands out a port from the ephemeral range, the same range every outgoing connection
takes its source port from, so on a busy machine (tests in parallel, engines and sidecars
opening connections) the port was often taken again before its server bound it: seen as a
NIXL side channel or a test server failing with "address already in use". Ports are
therefore drawn at random from below the ephemeral range, where nothing is handed out
implicitly, and checked by binding them once.

A port that binds now may still have been handed out already and not be bound yet: a
cluster's ~20 ports drawn at once met twice often enough to fail CI (two of a pod's
containers on one port, issue 43), and so could two test workers' or a stack's and its
children's. A port handed out is therefore reserved for as long as the process that drew it
lives, and never handed out again meanwhile by any kvbroker process on this machine: within
the process by a set of the ports it handed out, between processes by an exclusive lock on
the port's byte of one lock file in the temporary directory (a POSIX record lock, which the
kernel drops when its process ends: a reservation is never stale). Record locks are one
process's; one file descriptor holds them all, kept open, and nothing else in the process
may open that file (closing any descriptor of it would drop them all). Where the file cannot
be opened, reservations are the process's own.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import os
import random
import re
import socket
import tempfile
import threading
from collections.abc import Iterable
from pathlib import Path

_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
# Below this, ports are commonly taken by well-known services.
_LOWEST = 10_000
# Its own generator: a benchmark that seeds the module-level one must not make every process
# draw the same ports.
_RANDOM = random.SystemRandom()
# One for every user of the machine: a port reserved by anyone's kvbroker is skipped.
LOCK_FILE = Path(tempfile.gettempdir()) / "kvbroker-ports.lock"

_lock = threading.Lock()
# Every port this process handed out (POSIX record locks do not conflict within a process).
_handed_out: set[int] = set()


def _ephemeral_low() -> int:
    try:
        return int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768  # Linux's default


@functools.cache
def _lock_file() -> int:
    """The lock file's descriptor, opened once and kept; -1 where it cannot be opened."""
    try:
        return os.open(LOCK_FILE, os.O_RDWR)
    except FileNotFoundError:
        pass
    except OSError:
        return -1
    try:
        fd = os.open(LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError:
        return -1
    with contextlib.suppress(OSError):  # this umask must not shut other users out
        os.fchmod(fd, 0o666)
    return fd


def _reserve(port: int) -> bool:
    """Reserves ``port`` for this process; False when it is reserved already (by this process
    or another). Called with ``_lock`` held."""
    if port in _handed_out:
        return False
    fd = _lock_file()
    if fd >= 0:
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, port, os.SEEK_SET)
        except OSError as error:
            if error.errno not in (errno.EACCES, errno.EAGAIN):
                raise
            return False
    _handed_out.add(port)
    return True


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A loopback TCP port that nothing is bound to now, outside the ephemeral range, and that
    no kvbroker process on this machine was handed before (while that process lives)."""
    high = max(_ephemeral_low() - 1, _LOWEST + 1_000)
    with _lock:
        for _ in range(200):
            port = _RANDOM.randint(_LOWEST, high)
            if port not in _handed_out and _bindable(port) and _reserve(port):
                return port
        for _ in range(200):  # a crowded range: let the kernel choose
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = int(s.getsockname()[1])
            if _reserve(port):
                return port
    raise OSError(errno.EADDRINUSE, "no free loopback port found")


def who_holds(ports: Iterable[int]) -> str:
    """Who holds each of ``ports`` (local TCP ports) now, in words, for a message saying that
    a start found its address in use: each socket's process id, command line and state. Ports
    nothing holds are left out (empty: none is held). Never raises: without psutil, or without
    the right to see another user's process, it says so."""
    wanted = sorted(set(ports))
    if not wanted:
        return ""
    try:
        import psutil  # type: ignore[import-untyped]
    except ImportError:
        return f"who holds port {_listed(wanted)} is unknown: psutil is not installed"
    try:
        sockets = psutil.net_connections(kind="tcp")
    except (psutil.Error, OSError) as error:
        return f"who holds port {_listed(wanted)} is unknown: {error!r}"
    said = []
    for port in wanted:
        holders: list[str] = []
        for conn in sockets:
            if not conn.laddr or conn.laddr.port != port:
                continue
            holder = _process(conn.pid, conn.status)
            if holder not in holders:
                holders.append(holder)
        if holders:
            said.append(f"port {port} is held by {' and '.join(holders)}")
    return "; ".join(said)


def _process(pid: int | None, status: str) -> str:
    import psutil

    if pid is None:
        if status == "TIME_WAIT":
            return "a closed connection in TIME_WAIT"
        return f"a process this user cannot see ({status})"
    try:
        command = " ".join(psutil.Process(pid).cmdline())
    except psutil.Error:  # gone meanwhile, or not ours to read
        command = "?"
    return f"pid {pid} ({command[:300]}, {status})"


def _listed(ports: list[int]) -> str:
    return ", ".join(map(str, ports))


# A port as an error names it: "host:PORT" (ZMQ, etcd, gRPC, ensure_free) or "('host', PORT)"
# (uvicorn, Python's socket errors); not a clock's "12:34:56" nor a date.
_NAMED_PORT = re.compile(r"[:,] ?(\d{4,5})(?![\d.\-])")


def ports_named(text: str) -> list[int]:
    """The TCP ports ``text`` (an error's line, a command line) names as addresses."""
    return [int(found) for found in _NAMED_PORT.findall(text) if int(found) < 65_536]


def ensure_free(address: str) -> None:
    """Raises OSError (address in use, naming who holds it) when a server already listens on
    ``address`` (HOST:PORT; port 0 is always free). A gRPC server binds with SO_REUSEPORT, so
    a second one on a taken port would share it with the first instead of failing, and any
    other holder makes gRPC raise a RuntimeError that names no cause: the port is checked
    before the server binds."""
    host, _, port = address.rpartition(":")
    if int(port) == 0:
        return
    family, kind, proto, _, sockaddr = socket.getaddrinfo(
        host.strip("[]"), int(port), type=socket.SOCK_STREAM
    )[0]
    with socket.socket(family, kind, proto) as s:
        # As the server will: a port whose last connections are still in TIME_WAIT is free.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(sockaddr)
        except OSError as error:
            if error.errno != errno.EADDRINUSE:
                raise
            holders = who_holds([int(port)])
            said = f"Address already in use: {address}" + (f"; {holders}" if holders else "")
            raise OSError(errno.EADDRINUSE, said) from None
