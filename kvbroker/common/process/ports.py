"""Free loopback ports for the processes a one-machine stack, test or benchmark starts.

A port is chosen now and bound later, by another process. Asking the kernel for one (binding
port 0) hands out a port from the ephemeral range, the same range every outgoing connection
takes its source port from, so on a busy machine (tests in parallel, engines and sidecars
opening connections) the port was often taken again before its server bound it: seen as a
NIXL side channel or a test server failing with "address already in use". Ports are
therefore drawn at random from below the ephemeral range, where nothing is handed out
implicitly, and checked by binding them once.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
# Below this, ports are commonly taken by well-known services.
_LOWEST = 10_000
# Its own generator: a benchmark that seeds the module-level one must not make every process
# draw the same ports.
_RANDOM = random.SystemRandom()


def _ephemeral_low() -> int:
    try:
        return int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768  # Linux's default


def free_port() -> int:
    """A loopback TCP port that nothing is bound to now, outside the ephemeral range."""
    high = max(_ephemeral_low() - 1, _LOWEST + 1_000)
    for _ in range(200):
        port = _RANDOM.randint(_LOWEST, high)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # a crowded range: let the kernel choose
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def ensure_free(address: str) -> None:
    """Raises OSError (address in use) when a server already listens on ``address`` (HOST:PORT;
    port 0 is always free). A gRPC server binds with SO_REUSEPORT, so a second one on a taken
    port would share it with the first instead of failing, and any other holder makes gRPC
    raise a RuntimeError that names no cause: the port is checked before the server binds."""
    host, _, port = address.rpartition(":")
    if int(port) == 0:
        return
    family, kind, proto, _, sockaddr = socket.getaddrinfo(
        host.strip("[]"), int(port), type=socket.SOCK_STREAM
    )[0]
    with socket.socket(family, kind, proto) as s:
        # As the server will: a port whose last connections are still in TIME_WAIT is free.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(sockaddr)
