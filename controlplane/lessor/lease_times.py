"""The lessor's time rules: how long a lease lives, how long its blocks must be kept for reads,
and what its reader is told about time.

Kept apart from the changes of state (``leases``) because every part asks them, read-only:
hints and leases' answers the time left, retention reports the acks and what to keep on a
reclaim, and the lessor itself the grace of an early end. One rule each: the expiry is the
record's ``expire_time``; reads (a claim, a fork's read pins) protect the blocks until
``reads_protected_until``, and nothing frees them before.
"""

from __future__ import annotations

import math

from kvbroker.common.rules.clock import stamp_duration
from kvbroker.common.rules.routing import LIVE_LEASE_STATES
from kvbroker.controlplane.context import RegistryContext
from kvbroker.controlplane.lessor.read_pins import ReadPins
from kvbroker.controlplane.records import codec
from kvbroker.controlplane.records.answers import LeaseAnswer, lease_answer
from kvbroker.controlplane.records.model import CLAIMED, Lease
from kvbroker.controlplane.sessions.idle_ttl import IdleTtl
from kvbroker.controlplane.sessions.nodes import NodeSessions
from kvbroker.v1 import lease_pb2


class LeaseTimes:
    def __init__(self, context: RegistryContext, nodes: NodeSessions, idle_ttl: IdleTtl) -> None:
        self._config = context.config
        self._now = context.now
        self._validate = context.validate
        self._nodes = nodes
        self._idle_ttl = idle_ttl
        # Forks' read pins on live leases.
        self.pins = ReadPins()
        # Until then, early ends give the holder a full claim's grace: claims made by a
        # previous leader were not written down (they are soft state) and may still be reading.
        self.inherited_claims_until = 0.0

    @staticmethod
    def expires(lease: Lease) -> float:
        return lease.expire_time or 0.0

    def time_left(self, lease: Lease) -> float | None:
        """A live lease's time left as of now; None once it has ended."""
        return self.expires(lease) - self._now() if lease.state in LIVE_LEASE_STATES else None

    def pin_time_left(self, lease: Lease) -> float | None:
        """Time left on a live lease's read pins as of now; None when none holds it."""
        if lease.state not in LIVE_LEASE_STATES:
            return None
        now = self._now()
        until = self.pins.until(lease.lease_id, now)
        return None if until is None else until - now

    def view(self, lease: Lease) -> LeaseAnswer:
        """The lease as an answer, with the time left (and on its pins) as of now."""
        return lease_answer(lease, self.time_left(lease), self.pin_time_left(lease))

    def view_into(self, lease: Lease, into: lease_pb2.Lease) -> None:
        """The lease as a hint answers it, written into ``into`` (an empty field of the
        hint): a hint's lease stays protobuf, built in place (``records.answers``)."""
        codec.lease_into(lease, into)
        time_left = self.time_left(lease)
        if time_left is not None:
            stamp_duration(into.time_to_live, time_left)
        pinned = self.pin_time_left(lease)
        if pinned is not None:
            stamp_duration(into.pin_time_to_live, pinned)

    def reads_protected_until(self, lease: Lease) -> float:
        """Until when a read of the lease may be in flight: its claim's end while CLAIMED, its
        read pins' last end. The one rule by which reads keep blocks: the expiry is never
        before it, an early end keeps the blocks for it, a reclaim before it is refused."""
        until = (lease.claim_expire_time or 0.0) if lease.state == CLAIMED else 0.0
        pinned = self.pins.until(lease.lease_id, self._now())
        return max(until, pinned or 0.0)

    def ack(self, lease: Lease, ack: lease_pb2.Lease) -> None:
        """Fills ``ack``, a retention report's answer for one lease (``codec.lease_ack``),
        with the time left as of now."""
        codec.lease_ack(lease, ack)
        if lease.state in LIVE_LEASE_STATES:
            stamp_duration(ack.time_to_live, self.expires(lease) - self._now())

    def ttl(self, requested: float | None, holder_id: str) -> float:
        """A lease's time to live: the idle TTL unless the caller asks for one, bounded by the
        registry's maximum and by the holder engine's hard cap. The engine frees retained
        blocks at its cap whatever the lease says, so a lease that outlived it would be
        offered, claimed and checked as readable for blocks already given to new work."""
        self._validate.ttl(requested)
        ttl = min(requested, self._config.max_lease_ttl_s) if requested else self._idle_ttl.ttl()
        return min(ttl, self.hard_cap_s(holder_id))

    def hard_cap_s(self, holder_id: str) -> float:
        """The holder engine's hard cap on retention (inf: none)."""
        cap = self._nodes.retention_hard_cap_s(holder_id)
        return math.inf if cap is None else cap

    def grace_for(self, lease: Lease) -> float:
        """How long the holder must keep blocks after an early end: covers in-flight reads."""
        now = self._now()
        grace = max(self._config.revoke_grace_s, self.inherited_claims_until - now)
        return max(grace, self.reads_protected_until(lease) - now)

    def keep_for(self, lease: Lease) -> float:
        """How long the holder must keep a live lease's blocks when it asked to free them and
        may not: to the lease's expiry (hints offer it until then, so the engine's deadline
        must not come first) and at least the grace for reads in flight."""
        return max(self.expires(lease) - self._now(), self.grace_for(lease))
