"""The placement hop's settings with their defaults, apart from the server so that the CLI can
show them as its flags' defaults without importing gRPC's server side."""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum

from kvbroker.common.rules.tenants import ScopedSessions

# The gRPC service Envoy's ext_proc filter calls.
EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
# The dynamic metadata namespace GIE's endpoint-picker protocol reads the endpoint subset an
# earlier filter restricts the picker to (key ``x-gateway-destination-endpoint-subset``).
SUBSET_NAMESPACE = "envoy.lb.subset_hint"


class Mode(StrEnum):
    """What the hop writes on a request whose conversation holds KV somewhere."""

    # llm-d (and any GIE endpoint picker): the endpoint subset as Envoy dynamic metadata, for
    # the picker's ext_proc to read, plus the affinity headers.
    PRE_EPP = "pre-epp"
    # Dynamo's frontend: its pin headers only.
    DYNAMO_HEADERS = "dynamo-headers"


@dataclass(frozen=True)
class PlacementConfig:
    # Where the external processor's gRPC server listens, HOST:PORT.
    listen: str = "127.0.0.1:9002"
    # What the hop writes: the subset hint for a GIE picker, or Dynamo's pin headers.
    mode: Mode = Mode.PRE_EPP
    # The registry's deadline for one hint. Past it the request goes on unchanged (the
    # fleet's router places it as it would): the hop sits on every request's path, so it
    # waits tens of milliseconds at most.
    hint_timeout_s: float = 0.02
    # SHA-256 digests (hex) of the tokens a caller may present as ``authorization: Bearer
    # TOKEN`` metadata (Envoy's ``grpc_service.initial_metadata``); empty: the hop is open, as
    # on loopback development, and trusts whoever reaches its port.
    token_digests: frozenset[str] = frozenset()
    # At most this many registry hints a second, the hop as a whole: past it a request goes on
    # unchanged (no pin), so a flood of requests never becomes a flood of registry calls.
    max_hints_per_s: float = 2000.0
    # The tenant rule for the clients' session ids (the router's keys file, the engines'
    # session keys): a session is asked about as its tenant's conversation, and a request
    # whose session neither a key nor a signature vouches for goes on unchanged. None: the
    # session header is the conversation id as sent (clients the gateway trusts).
    sessions: ScopedSessions | None = None

    def __post_init__(self) -> None:
        for name in ("hint_timeout_s", "max_hints_per_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a positive number, not {value}")
