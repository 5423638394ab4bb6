"""What every part of the registry shares, handed over once: the store, the settings, the
metrics, the clock, the deadline heap, the input checks and the logger. A part's constructor
takes this and only what is particular to it (the parts it calls, its own state).

Parts copy what they use into their own attributes when built: a hint reads them many times,
and one more attribute hop on each read would show at saturation."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import structlog

from kvbroker.controlplane.config import RegistryConfig
from kvbroker.controlplane.deadlines import DeadlineQueue
from kvbroker.controlplane.metrics import RegistryMetrics
from kvbroker.controlplane.records.validation import Validation
from kvbroker.controlplane.storage.store import Store


@dataclass(frozen=True, slots=True)
class RegistryContext:
    store: Store
    config: RegistryConfig
    metrics: RegistryMetrics
    now: Callable[[], float]
    deadlines: DeadlineQueue
    validate: Validation
    log: structlog.typing.FilteringBoundLogger
