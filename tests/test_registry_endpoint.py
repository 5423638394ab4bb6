"""Reading ``--registry`` (``RegistryEndpoint.parse``) and the gRPC target a channel gets from
it: names, IPv4 and bracketed IPv6 addresses, alone or in a failover list."""

from __future__ import annotations

import pytest

from kvbroker.common.grpc_client import RegistryEndpoint


@pytest.mark.parametrize(
    ("spec", "target"),
    [
        ("localhost:7070", "localhost:7070"),  # one address: gRPC resolves it, again and again
        ("registry-0.registry.svc:7070", "registry-0.registry.svc:7070"),
        ("[::1]:7070", "[::1]:7070"),
        ("localhost:7070,localhost:7071", "ipv4:127.0.0.1:7070,127.0.0.1:7071"),
        (" 127.0.0.1:7070 , localhost:7071 ", "ipv4:127.0.0.1:7070,127.0.0.1:7071"),
        ("localhost:7070,127.0.0.1:7070", "ipv4:127.0.0.1:7070"),
        ("[::1]:7070,[::1]:7071", "ipv6:[::1]:7070,[::1]:7071"),
        # A name that does not resolve now is left out; the others still serve.
        ("no-such-host.invalid:7070,localhost:7071", "ipv4:127.0.0.1:7071"),
        # None resolves: the first, for gRPC to resolve on each call and to say why it cannot.
        ("no-such-host.invalid:7070,gone.invalid:7071", "no-such-host.invalid:7070"),
    ],
)
def test_names_and_addresses_make_a_target(spec: str, target: str) -> None:
    assert RegistryEndpoint.parse(spec).target() == target


def test_an_ipv6_only_entry_is_left_out_of_an_ipv4_list() -> None:
    assert RegistryEndpoint.parse("[::1]:7070,127.0.0.1:7071").target() == "ipv4:127.0.0.1:7071"


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
