"""Dry-run hints answered in the router's own process (``RouterConfig.local_hints``), from a
copy of the registry leader's hint state that the router watches as a follower does
(``WatchHintState``, from whichever replica the router reaches: a follower re-serves its own
copy), by the rule followers answer by (``kvbroker.common.rules.fed_hints``): so a placement
hop asks nobody on its hot path.

Only hints that write nothing (``fed_hints.served_locally``): a turn's hint claims the lease it
offers, a write on the leader, so it is always the registry's. A copy further behind than
``hint_staleness_s`` (or none: the watch broke, the registry is away, this router's credential
may not watch) is not used: the registry is asked, as without a copy. However late a copy, a
hint it gives never makes a prefill node read freed KV: a dry run claims nothing, and a prefill
node reads only a lease the leader confirms claimed at the handle's epoch (docs/design.md,
"Hints in the router").
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import math
import time
from collections.abc import Callable

from kvbroker.common.client.hint_watch import FollowedHints, MessageHintView
from kvbroker.common.rules.fed_hints import FeedClock, fed_hint, served_locally
from kvbroker.router.metrics import RouterMetrics
from kvbroker.v1 import registry_pb2
from kvbroker.v1.registry_pb2_grpc import RegistryServiceStub

# How long a broken watch waits before it asks again.
RETRY_S = 0.5


class HintSource(enum.Enum):
    """Who answered a dry-run hint (the ``x-kvbroker-hint-source`` header, and the metric's
    label): the router's copy, or the registry, asked because the hint was not one a copy
    may answer (``FORWARDED``) or because the copy was too far behind (``STALE``)."""

    LOCAL = "local"
    FORWARDED = "forwarded"
    STALE = "stale"


class LocalHints:
    """The router's copy of the leader's hint state and the rule it answers by."""

    def __init__(
        self,
        staleness_s: float,
        metrics: RouterMetrics,
        now: Callable[[], float] = time.monotonic,
    ) -> None:
        self.staleness_s = staleness_s
        self._metrics = metrics
        self._followed = FollowedHints(lambda: MessageHintView(FeedClock(now)), RETRY_S)
        self._turn = itertools.count()
        self._task: asyncio.Task[None] | None = None

    def start(self, stub: RegistryServiceStub) -> None:
        self._task = asyncio.create_task(self._followed.run(stub), name="kvbroker-router-hints")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def answer(
        self, request: registry_pb2.GetRoutingHintRequest
    ) -> tuple[registry_pb2.RoutingHint | None, HintSource]:
        """The hint from the copy, or None and why the registry must answer it. Raises
        ``routing.NoReadyNode`` when the copy has no ready node for the model."""
        view = self._followed.view
        if not served_locally(request):
            source = HintSource.FORWARDED
        else:
            behind = view.clock.behind_s() if view is not None else math.inf
            self._metrics.hint_state_behind.set(behind)
            source = HintSource.LOCAL if behind <= self.staleness_s else HintSource.STALE
        self._metrics.local_hints.labels(source.value).inc()
        if source is not HintSource.LOCAL or view is None:
            return None, source
        return fed_hint(view, request.conversation_id, request.model, next(self._turn)), source
