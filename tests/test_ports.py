"""Free ports come from below the kernel's ephemeral range (where outgoing connections take
their source ports, which made "address already in use" races), and are free; a port a server
listens on is found taken before a gRPC server would share it."""

from __future__ import annotations

import socket

import pytest

from kvbroker.common.process import ports


def test_free_ports_are_bindable_and_outside_the_ephemeral_range() -> None:
    low = ports._ephemeral_low()
    drawn = {ports.free_port() for _ in range(50)}
    assert all(10_000 <= port < low for port in drawn)
    assert len(drawn) > 40  # drawn at random, not handed out in sequence
    for port in list(drawn)[:5]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_ensure_free_refuses_a_port_a_server_listens_on() -> None:
    with socket.socket() as server:
        # As a gRPC server binds: another gRPC server could share the port, this check cannot.
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        server.bind(("127.0.0.1", 0))
        server.listen()
        address = f"127.0.0.1:{server.getsockname()[1]}"
        with pytest.raises(OSError, match="in use"):
            ports.ensure_free(address)
    ports.ensure_free(address)  # closed: free again
    ports.ensure_free("127.0.0.1:0")
    ports.ensure_free(f"localhost:{ports.free_port()}")
