"""The registry's tunables, in one place with their defaults (the CLI documents each)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvbroker.common.rules import ids
from kvbroker.controlplane.placement.planner import PlannerConfig
from kvbroker.controlplane.sessions.idle_ttl import IdleTtlConfig

# etcd's default --max-request-bytes is 1.5 MiB; ``EtcdBackend`` keeps 0.5 MiB of it for a
# transaction's framing, and a record needs room for its key.
MAX_RECORD_BYTES = (1 << 20) - 4096
# gRPC's default limit on a message a client receives: every answer must fit in it, whatever
# the records it lists.
GRPC_MAX_RECEIVE_BYTES = 4 * 1024 * 1024
# The most hint requests one BatchGetRoutingHints may carry.
MAX_HINT_BATCH = 1000
# A batch's requests answered after its byte budget ran out each get a short BATCH_FULL error
# (a status code, a reason and a sentence of ~50 bytes): room for each, generously.
BATCH_FULL_RESULT_BYTES = 128


@dataclass(frozen=True)
class RegistryConfig:
    # The idle TTL: a lease lives this long after a grant or renewal unless the request asks
    # for another TTL, until the registry has learned one from the gaps between turns.
    default_lease_ttl_s: float = 60.0
    # Learn the idle TTL from the gaps between a conversation's turns (off: always the
    # default above).
    learn_idle_ttl: bool = True
    # The learned idle TTL is this percentile of the recent gaps between turns: high, so that
    # nearly every conversation that comes back finds its lease.
    idle_ttl_percentile: float = 0.95
    # The shortest idle TTL learning may set.
    min_idle_ttl_s: float = 10.0
    # The longest idle TTL learning may set (and never over max_lease_ttl_s).
    max_idle_ttl_s: float = 600.0
    # A hint for a conversation whose previous turn is still finishing on its decode node (the
    # lease it read is consumed, the new retention not reported yet) waits up to this long
    # for that retention, so back-to-back turns find the latest KV; never longer than half the
    # time the hint's caller has left (``turns.wait_budget``), and never for a decode node
    # that does not retain.
    turn_settle_timeout_s: float = 1.0
    # A turn whose decode node reported neither its retention nor its end this long after its
    # hint is forgotten: no hint waits for it, and the node may no longer lease the
    # conversation for it. Above the router's decode timeout (the longest a turn is served).
    turn_timeout_s: float = 900.0
    # No grant or renewal may ask for longer.
    max_lease_ttl_s: float = 3600.0
    # How long a hint's claim protects a lease from being freed while P may be reading it.
    claim_timeout_s: float = 30.0
    # A revoked lease's blocks stay this long so a read that just started can finish.
    revoke_grace_s: float = 2.0
    # Sidecars heartbeat this often.
    heartbeat_interval_s: float = 2.0
    # A node silent this long is marked DOWN and its leases are withdrawn (NODE_LOST).
    session_ttl_s: float = 6.0
    # A draining node is drained once a heartbeat this long after its drain began, and after
    # its last lease ended, reports no request running (``NodeSessions.drained``).
    drain_quiet_s: float = 0.5
    # A node DOWN this long (its pod gone, say, and another with a new name in its place) is
    # forgotten: its record, its runtime and its metric series.
    forget_down_nodes_after_s: float = 3600.0
    # Ended leases stay visible to `lease show` this long, then are forgotten.
    ended_lease_retention_s: float = 300.0
    # A conversation with no live lease is forgotten after this long without activity.
    conversation_retention_s: float = 3600.0
    # Bad-input guard: the most prefix hashes (one per KV block) a request may carry.
    max_block_hashes: int = 65_536
    # Bad-input guard: the longest id (node, conversation, lease, request) a request may carry.
    max_id_length: int = ids.MAX_ID_LENGTH
    # Free text a request carries (a reason, a model name, a URL), in bytes as stored.
    max_text_bytes: int = 2048
    # The largest record (a lease with its block hashes) the registry stores: below one write
    # of etcd at its default --max-request-bytes (1.5 MiB, of which ``EtcdBackend`` counts
    # 1 MiB for keys and values), so no record can be refused by the store. Larger input is
    # refused with INVALID_ARGUMENT, whatever the store.
    max_record_bytes: int = 1_000_000
    # Commands queued for a node whose sidecar is not watching; older ones are dropped.
    max_pending_commands: int = 10_000
    # Expiries handled per batch before yielding to RPCs (etcd's lessor rate-limits likewise).
    max_expiries_per_batch: int = 1_000
    # How each turn's path is chosen (controlplane/placement/planner.py).
    planner: PlannerConfig = field(default_factory=PlannerConfig)

    @property
    def max_answer_bytes(self) -> int:
        """An answer that lists many records (a hint batch, a page of leases) stops growing
        once past this many bytes, and still fits gRPC's default receive limit with one more
        item of the largest kind this registry accepts: a lease record of max_record_bytes
        (its handle may fill all of it) and, beside it in a hint, two node specs and the
        planner's estimates (at most 9 ids and 13 free texts: counted as 16 of each), then the
        rest of a batch answered with BATCH_FULL."""
        hint_beyond_lease = 16 * (4 * self.max_id_length + self.max_text_bytes)
        batch_rest = MAX_HINT_BATCH * BATCH_FULL_RESULT_BYTES
        return GRPC_MAX_RECEIVE_BYTES - self.max_record_bytes - hint_beyond_lease - batch_rest

    def idle_ttl(self) -> IdleTtlConfig:
        return IdleTtlConfig(
            default_s=self.default_lease_ttl_s,
            learn=self.learn_idle_ttl,
            percentile=self.idle_ttl_percentile,
            min_s=self.min_idle_ttl_s,
            max_s=min(self.max_idle_ttl_s, self.max_lease_ttl_s),
        )

    def __post_init__(self) -> None:
        if self.default_lease_ttl_s <= 0 or self.max_lease_ttl_s < self.default_lease_ttl_s:
            raise ValueError("need 0 < default lease TTL <= max lease TTL")
        if self.heartbeat_interval_s <= 0 or self.session_ttl_s <= self.heartbeat_interval_s:
            raise ValueError("need 0 < heartbeat interval < session TTL")
        if not 0 < self.max_record_bytes <= MAX_RECORD_BYTES:
            raise ValueError(f"the record size bound must be within (0, {MAX_RECORD_BYTES}]")
        if self.max_answer_bytes <= 0:
            raise ValueError("the record, id and text limits leave no room under gRPC's 4 MiB")
        if self.forget_down_nodes_after_s < 0:
            raise ValueError("the retention of DOWN nodes must not be negative")
        if self.drain_quiet_s < 0:
            raise ValueError("the drain's quiet time must not be negative")
        if self.turn_settle_timeout_s < 0:
            raise ValueError("the turn settle timeout must not be negative")
        if self.turn_timeout_s <= self.turn_settle_timeout_s:
            raise ValueError("the turn timeout must exceed the turn settle timeout")
        self.idle_ttl()  # validates the idle TTL settings
