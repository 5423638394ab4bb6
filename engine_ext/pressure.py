"""Which retained conversations a decode engine gives back, and why: the rules of "retained KV
is a cache, never a reservation", apart from vLLM so they can be tested on a fake clock.

Two triggers, both evaluated every engine step:

* **Pressure.** The scheduler could not admit a waiting request, or grow a running one, for
  lack of free blocks. The shortfall is released at once, lowest value first; a request an
  idle engine keeps waiting is short of blocks whatever the count says
  (``admission_shortfall``).
* **Budget** (off unless set). Retention may hold at most a share of the cache
  (``kvbroker_retention_max_fraction``), so new work rarely has to wait for a release at all
  and some room is already free if the engine loses the registry.

Releases are *requested* from the registry (a ``ReclaimRequest``) and the blocks are freed only
on its command: the registry first ends the lease, so no hint offers it and a prefill node's
lease check declines it, and refuses when a read may be in flight (the lease is CLAIMED); the
engine then keeps that request until the claim ends and picks others. Value comes from
``kvbroker.common.rules.retention_value``, the same rule the CLI shows.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from kvbroker.common.rules.retention_value import RetentionValue
from kvbroker.v1 import lease_pb2

PRESSURE = lease_pb2.LEASE_END_CAUSE_PRESSURE
BUDGET = lease_pb2.LEASE_END_CAUSE_BUDGET


@dataclass(slots=True)
class RetainedRequest:
    """One finished request whose blocks the engine keeps (times on ``perf_counter``)."""

    request_id: str
    tokens: int
    # The KV blocks it holds. A conversation's turns share their prefix blocks (the next turn
    # on the same engine reuses them through the prefix cache), so what retention holds is the
    # union of these, and what releasing one frees is the part no other retained request holds.
    block_ids: frozenset[int]
    # Never kept past this, whatever the registry says.
    hard_cap: float
    # The deadline the worker applies now.
    deadline: float
    # Last turn or renewal, and the idle TTL the registry gave then.
    last_active: float
    ttl_s: float
    # When a reclaim was asked for (None: not asked, or refused since).
    reclaim_asked_at: float | None = None
    # A read may be in flight until then (the registry refused a reclaim, or said CLAIMED).
    claimed_until: float = 0.0
    # Why the registry ended the lease, once it has (what the free is reported as).
    end_cause: int = lease_pb2.LEASE_END_CAUSE_UNSPECIFIED

    @property
    def blocks(self) -> int:
        return len(self.block_ids)

    def value(self, now: float) -> RetentionValue:
        return RetentionValue(
            tokens=self.tokens,
            blocks=self.blocks,
            idle_s=max(now - self.last_active, 0.0),
            ttl_s=self.ttl_s,
        )

    def being_reclaimed(self, now: float, retry_s: float) -> bool:
        return self.reclaim_asked_at is not None and now - self.reclaim_asked_at < retry_s


def blocks_to_admit(prompt_tokens: int, block_size: int, hit_blocks_in_use: int) -> int:
    """Free blocks the scheduler needs to admit a request of ``prompt_tokens`` (and its first
    output token). A local prefix hit saves only the hit blocks that some request holds: a hit
    block that is itself free (an evictable cached block, e.g. the previous turn's KV after the
    prefill node read it) leaves the free pool when the request takes it, so it costs a free
    block like a new one. Counting every local hit as free capacity under-estimated exactly the
    follow-up turns of long conversations, which then waited for blocks nobody released."""
    return -(-(prompt_tokens + 1) // block_size) - hit_blocks_in_use


def admission_shortfall(
    needed_blocks: int, free_blocks: int, waited_s: float, engine_idle: bool, patience_s: float
) -> int:
    """Blocks retention owes a waiting request: what it needs beyond the free blocks, and at
    least one once it has waited ``patience_s`` on an engine that scheduled nothing.

    vLLM admits by rules a connector does not see (blocks reserved for KV loads in flight, a
    watermark), so a count that says a request fits while the scheduler keeps it waiting is
    possible; on an idle engine nothing else will ever free a block, and the request would wait
    for a release nobody asks for (measured: decode engines idle for minutes with requests
    waiting and 90 % of their cache retained). An idle engine with a request waiting that long
    is short of blocks whatever the count says."""
    counted = needed_blocks - free_blocks
    if engine_idle and waited_s >= patience_s:
        return max(counted, 1)
    return counted


def choose_reclaims(
    retained: Iterable[RetainedRequest],
    now: float,
    shortfall_blocks: int,
    budget_blocks: int,
    retry_s: float,
) -> list[tuple[RetainedRequest, int]]:
    """What to ask the registry to release now, with the cause: enough of the lowest-value
    requests to cover ``shortfall_blocks`` (PRESSURE), then to bring what retention holds
    within ``budget_blocks`` (BUDGET). Blocks are counted once however many retained requests
    share them, and releasing a request frees only the blocks no other one still holds.
    Blocks already being reclaimed count as freed; requests a read may be in flight for are
    never chosen."""
    entries = list(retained)
    holders = Counter(block for r in entries for block in r.block_ids)

    def release(request: RetainedRequest) -> int:
        """Takes the request's holds off the count; the blocks that frees."""
        holders.subtract(request.block_ids)
        return sum(holders[block] == 0 for block in request.block_ids)

    reclaiming = sum(release(r) for r in entries if r.being_reclaimed(now, retry_s))
    pressure_left = shortfall_blocks - reclaiming
    budget_left = sum(count > 0 for count in holders.values()) - budget_blocks
    if pressure_left <= 0 and budget_left <= 0:
        return []
    candidates = sorted(
        (
            r
            for r in entries
            if not r.being_reclaimed(now, retry_s)
            and r.claimed_until <= now
            and r.end_cause == lease_pb2.LEASE_END_CAUSE_UNSPECIFIED
        ),
        key=lambda r: r.value(now).release_order(),
    )
    chosen: list[tuple[RetainedRequest, int]] = []
    for request in candidates:
        if pressure_left > 0:
            chosen.append((request, PRESSURE))
        elif budget_left > 0:
            chosen.append((request, BUDGET))
        else:
            break
        freed = release(request)
        pressure_left -= freed
        budget_left -= freed
    return chosen


def end_cause_of_free(request: RetainedRequest, now: float) -> int:
    """Why the engine freed a retained request's blocks: the registry's cause when it ended
    the lease, the hard cap or the idle deadline when one passed, otherwise a read (vLLM frees
    after the prefill node's read notification)."""
    if request.end_cause != lease_pb2.LEASE_END_CAUSE_UNSPECIFIED:
        return request.end_cause
    if now >= request.hard_cap:
        return lease_pb2.LEASE_END_CAUSE_ENGINE
    if now >= request.deadline:
        return lease_pb2.LEASE_END_CAUSE_IDLE
    return lease_pb2.LEASE_END_CAUSE_READ
