"""How long a lease lives without activity: the idle TTL, learned from the deployment's own
gaps between turns.

A lease's lifetime comes from its conversation's activity, never from the engine's hard cap:
every turn grants a fresh lease, a keep-alive renews it, and otherwise it ends after the idle
TTL. A fixed TTL is either too short for agents waiting on slow tools or far too long for chats
whose users left; so the registry watches the gaps it sees (from a conversation's last
retention or renewal to its next turn's hint) and uses a high percentile of the recent ones,
bounded. Until it has seen enough gaps, or with learning off, it uses the configured default.
Retention is a cache: an idle TTL that is a little long costs nothing when the engine needs the
blocks, because it then releases the lowest-value conversations at once.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass


@dataclass(frozen=True)
class IdleTtlConfig:
    """Built by ``RegistryConfig.idle_ttl`` (the defaults live there)."""

    default_s: float
    learn: bool
    percentile: float
    min_s: float
    max_s: float
    # Recent gaps kept, and how many are needed before the learned value is used.
    window: int = 1000
    min_samples: int = 20

    def __post_init__(self) -> None:
        if not 0 < self.min_s <= self.max_s:
            raise ValueError("need 0 < minimum idle TTL <= maximum idle TTL")
        if not 0 < self.percentile <= 1:
            raise ValueError("the idle TTL percentile must be in (0, 1]")
        if self.default_s <= 0 or self.window < 1 or self.min_samples < 1:
            raise ValueError("the idle TTL default, window and sample count must be positive")


class IdleTtl:
    # The learned value is recomputed after this many new gaps (a sort of the window).
    _REFRESH_EVERY = 16

    def __init__(self, config: IdleTtlConfig) -> None:
        self.config = config
        self._gaps: collections.deque[float] = collections.deque(maxlen=config.window)
        self._since_refresh = 0
        self._learned: float | None = None

    def observe_gap(self, seconds: float) -> None:
        if not self.config.learn or seconds < 0:
            return
        self._gaps.append(seconds)
        self._since_refresh += 1
        if self._since_refresh >= self._REFRESH_EVERY or self._learned is None:
            self._refresh()

    def _refresh(self) -> None:
        self._since_refresh = 0
        if len(self._gaps) < self.config.min_samples:
            return
        ordered = sorted(self._gaps)
        gap = ordered[min(int(self.config.percentile * len(ordered)), len(ordered) - 1)]
        self._learned = min(max(gap, self.config.min_s), self.config.max_s)

    @property
    def learned(self) -> float | None:
        """The learned idle TTL, or None while there are too few gaps (or learning is off)."""
        return self._learned

    def ttl(self) -> float:
        return self._learned if self._learned is not None else self.config.default_s

    @property
    def samples(self) -> int:
        return len(self._gaps)
