"""The registry's clock and conversions between seconds and protobuf time types."""

from __future__ import annotations

import time

from google.protobuf.duration_pb2 import Duration
from google.protobuf.timestamp_pb2 import Timestamp


class MonotonicClock:
    """Wall-clock seconds that never jump: the wall time at start plus monotonic elapsed time.

    Deadlines are computed and compared on this clock only; other machines are sent durations,
    never these values (docs/design.md, "Clock rules": compare deadlines as durations on each side).
    """

    def __init__(self) -> None:
        self._wall_at_start = time.time()
        self._mono_at_start = time.monotonic()

    def now(self) -> float:
        return self._wall_at_start + (time.monotonic() - self._mono_at_start)


def to_timestamp(seconds: float) -> Timestamp:
    ts = Timestamp()
    stamp_time(ts, seconds)
    return ts


def stamp_time(field: Timestamp, seconds: float) -> None:
    """Sets a message's Timestamp field in place: no temporary message to build and copy (the
    registry sets several per lease, and a temporary costs more than the field)."""
    field.seconds, field.nanos = divmod(int(seconds * 1e9), 1_000_000_000)


def stamp_duration(field: Duration, seconds: float) -> None:
    """Sets a message's Duration field in place (negative spans as zero)."""
    field.seconds, field.nanos = divmod(int(max(seconds, 0.0) * 1e9), 1_000_000_000)


def from_timestamp(ts: Timestamp) -> float:
    return float(ts.ToNanoseconds()) / 1e9


def to_duration(seconds: float) -> Duration:
    d = Duration()
    stamp_duration(d, seconds)
    return d


def from_duration(d: Duration) -> float:
    return float(d.ToNanoseconds()) / 1e9
