"""What the lessor derives from each lease's record, kept in step from one place: its
deadlines (expiry, a claim's end, when an ended lease is forgotten) and its entry in the
prefix index.

Every change of a lease's state passes through ``LeaseTracking.track`` (the lessor's ``_put``
and a takeover's rebuild), so the record's times are the one truth and the deadline heap and
the index follow them here and nowhere else.

A replay reports thousands of leases at once: between ``defer`` and ``stop_deferring`` the
work a live lease's record asks for (its index entry, its deadlines) waits, one entry a lease
(the last record wins), and is done at each ``flush`` by the same ``_track``. An ended lease
is never deferred (its pending record is tracked first, then it): the index never offers an
ended lease and its pins are forgotten at once. The caller flushes before it yields to the
event loop and before anything reads the index.
"""

from __future__ import annotations

from kvbroker.common.rules.routing import LIVE_LEASE_STATES
from kvbroker.common.rules.sessionless import Retained
from kvbroker.common.rules.tenants import tenant_of
from kvbroker.controlplane.config import RegistryConfig
from kvbroker.controlplane.deadlines import DeadlineKey, DeadlineKind, DeadlineQueue
from kvbroker.controlplane.lessor.prefix_index import PrefixIndex, Scope, indexed_hashes
from kvbroker.controlplane.lessor.read_pins import ReadPins
from kvbroker.controlplane.records import codec
from kvbroker.controlplane.records.model import CLAIMED, Lease
from kvbroker.controlplane.sessions.nodes import NodeSessions

LEASE_EXPIRY = DeadlineKind.LEASE_EXPIRY
CLAIM_END = DeadlineKind.CLAIM_END
FORGET_LEASE = DeadlineKind.FORGET_LEASE


class LeaseTracking:
    def __init__(
        self,
        config: RegistryConfig,
        deadlines: DeadlineQueue,
        nodes: NodeSessions,
        prefix_index: PrefixIndex,
        pins: ReadPins,
    ) -> None:
        self._config = config
        self._deadlines = deadlines
        self._nodes = nodes
        self._prefix_index = prefix_index
        self._pins = pins
        # Live leases whose tracking waits for ``flush`` (None: tracking is immediate).
        self._deferred: dict[str, Lease] | None = None

    def defer(self) -> None:
        """Until ``stop_deferring``, a live lease's tracking waits for the next ``flush``
        (the last record of each lease wins)."""
        self._deferred = {}

    def flush(self) -> None:
        """Tracks the deferred leases (deferring goes on)."""
        deferred = self._deferred
        if deferred:
            self._deferred = {}
            for lease in deferred.values():
                self._track(lease)

    def stop_deferring(self) -> None:
        self.flush()
        self._deferred = None

    def clear(self) -> None:
        """Forgets the index and the pins (a takeover, before it tracks every lease again)."""
        self._deferred = None
        self._prefix_index.clear()
        self._pins.clear()

    def track(self, lease: Lease) -> None:
        """Follows the lease's record now, or at the flush while deferring (a live lease)."""
        deferred = self._deferred
        if deferred is None:
            self._track(lease)
        elif lease.state in LIVE_LEASE_STATES:
            deferred[lease.lease_id] = lease
        else:
            pending = deferred.pop(lease.lease_id, None)
            if pending is not None:
                self._track(pending)
            self._track(lease)

    def _track(self, lease: Lease) -> None:
        """The deadlines of a lease as its record says: while live, its expiry and (CLAIMED)
        its claim's end; once ended, when it is forgotten. The prefix index follows the same
        states: a live lease is found by content, an ended one is not."""
        lease_id = lease.lease_id
        self._index(lease)
        if lease.state in LIVE_LEASE_STATES:
            self._follow((LEASE_EXPIRY, lease_id), lease.expire_time or 0.0)
            claimed = lease.state == CLAIMED
            self._follow(
                (CLAIM_END, lease_id), (lease.claim_expire_time or 0.0) if claimed else None
            )
            self._deadlines.cancel((FORGET_LEASE, lease_id))
        else:
            self._deadlines.cancel((LEASE_EXPIRY, lease_id))
            self._deadlines.cancel((CLAIM_END, lease_id))
            forget_at = (lease.end_time or 0.0) + self._config.ended_lease_retention_s
            self._follow((FORGET_LEASE, lease_id), forget_at)

    def scope(self, lease: Lease) -> Scope | None:
        """The scope the lease is found under: its tenant, its holder's model and block size
        (None: its holder is not routable, so there is nothing to find it for)."""
        holder = self._nodes.runtime.get(lease.node_id)
        if holder is None:
            return None
        spec = holder.spec
        return Scope(tenant_of(lease.conversation_id), spec.model, spec.block_size)

    def _index(self, lease: Lease) -> None:
        """Keeps the prefix index in step with the lease's state."""
        lease_id = lease.lease_id
        if lease.state not in LIVE_LEASE_STATES:
            scope = self._prefix_index.scope(lease_id)
            if scope is not None:
                self._prefix_index.remove(lease_id, indexed(lease, scope.block_size))
            self._pins.forget(lease_id)
            return
        if lease_id in self._prefix_index:
            return
        scope = self.scope(lease)
        if scope is not None:
            self._prefix_index.add(lease_id, scope, indexed(lease, scope.block_size))

    def _follow(self, key: DeadlineKey, when: float | None) -> None:
        """Sets a deadline to ``when`` (None: none), leaving an unchanged one as it is."""
        if when is None:
            self._deadlines.cancel(key)
        elif self._deadlines.deadline(key) != when:
            self._deadlines.schedule(key, when)


def indexed(lease: Lease, block_size: int) -> list[tuple[int, bytes]]:
    """The (block, hash) pairs the prefix index keys the lease by at ``block_size``."""
    return indexed_hashes(lease.checkpoints, lease.block_hash_stride, lease.token_count, block_size)


def retained(lease: Lease) -> Retained:
    """The lease's content as the sessionless rule compares it."""
    hashes = codec.checkpoint_hashes(lease.checkpoints)
    return Retained(hashes, lease.block_hash_stride, lease.token_count)
