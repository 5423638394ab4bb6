"""The registry's tunables, in one place with their defaults (the CLI documents each)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RegistryConfig:
    # A lease lives this long after a grant or renewal unless the request asks for another TTL.
    default_lease_ttl_s: float = 120.0
    # No grant or renewal may ask for longer.
    max_lease_ttl_s: float = 3600.0
    # How long a hint's claim protects a lease from being freed while P may be reading it.
    claim_timeout_s: float = 30.0
    # A revoked lease's blocks stay this long so a read that just started can finish.
    revoke_grace_s: float = 2.0
    # Sidecars heartbeat this often; a node silent for session_ttl_s is marked DOWN.
    heartbeat_interval_s: float = 2.0
    session_ttl_s: float = 6.0
    # Ended leases stay visible to `lease show` this long, then are forgotten.
    ended_lease_retention_s: float = 300.0
    # A conversation with no live lease is forgotten after this long without activity.
    conversation_retention_s: float = 3600.0
    # Bad-input guards.
    max_block_hashes: int = 65_536
    max_id_length: int = 256
    # Commands queued for a node whose sidecar is not watching; older ones are dropped.
    max_pending_commands: int = 10_000
    # Expiries handled per batch before yielding to RPCs (etcd's lessor rate-limits likewise).
    max_expiries_per_batch: int = 1_000

    def __post_init__(self) -> None:
        if self.default_lease_ttl_s <= 0 or self.max_lease_ttl_s < self.default_lease_ttl_s:
            raise ValueError("need 0 < default lease TTL <= max lease TTL")
        if self.heartbeat_interval_s <= 0 or self.session_ttl_s <= self.heartbeat_interval_s:
            raise ValueError("need 0 < heartbeat interval < session TTL")
