"""Free ports come from below the kernel's ephemeral range (where outgoing connections take
their source ports, which made "address already in use" races), and are free."""

from __future__ import annotations

import socket

from kvbroker.common import ports


def test_free_ports_are_bindable_and_outside_the_ephemeral_range() -> None:
    low = ports._ephemeral_low()
    drawn = {ports.free_port() for _ in range(50)}
    assert all(10_000 <= port < low for port in drawn)
    assert len(drawn) > 40  # drawn at random, not handed out in sequence
    for port in list(drawn)[:5]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
