"""Reading ``--registry`` (``RegistryEndpoint.parse``): names, IPv4 and bracketed IPv6
addresses, alone or in a failover list (tests/test_registry_failover.py: the list in use)."""

from __future__ import annotations

import pytest

from kvbroker.common.client.grpc_client import RegistryEndpoint


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("", "no registry address given"),
        ("localhost:7070,,localhost:7071", "has an empty entry"),
        ("localhost:7070,", "has an empty entry"),
        ("localhost", "'localhost' is not HOST:PORT"),
        ("localhost:0", "'localhost:0' is not HOST:PORT"),
        ("localhost:65536", "is not HOST:PORT"),
        ("localhost:http", "is not HOST:PORT"),
        ("http://localhost:7070", "'http://localhost:7070' is not HOST:PORT"),
        ("::1:7070", "an IPv6 address in brackets"),
        ("[localhost]:7070", "is not HOST:PORT"),
        ("bad_host name:7070", "is not HOST:PORT"),
        ("-registry:7070", "is not HOST:PORT"),
        ("localhost:7070;localhost:7071", "is not HOST:PORT"),
    ],
)
def test_a_malformed_list_is_refused_with_a_sentence(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[")):
        RegistryEndpoint.parse(spec)
