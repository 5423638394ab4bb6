"""Whether the engine is ready, from its health probes.

A refused connection or an unhealthy answer is the engine's own word and counts at once. A
probe that times out is not: a busy engine (or a busy host) answers late, and one slow answer
must not take the node out of routing, where the registry would have no node to offer for a
second. Only ``unready_after_timeouts`` timeouts in a row make the node not ready.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Probe(enum.Enum):
    HEALTHY = "healthy"
    UNHEALTHY = "unhealthy"  # refused, or answered other than 200
    TIMED_OUT = "timed_out"


@dataclass(slots=True)
class Readiness:
    unready_after_timeouts: int
    ready: bool = False
    timeouts_in_a_row: int = 0

    def observe(self, probe: Probe) -> bool:
        """Takes one probe's outcome; returns whether the engine is ready now."""
        if probe is Probe.TIMED_OUT:
            self.timeouts_in_a_row += 1
            if self.timeouts_in_a_row >= self.unready_after_timeouts:
                self.ready = False
        else:
            self.timeouts_in_a_row = 0
            self.ready = probe is Probe.HEALTHY
        return self.ready
