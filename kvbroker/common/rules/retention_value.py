"""What keeping one conversation's KV on a decode node is worth: the one rule that ranks
retained conversations, used by the engine to pick what to release under memory pressure and
by the CLI to show why (``kvbroker lease ls/show``).

Kept deliberately simple, so an operator can check a ranking by hand:

* the saving if the conversation comes back is its retained tokens (what P would otherwise
  recompute);
* the chance that it comes back falls linearly with its idle time, from 1 when it was last
  active to 0 at the end of its idle TTL (the lease ends there anyway);
* the cost is the blocks it holds.

``value = p_next * tokens / blocks``: expected tokens saved per block held. Ties (and values of
zero) release the longest idle first.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvbroker.v1 import lease_pb2


@dataclass(frozen=True, slots=True)
class RetentionValue:
    tokens: int
    blocks: int
    # Seconds since the conversation was last active (its last turn or keep-alive).
    idle_s: float
    # The idle TTL it was given then: how long it may stay idle before its lease ends.
    ttl_s: float

    @property
    def p_next(self) -> float:
        """How likely another turn is, given the idle time so far (linear decay over the TTL)."""
        if self.ttl_s <= 0:
            return 0.0
        return min(max(1.0 - self.idle_s / self.ttl_s, 0.0), 1.0)

    @property
    def value(self) -> float:
        """Expected tokens saved per block held."""
        return self.p_next * self.tokens / max(self.blocks, 1)

    def release_order(self) -> tuple[float, float]:
        """Sort key: the first to release comes first."""
        return self.value, -self.idle_s


def of_lease(lease: lease_pb2.Lease) -> RetentionValue:
    """A live lease's rank inputs as the registry reports them: the TTL it got at its last
    grant or renewal (expiry minus renewal) and the idle time since (that TTL minus the time
    left). Durations only, so the reader's clock does not matter."""
    ttl_s = (lease.expire_time.ToNanoseconds() - lease.renew_time.ToNanoseconds()) / 1e9
    left_s = lease.time_to_live.ToNanoseconds() / 1e9
    return RetentionValue(
        tokens=lease.token_count,
        blocks=sum(len(group.block_ids) for group in lease.handle.remote_block_groups),
        idle_s=max(ttl_s - left_s, 0.0),
        ttl_s=ttl_s,
    )
